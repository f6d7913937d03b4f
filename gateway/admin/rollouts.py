"""Rollout endpoints under /admin/models/{model}/rollout."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from enum import Enum
from typing import Annotated, Any

from fastapi import APIRouter, Query

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.rollout import effects
from gateway.rollout.controller import RolloutController
from gateway.rollout.evidence_words import with_words_all
from gateway.rollout.history import finished_rollouts
from gateway.rollout.spec import RolloutSpec


class Command(str, Enum):
    promote = "promote"
    pause = "pause"
    resume = "resume"
    abort = "abort"
    acknowledge = "acknowledge"


def rollout_router(controller: RolloutController) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.post("/models/{model}/rollout", summary="Start a progressive rollout (canary must be READY; one per model)")
    async def start(model: ModelName, spec: RolloutSpec, who: Actor) -> dict[str, Any]:
        warnings = await effects.of_start(controller.store, model, spec)
        await controller.begin(model, spec, who)
        return {**await controller.status(model), "warnings": warnings}

    @router.get("/models/{model}/rollout", summary="State, step, weights, recent verdicts with their numbers, history")
    async def status(model: ModelName, _: Actor) -> dict[str, Any]:
        return await controller.status(model)

    @router.get("/models/{model}/rollouts",
                summary="The model's finished rollouts, newest first, each with its verdicts and the judge's evidence "
                "(the newest rollout_history_per_model are kept)")
    async def finished(model: ModelName, _: Actor,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
        return {"model": model, "rollouts": [with_words_all(doc) for doc in
                                             await finished_rollouts(controller.store, model, limit)]}

    @router.post("/models/{model}/rollout/{command}",
                 summary="promote (next step now), pause, resume, abort (back to stable); acknowledge a finished "
                 "rollback (it leaves the console's Needs attention)")
    async def act(model: ModelName, command: Command, who: Actor) -> dict[str, Any]:
        warnings = await effects.of_command(controller.store, model, command.value)
        if command is Command.acknowledge:
            await controller.acknowledge(model, who)
        else:
            await controller.command(model, command.value, who)
        return {**await controller.status(model), "warnings": warnings}

    return router
