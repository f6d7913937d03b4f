"""Composition root: builds every part from Settings and wires the two planes together.

``/v2/...`` goes straight to the lean :class:`~gateway.proxy.http.HttpProxy`; everything
else (``/admin``, ``/metrics``, ``/healthz``, ``/readyz``) goes to a FastAPI app whose
lifespan starts and stops the control plane. No module-level singletons: tests build as
many gateways as they like.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from gateway.admin.api import admin_router
from gateway.admin.auth import Authenticator
from gateway.admin.fleets import fleets_router
from gateway.admin.rollouts import rollout_router
from gateway.admin.versions import versions_router
from gateway.errors import GatewayError
from gateway.fleet.forward import FleetGrpc, FleetHttp
from gateway.fleet.registry import Fleets
from gateway.grpc.front import start_server as start_front
from gateway.grpc.grpcio_front import GrpcProxy
from gateway.grpc.grpcio_front import start_server as start_grpc
from gateway.grpc.router import GrpcRouter
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy, Receive, Scope, Send
from gateway.proxy.shadow import ShadowMirror
from gateway.rollout.controller import RolloutController
from gateway.sequences import SequencePins
from gateway.services.lifecycle import ModelLifecycle
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.services.triton_control import TritonControl
from gateway.settings import Settings
from gateway.store.base import StateStore, make_store
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.fleet_metrics import FleetCollector
from gateway.telemetry.prometheus import GatewayCollector, make_registry, render
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import MetricsSource, PrometheusSource, RecorderSource
from gateway.upstream import HttpUpstream

log = logging.getLogger("gateway")
MAX_ADMIN_BODY = 64 * 1024


class Gateway:
    """The whole gateway as one ASGI application."""

    def __init__(self, settings: Settings, store: StateStore | None = None) -> None:
        self.settings = settings
        self.book = PolicyBook(settings.sticky_header)
        self.recorder = Recorder()
        self.fleets = Fleets(settings.fleet_specs(), pool_size=settings.pool_size,
                             connect_timeout_s=settings.connect_timeout_s, request_timeout_s=settings.request_timeout_s,
                             max_inflight=settings.max_inflight_per_server,
                             queue_timeout_s=settings.queue_timeout_ms / 1000, eject_after=settings.fleet_eject_after,
                             health_interval_s=settings.fleet_health_interval_s,
                             dns_refresh_s=settings.fleet_dns_refresh_s)
        self.upstream: HttpUpstream = FleetHttp(self.fleets.default)
        self.access_log = AccessLog() if settings.access_log else None
        self.pins = SequencePins()
        self.shadow = ShadowMirror(self.upstream)
        self.proxy = HttpProxy(self.book, self.upstream, self.recorder, self.access_log, self.pins, self.shadow)
        self.grpc: GrpcProxy | None = None
        self.grpc_router: GrpcRouter | None = None
        self.grpc_server: Any = None
        self.store = store or make_store(settings.store_url)
        self.triton = TritonControl(self.fleets.default)
        self.fleets.on_join(self.triton.sync_server)
        self.policies = PolicyService(self.store, self.book, self.triton)
        self.sync = StateSync(self.policies, settings.resync_interval_s)
        self.source = make_source(settings, self.recorder)
        self.lifecycle = ModelLifecycle(self.policies, self.recorder, self.pins)
        self.rollouts = RolloutController(self.policies, self.source, self.recorder, tick_s=settings.controller_tick_s,
                                          lifecycle=self.lifecycle, shadow=self.shadow)
        self.registry = make_registry(GatewayCollector(self.recorder, self.book, self.rollouts.states,
                                                       self.rollouts.rollbacks, self.shadow.stats))
        self.registry.register(FleetCollector(self.fleets))
        self.auth = Authenticator(settings.actor_tokens(), settings.insecure_admin)
        self.started = False
        self.control = self._control_app()

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="triton-gateway admin API", version="1", lifespan=self._lifespan,
                      docs_url="/admin/docs", redoc_url=None, openapi_url="/admin/openapi.json")
        app.add_api_route("/healthz", self.healthz, methods=["GET"], include_in_schema=False)
        app.add_api_route("/readyz", self.readyz, methods=["GET"], include_in_schema=False)
        app.add_api_route("/metrics", self.metrics, methods=["GET"], include_in_schema=False)
        app.include_router(admin_router(self.policies, self.auth), prefix="/admin", tags=["admin"])
        app.include_router(rollout_router(self.rollouts, self.auth), prefix="/admin", tags=["rollout"])
        app.include_router(versions_router(self.lifecycle, self.auth), prefix="/admin", tags=["versions"])
        app.include_router(fleets_router(self.fleets, self.auth), prefix="/admin", tags=["fleets"])
        app.add_exception_handler(GatewayError, _gateway_error)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
        app.add_exception_handler(ValidationError, _invalid_request)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v2"):
            await self.proxy(scope, receive, send)
        elif scope["type"] == "http" and scope["path"].startswith("/admin") and _too_large(scope):
            await JSONResponse({"error": f"request body over {MAX_ADMIN_BODY} bytes"}, 413)(scope, receive, send)
        else:
            await self.control(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        if not self.auth.enabled:
            log.error("admin API disabled: no GATEWAY_ADMIN_TOKEN / admin_tokens set (--insecure-admin to override)")
        elif self.auth.insecure:
            log.warning("admin API runs WITHOUT authentication (--insecure-admin): anyone can change routing")
        await self.store.open()
        await self.fleets.start()
        for model, spec in self.settings.policies.items():
            await self.store.seed_policy(model, spec, actor="settings")
        await self.sync.resync()
        self.sync.start()
        if self.access_log is not None:
            self.access_log.start()
        self.shadow.start()
        if self.settings.grpc_enabled:
            upstream = FleetGrpc(self.fleets.default)
            self.grpc_router = GrpcRouter(self.book, self.recorder, self.pins, upstream, self.access_log, self.shadow)
            if self.settings.grpc_server == "grpcio":
                self.grpc = GrpcProxy(self.grpc_router)
                self.grpc_server = await start_grpc(self.grpc, self.settings.host, self.settings.grpc_port)
            else:
                self.grpc_server = await start_front(self.grpc_router, self.settings.host, self.settings.grpc_port)
        if self.settings.controller_enabled:
            self.rollouts.start()
        self.started = True
        try:
            yield
        finally:
            self.started = False
            await self.rollouts.stop()
            await self.sync.stop()
            if self.access_log is not None:
                await self.access_log.stop()
            await self.shadow.stop()
            if self.grpc_server is not None:
                await self.grpc_server.stop(grace=5)
            if self.grpc is not None:
                await self.grpc.aclose()
            await self.fleets.stop()
            await self.store.close()

    async def metrics(self, request: Request) -> Response:
        body, content_type = render(self.registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    async def readyz(self) -> JSONResponse:
        if not self.started:
            return JSONResponse({"error": "gateway is starting: policies not loaded yet"}, status_code=503)
        try:
            response = await self.upstream.request(b"GET", b"/v2/health/live", [],
                                                   timeout_s=self.settings.connect_timeout_s)
            await response.read()
        except GatewayError as exc:
            return JSONResponse({"error": exc.message}, status_code=503)
        if response.status != 200:
            return JSONResponse({"error": f"upstream {self.upstream.name} is not live ({response.status})"},
                                status_code=503)
        return JSONResponse({"status": "ready", "policies": sorted(self.book.snapshot())})


def _too_large(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return not value.isdigit() or int(value) > MAX_ADMIN_BODY
        if name == b"transfer-encoding":
            return True  # admin bodies are small JSON documents: no unbounded chunked uploads
    return False


async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
    return JSONResponse({"error": exc.message}, status_code=exc.status)


async def _invalid_request(_: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg')}")
    return JSONResponse({"error": "invalid request: " + "; ".join(problems)}, status_code=422)


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)


def make_source(settings: Settings, recorder: Recorder) -> MetricsSource:
    if settings.metrics_source == "prometheus":
        return PrometheusSource(settings.prometheus_url)
    return RecorderSource(recorder)


def create_app(settings: Settings | None = None) -> Any:
    return Gateway(settings or Settings.load())
