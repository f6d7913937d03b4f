"""The gateway's ASGI entry: ``/v2/...`` to the lean data-plane handler, everything else to the
control app (admin API, SRE console, probes, ``/metrics``), with a size guard in front of ``/admin``
and ``/console``.

The dispatch is two string checks per request; FastAPI's routing never sees inference traffic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse

from gateway.proxy.http import Receive, Scope, Send

MAX_ADMIN_BODY = 64 * 1024

Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class Dispatch:
    """ASGI: inference to ``proxy``, the rest to ``control``."""

    proxy: Asgi
    control: Asgi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v2"):
            await self.proxy(scope, receive, send)
        elif scope["type"] == "http" and scope["path"].startswith(("/admin", "/console")) and _too_large(scope):
            await JSONResponse({"error": f"request body over {MAX_ADMIN_BODY} bytes"}, 413,
                               headers={"connection": "close"})(scope, receive, send)  # the body stays unread
        else:
            await self.control(scope, receive, send)


def _too_large(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return not value.isdigit() or int(value) > MAX_ADMIN_BODY
        if name == b"transfer-encoding":
            return True  # admin bodies are small JSON documents: no unbounded chunked uploads
    return False
