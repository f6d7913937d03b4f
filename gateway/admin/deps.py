"""What every admin router shares: the ``Actor`` dependency, path types and the error responses.

The authenticator is per app (no module-level singleton): the composition root puts it on
``app.state.auth``, and :func:`actor` reads it from the request's app.
"""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from pydantic import BaseModel, Field

from gateway.admin.auth import Authenticator

ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]


class ErrorBody(BaseModel):
    """Triton's own error shape, used for every 4xx/5xx."""

    error: str


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in {
        401: "missing or invalid bearer token",
        403: "a viewer (read-only) token on a request that changes something",
        404: "the model has no routing policy",
        409: "a version is not READY on Triton (the message names it and its state)",
        412: "If-Match names a stale revision",
        413: "request body too large",
        422: "the request does not validate (the message says which field and why)",
        503: "Triton, the state store, or the admin API itself is unavailable",
    }.items()
}
ERRORS[400] = {"model": ErrorBody, "description": "malformed header (e.g. If-Match)"}


def actor(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The actor (audit-trail name) behind the request's bearer token; 401/503 otherwise. A viewer
    token may read (GET) and is refused anything else with 403."""
    auth: Authenticator = request.app.state.auth
    if request.method in ("GET", "HEAD"):
        return auth.identify(authorization).name
    return auth.actor(authorization)


Actor = Annotated[str, Depends(actor)]
