"""Version lifecycle endpoints: load beside the serving versions; drain, then unload."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Any

from fastapi import APIRouter

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.policy import Version
from gateway.services.lifecycle import ModelLifecycle


def versions_router(lifecycle: ModelLifecycle) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/models/{model}/versions/{version}/load",
                 summary="Load a version beside the serving ones; 200 once READY, Triton's reason if it fails")
    async def load(model: ModelName, version: Version, who: Actor) -> dict[str, Any]:
        return await lifecycle.load(model, version, who)

    @router.post("/models/{model}/versions/{version}/unload",
                 summary="Take the version out of every policy, wait until nothing uses it, then unload it")
    async def unload(model: ModelName, version: Version, who: Actor) -> dict[str, Any]:
        return await lifecycle.unload(model, version, who)

    return router
