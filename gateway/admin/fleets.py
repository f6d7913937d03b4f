"""``GET /admin/fleets``: every fleet's servers with health, in-flight count, counters and READY versions."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Any

from fastapi import APIRouter

from gateway.admin.deps import ERRORS, Actor
from gateway.fleet.registry import Fleets


def fleets_router(fleets: Fleets) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.get("/fleets", summary="Each fleet's servers: health, in flight, requests, errors, loaded versions")
    async def list_fleets(_: Actor) -> dict[str, Any]:
        return {"fleets": fleets.describe()}

    return router
