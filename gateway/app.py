"""Composition root: builds every part from Settings and wires the two planes together.

``/v2/...`` goes straight to the lean :class:`~gateway.proxy.http.HttpProxy`; everything
else (``/admin``, ``/metrics``, ``/healthz``, ``/readyz``) goes to a FastAPI app whose
lifespan starts and stops the control plane. No module-level singletons: tests build as
many gateways as they like, each with its own registry.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.errors import GatewayError
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy, Receive, Scope, Send
from gateway.settings import Settings
from gateway.telemetry.recorder import Recorder
from gateway.upstream import HttpUpstream

log = logging.getLogger("gateway")


class Gateway:
    """The whole gateway as one ASGI application."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.book = PolicyBook(settings.sticky_header)
        self.recorder = Recorder()
        self.upstream = HttpUpstream(settings.triton_url, max_connections=settings.pool_size,
                                     connect_timeout_s=settings.connect_timeout_s,
                                     request_timeout_s=settings.request_timeout_s)
        self.proxy = HttpProxy(self.book, self.upstream, self.recorder)
        self.started = False
        self.control = FastAPI(title="triton-gateway", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                               openapi_url=None)
        self.control.add_api_route("/healthz", self.healthz, methods=["GET"], include_in_schema=False)
        self.control.add_api_route("/readyz", self.readyz, methods=["GET"], include_in_schema=False)
        self.control.add_exception_handler(GatewayError, _gateway_error)  # type: ignore[arg-type]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v2"):
            await self.proxy(scope, receive, send)
        else:
            await self.control(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        for model, spec in self.settings.policies.items():
            self.book.put(model, spec, revision=1)
        self.started = True
        try:
            yield
        finally:
            self.started = False
            await self.upstream.aclose()

    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    async def readyz(self) -> JSONResponse:
        if not self.started:
            return JSONResponse({"error": "gateway is starting: policies not loaded yet"}, status_code=503)
        try:
            response = await self.upstream.request(b"GET", b"/v2/health/live", [],
                                                   timeout_s=self.settings.connect_timeout_s)
        except GatewayError as exc:
            return JSONResponse({"error": exc.message}, status_code=503)
        if response.status != 200:
            return JSONResponse({"error": f"upstream {self.upstream.name} is not live ({response.status})"},
                                status_code=503)
        return JSONResponse({"status": "ready", "policies": sorted(self.book.snapshot())})


async def _gateway_error(_: Any, exc: GatewayError) -> JSONResponse:
    return JSONResponse({"error": exc.message}, status_code=exc.status)


def create_app(settings: Settings | None = None) -> Gateway:
    return Gateway(settings or Settings.load())
