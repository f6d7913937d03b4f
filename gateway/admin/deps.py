"""What every admin router shares: the ``Actor`` dependency, path types and the error responses.

The authenticator is per app (no module-level singleton): the composition root puts it on
``app.state.auth``, and :func:`actor` reads it from the request's app.

:class:`JsonBodies` lets the admin API read a JSON body sent without ``Content-Type``, or
with the ``application/x-www-form-urlencoded`` that ``curl -d`` puts on it (the README's
examples, and every shell script written the same way), when it comes with a bearer token,
and refuses any other media type with 415 instead of a confusing validation error. Without a
token (``--insecure-admin``) only ``application/json`` is read: a page on any site may send a
form or a type-less body cross-site without asking, never that type (CORS preflight).
"""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
import json
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.auth import Authenticator
from gateway.client_address import ClientAddresses
from gateway.policy import ModelName

__all__ = ["Actor", "ERRORS", "ErrorBody", "JsonBodies", "ModelName", "actor"]


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
        415: "a body that is not JSON (no Content-Type, or curl -d's form type, is read as JSON)",
        422: "the request does not validate (the message says which field and why)",
        503: "Triton, the state store, or the admin API itself is unavailable",
    }.items()
}
ERRORS[400] = {"model": ErrorBody, "description": "malformed header (e.g. If-Match)"}


def actor(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The actor (audit-trail name) behind the request's bearer token; 401/503 otherwise (429 while
    its client is locked out for wrong tokens). A viewer token may read (GET) and is refused
    anything else with 403."""
    auth: Authenticator = request.app.state.auth
    client = request_client(request)
    if request.method in ("GET", "HEAD"):
        return auth.identify(authorization, client).name
    return auth.actor(authorization, client)


def request_client(request: Request) -> str:
    """Whose request this is, as the rest of the gateway says it (trusted proxies, IPv6 /64, the
    workers' forwarder: :meth:`ClientAddresses.of_control`)."""
    clients: ClientAddresses = request.app.state.clients
    peer = request.client.host if request.client is not None else None
    return clients.of_control(peer, request.scope["headers"])


Actor = Annotated[str, Depends(actor)]

# What a JSON body may come as: no Content-Type, or the one `curl -d` sends without being told.
_READ_AS_JSON = frozenset([b"", b"application/x-www-form-urlencoded"])
_JSON_TYPE = (b"content-type", b"application/json")


class JsonBodies:
    """ASGI middleware for ``/admin``: a body that comes with a bearer token is JSON whatever curl
    called it; other media 415, and so are form and type-less bodies without a token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/admin/"):
            await self.app(scope, receive, send)
            return
        media, body, bearer = b"", False, False
        headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
        for name, value in scope["headers"]:
            if name == b"content-type":
                media = value.split(b";", 1)[0].strip().lower()
            elif name == b"content-length":
                body = value.strip() not in (b"", b"0")
            elif name == b"transfer-encoding":
                body = True
            elif name == b"authorization":
                bearer = True
        if media in _READ_AS_JSON and bearer:
            scope = {**scope, "headers": [*headers, _JSON_TYPE]}
        elif media in _READ_AS_JSON and body and _insecure(scope):
            # No token to check (--insecure-admin): a page on any site can send a form or a
            # type-less body here without asking (a CORS "simple" request), but never an
            # Authorization header nor a JSON type; read as JSON, such a body started rollouts.
            await _refuse(send, "without an Authorization header the admin API reads only bodies sent as "
                                "Content-Type: application/json (add -H 'Content-Type: application/json' to curl -d): "
                                "a form or type-less body is one any web page can send")
            return
        elif body and media not in _READ_AS_JSON and media != b"application/json" and not media.endswith(b"+json"):
            shown = media.decode("latin-1")[:100]
            await _refuse(send, f"the admin API reads JSON bodies (Content-Type: application/json, or none, as curl "
                                f"-d sends them with a bearer token), not {shown}")
            return
        await self.app(scope, receive, send)


def _insecure(scope: Scope) -> bool:
    app = scope.get("app")
    auth = getattr(getattr(app, "state", None), "auth", None)
    return isinstance(auth, Authenticator) and auth.tokenless


async def _refuse(send: Send, message: str) -> None:
    answer = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": 415,
                "headers": [_JSON_TYPE, (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})
