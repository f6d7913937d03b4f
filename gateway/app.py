"""Composition root: builds every part from Settings and wires the two planes together.

``/v2/...`` goes straight to the lean :class:`~gateway.proxy.http.HttpProxy` (the dispatch is
``gateway.asgi``); everything else (``/admin``, ``/metrics``, ``/healthz``, ``/readyz``, see
``gateway.endpoints``) goes to a FastAPI app whose lifespan starts and stops the control
plane. No module-level singletons: tests build as many gateways as they like.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from gateway.admin.api import admin_router
from gateway.admin.auth import Authenticator
from gateway.admin.fleets import fleets_router
from gateway.admin.rollouts import rollout_router
from gateway.admin.versions import versions_router
from gateway.asgi import Dispatch
from gateway.endpoints import Probes, install_error_handlers
from gateway.fleet.forward import FleetGrpc, FleetHttp
from gateway.fleet.registry import Fleets
from gateway.grpc.front import start_server as start_front
from gateway.grpc.grpcio_front import GrpcProxy
from gateway.grpc.grpcio_front import start_server as start_grpc
from gateway.grpc.router import GrpcRouter
from gateway.pipeline import Pipeline
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy
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
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import make_source
from gateway.upstream import HttpUpstream

log = logging.getLogger("gateway")


class Gateway(Dispatch):
    """The whole gateway as one ASGI application: every part built from Settings, once."""

    proxy: HttpProxy
    control: FastAPI

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
        self.shadow = ShadowMirror(self.upstream, self.recorder)
        self.pipeline = Pipeline(self.book, self.recorder, self.pins, self.shadow, self.access_log)
        named = [fleet for fleet in self.fleets if fleet is not self.fleets.default]
        self.proxy = HttpProxy(self.pipeline, self.upstream, {fleet.name: FleetHttp(fleet) for fleet in named})
        self.grpc: GrpcProxy | None = None
        self.grpc_router: GrpcRouter | None = None
        self.grpc_server: Any = None
        self.store = store or make_store(settings.store_url)
        self.triton = TritonControl(self.fleets.default, {fleet.name: TritonControl(fleet) for fleet in named})
        self.fleets.on_join(self.triton.sync_server)
        self.policies = PolicyService(self.store, self.book, self.triton)
        self.sync = StateSync(self.store, self.policies, settings.resync_interval_s)
        self.source = make_source(settings.metrics_source, settings.prometheus_url, self.recorder)
        self.lifecycle = ModelLifecycle(self.store, self.triton, self.policies, self.recorder, self.pins)
        self.rollouts = RolloutController(self.store, self.triton, self.policies, self.source, self.recorder,
                                          tick_s=settings.controller_tick_s, lifecycle=self.lifecycle,
                                          shadow=self.shadow)
        self.registry = make_registry(GatewayCollector(self.recorder, self.book))
        self.registry.register(FleetCollector(self.fleets))
        self.probes = Probes(self.upstream, self.book, self.registry, settings.connect_timeout_s)
        self.auth = Authenticator(settings.actor_tokens(), settings.insecure_admin)
        self.control = self._control_app()

    @property
    def started(self) -> bool:
        return self.probes.started

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="triton-gateway admin API", version="1", lifespan=self._lifespan,
                      docs_url="/admin/docs", redoc_url=None, openapi_url="/admin/openapi.json")
        app.state.auth = self.auth  # read by the shared Actor dependency (gateway.admin.deps)
        app.include_router(self.probes.router())
        app.include_router(admin_router(self.policies), prefix="/admin", tags=["admin"])
        app.include_router(rollout_router(self.rollouts), prefix="/admin", tags=["rollout"])
        app.include_router(versions_router(self.lifecycle), prefix="/admin", tags=["versions"])
        app.include_router(fleets_router(self.fleets), prefix="/admin", tags=["fleets"])
        install_error_handlers(app)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        if not self.auth.enabled:
            log.error("admin API disabled: no GATEWAY_ADMIN_TOKEN / admin_tokens set (--insecure-admin to override)")
        elif self.auth.insecure:
            log.warning("admin API runs WITHOUT authentication (--insecure-admin): anyone can change routing")
        await self._start()
        self.probes.started = True
        try:
            yield
        finally:
            self.probes.started = False
            await self._stop()

    async def _start(self) -> None:
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
            await self._start_grpc()
        if self.settings.controller_enabled:
            self.rollouts.start()

    async def _start_grpc(self) -> None:
        upstream = FleetGrpc(self.fleets.default)
        named = {fleet.name: FleetGrpc(fleet) for fleet in self.fleets if fleet is not self.fleets.default}
        self.grpc_router = GrpcRouter(self.pipeline, upstream, named)
        if self.settings.grpc_server == "grpcio":
            self.grpc = GrpcProxy(self.grpc_router)
            self.grpc_server = await start_grpc(self.grpc, self.settings.host, self.settings.grpc_port)
        else:
            self.grpc_server = await start_front(self.grpc_router, self.settings.host, self.settings.grpc_port)

    async def _stop(self) -> None:
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


def create_app(settings: Settings | None = None) -> Any:
    return Gateway(settings or Settings.load())
