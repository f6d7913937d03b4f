"""``GET /admin/fleets``: every fleet's servers with health, in-flight count, counters and READY versions."""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header

from gateway.admin.api import ERRORS
from gateway.admin.auth import Authenticator
from gateway.fleet.registry import Fleets


def fleets_router(fleets: Fleets, auth: Authenticator) -> APIRouter:
    def actor(authorization: Annotated[str | None, Header()] = None) -> str:
        return auth.actor(authorization)

    Actor = Annotated[str, Depends(actor)]
    router = APIRouter(responses=ERRORS)

    @router.get("/fleets", summary="Each fleet's servers: health, in flight, requests, errors, loaded versions")
    async def list_fleets(_: Actor) -> dict[str, Any]:
        return {"fleets": fleets.describe()}

    return router
