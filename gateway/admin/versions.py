"""Version lifecycle endpoints: load beside the serving versions; drain, then unload."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.errors import BadRequest, Conflict, GatewayError, NotFound
from gateway.policy import Version
from gateway.services.lifecycle import ModelLifecycle
from gateway.services.version_diff import VersionDifferences, stable_of


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] | None = Field(
        None, description="the model configuration to load with (Triton's JSON form of config.pbtxt); without "
        "it, Triton's current configuration of the model, with the versions to serve")


def versions_router(lifecycle: ModelLifecycle, differences: VersionDifferences) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    async def must_exist(model: str, version: str) -> None:
        """404 for a version neither Triton nor the model repository has (it was compared, and
        said to share the stable's configuration); where Triton cannot answer, the comparison says so."""
        try:
            states = await lifecycle.triton.versions(model)
        except GatewayError:
            return
        if version not in states and not differences.has_folder(model, version):
            raise NotFound(f"version {version} of model '{model}' not found: Triton lists no such version"
                           + (" and the model repository has no such folder" if differences.repository else ""))

    @router.get("/models/{model}/versions/{version}/differences",
                summary="What differs between the version and the stable one (or ?against=): Triton's configuration "
                "field by field, and the files of both version folders where model_repository is set")
    async def compare(model: ModelName, version: Version, _: Actor,
                      against: Annotated[str | None, Query(max_length=300)] = None) -> dict[str, Any]:
        await must_exist(model, version)
        reason = "chosen"
        if against is not None and against.isdigit():  # a version of this model (not another model's target)
            await must_exist(model, against)
        if against is None:
            policy = await lifecycle.store.get_policy(model)
            rollout = await lifecycle.store.get_rollout(model)
            against, reason = stable_of(version, policy.document() if policy and policy.spec else None,
                                        rollout.document if rollout is not None else None,
                                        sorted(await lifecycle.serving(model)))
            if against is None:
                raise Conflict(f"version {version} of model '{model}': {reason}")
        try:
            found = await differences.compare(model, version, against)
        except ValueError as exc:
            raise BadRequest(f"against: {exc}") from None
        return {"model": model, "version": version, "against": against, "against_why": reason, **found}

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
