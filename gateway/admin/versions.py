"""Version lifecycle endpoints: load beside the serving versions; drain, then unload."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Any

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.policy import Version
from gateway.services.lifecycle import ModelLifecycle


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] | None = Field(
        None, description="the model configuration to load with (Triton's JSON form of config.pbtxt); without "
        "it, Triton's current configuration of the model, with the versions to serve")


def versions_router(lifecycle: ModelLifecycle) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/models/{model}/versions/{version}/load",
                 summary="Load a version beside the serving ones; 200 once READY, Triton's reason if it fails")
    async def load(model: ModelName, version: Version, who: Actor,
                   body: LoadRequest | None = Body(None)) -> dict[str, Any]:  # noqa: B008 (FastAPI's idiom)
        return await lifecycle.load(model, version, who, body.config if body is not None else None)

    @router.post("/models/{model}/versions/{version}/unload",
                 summary="Take the version out of every policy, wait until nothing uses it, then unload it")
    async def unload(model: ModelName, version: Version, who: Actor) -> dict[str, Any]:
        return await lifecycle.unload(model, version, who)

    return router
