"""Rollout endpoints under /admin/models/{model}/rollout."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from enum import Enum
from typing import Any

from fastapi import APIRouter

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.rollout.controller import RolloutController
from gateway.rollout.spec import RolloutSpec


class Command(str, Enum):
    promote = "promote"
    pause = "pause"
    resume = "resume"
    abort = "abort"


def rollout_router(controller: RolloutController) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/models/{model}/rollout", summary="Start a progressive rollout (canary must be READY; one per model)")
    async def start(model: ModelName, spec: RolloutSpec, who: Actor) -> dict[str, Any]:
        await controller.begin(model, spec, who)
        return await controller.status(model)

    @router.get("/models/{model}/rollout", summary="State, step, weights, recent verdicts with their numbers, history")
    async def status(model: ModelName, _: Actor) -> dict[str, Any]:
        return await controller.status(model)

    @router.post("/models/{model}/rollout/{command}",
                 summary="promote (next step now), pause, resume, abort (back to stable)")
    async def act(model: ModelName, command: Command, who: Actor) -> dict[str, Any]:
        await controller.command(model, command.value, who)
        return await controller.status(model)

    return router
