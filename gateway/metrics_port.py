"""Who may read ``/metrics``, and where: behind ``metrics_token`` and/or on ``metrics_port``.

``/metrics`` counts requests per model and version, and names each fleet's Triton servers by
address. Open on the data port, it told any client which version answered its requests
(counters read before and after matched 8 of 8), undoing ``expose_version_headers: false``, and
where Triton runs. So:

- ``metrics_token``: ``/metrics`` answers only ``Authorization: Bearer <metrics_token>`` (401
  otherwise; Prometheus sends it with ``authorization: {credentials: ...}``), compared as a
  digest like every token (:func:`gateway.admin.auth.digest`);
- ``metrics_port``: ``/metrics`` is served on that port only (a network policy or a firewall
  keeps clients off it), and the HTTP port answers 404 for it. With ``--workers`` the port is
  the control plane's, which holds the node's sums.

Either or both; neither keeps ``/metrics`` open on the HTTP port, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.auth import digest
from gateway.admin.throttle import TokenThrottle
from gateway.client_address import ClientAddresses
from gateway.errors import GatewayError, NotFound, TooManyAttempts, Unauthorized

log = logging.getLogger("gateway")
Render = Callable[[Request], Awaitable[Response]]


class MetricsAccess:
    """The token ``/metrics`` asks for (None: none), and whether the HTTP port serves it. A wrong
    token counts against its client in the node's :class:`TokenThrottle`, like every token."""

    def __init__(self, token: str | None, own_port: int | None, throttle: TokenThrottle | None = None,
                 clients: ClientAddresses | None = None) -> None:
        self._digest = None if token is None else digest(token)
        self.own_port = own_port
        self.throttle = throttle or TokenThrottle()
        self.clients = clients or ClientAddresses()

    def replace_token(self, token: str | None) -> None:
        """The token ``/metrics`` asks for from now on (SIGHUP)."""
        self._digest = None if token is None else digest(token)

    def refusal(self, request: Request, on_own_port: bool) -> GatewayError | None:
        """Why this request may not read ``/metrics``, or None."""
        if self.own_port is not None and not on_own_port:
            return NotFound(f"/metrics is served on its own port ({self.own_port}: metrics_port)")
        if self._digest is None:
            return None
        scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return Unauthorized("/metrics needs 'Authorization: Bearer <metrics_token>'")
        client = self.clients.of_control(request.client.host if request.client else None, request.scope["headers"])
        try:
            self.throttle.check(client)
        except TooManyAttempts as exc:
            return exc
        if not hmac.compare_digest(digest(presented.strip()), self._digest):
            self.throttle.failed(client, "/metrics")
            return Unauthorized("/metrics needs 'Authorization: Bearer <metrics_token>'")
        return None


def _answer(refusal: GatewayError) -> JSONResponse:
    headers = {name.decode(): value.decode() for name, value in refusal.headers}
    if isinstance(refusal, Unauthorized):
        headers["www-authenticate"] = "Bearer"
    return JSONResponse({"error": refusal.message}, status_code=refusal.status, headers=headers)


def guarded(access: MetricsAccess, render: Render, on_own_port: bool) -> Render:
    """``render`` behind ``access``'s checks, for the HTTP port's app or the metrics port's."""
    async def metrics(request: Request) -> Response:
        refusal = access.refusal(request, on_own_port)
        if refusal is not None:
            return _answer(refusal)
        return await render(request)

    return metrics


class MetricsServer:
    """``/metrics`` alone, on ``metrics_port``, in the process that holds the registry."""

    def __init__(self, access: MetricsAccess, render: Render, host: str, tls: dict[str, object]) -> None:
        assert access.own_port is not None
        app = Starlette(routes=[Route("/metrics", guarded(access, render, on_own_port=True), methods=["GET"])])
        config = uvicorn.Config(app, host=host, port=access.own_port, lifespan="off", access_log=False,
                                proxy_headers=False, log_level="warning", server_header=False,
                                **tls)  # type: ignore[arg-type]
        self.server = _SignalFree(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # its error (a taken port) says why
                raise OSError(f"metrics_port {self.server.config.port}: the server did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task


def tls_options(cert: object, key: object, client_ca: object) -> dict[str, object]:
    """The HTTP port's TLS for the metrics port too (uvicorn's options)."""
    if cert is None:
        return {}
    return {"ssl_certfile": cert, "ssl_keyfile": key,
            "ssl_ca_certs": None if client_ca is None else str(client_ca),
            "ssl_cert_reqs": ssl.CERT_NONE if client_ca is None else ssl.CERT_REQUIRED}


class _SignalFree(uvicorn.Server):
    """The process's own server handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
