"""Composition root: builds every part from Settings and wires the two planes together.

``/v2/...`` goes straight to the lean :class:`~gateway.proxy.http.HttpProxy` (the dispatch is
``gateway.asgi``); everything else (``/admin``, ``/metrics``, ``/healthz``, ``/readyz``, see
``gateway.endpoints``) goes to a FastAPI app whose lifespan starts and stops the control
plane. No module-level singletons: tests build as many gateways as they like.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI

from gateway import tls
from gateway.admin.api import admin_router
from gateway.admin.auth import Authenticator
from gateway.admin.deps import JsonBodies
from gateway.admin.fleets import fleets_router
from gateway.admin.rollouts import rollout_router
from gateway.admin.throttle import TokenThrottle
from gateway.admin.versions import versions_router
from gateway.asgi import Dispatch
from gateway.byte_budget import ByteBudget
from gateway.client_address import ClientAddresses
from gateway.console.routes import install_console
from gateway.console.sessions import Sessions
from gateway.console.timeline import Timeline
from gateway.console.views import Views
from gateway.control_surface import ControlCall, ControlGate, ControlMode
from gateway.endpoints import Probes, install_error_handlers
from gateway.fleet.forward import FleetHttp
from gateway.fleet.registry import Fleets
from gateway.grpc.fleet_upstream import FleetGrpc
from gateway.grpc.front_server import start_server as start_front
from gateway.grpc.grpcio_front import GrpcProxy
from gateway.grpc.grpcio_front import start_server as start_grpc
from gateway.grpc.health import Health
from gateway.grpc.router import GrpcRouter
from gateway.grpc.upstream import GrpcUpstream
from gateway.http2.server_stream import Limits
from gateway.metrics_port import MetricsAccess, MetricsServer, tls_options
from gateway.pipeline import Pipeline
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy
from gateway.proxy.limits import BodyReader
from gateway.proxy.shadow import ShadowMirror
from gateway.reload import LIVE
from gateway.rollout.controller import RolloutController
from gateway.sequences import SequencePins
from gateway.services.config_intent import apply_declared
from gateway.services.lifecycle import ModelLifecycle
from gateway.services.model_configs import SequenceModels
from gateway.services.policies import PolicyService
from gateway.services.replica_windows import ReplicaWindows
from gateway.services.replicas import Replicas
from gateway.services.state_sync import StateSync
from gateway.services.triton_control import TritonControl
from gateway.services.version_diff import VersionDifferences
from gateway.settings import LISTEN_BACKLOG, Settings
from gateway.store.base import AuditBounds, StateStore, make_store
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.fleet_metrics import FleetCollector
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import make_source
from gateway.upstream import HttpUpstream

log = logging.getLogger("gateway")
YOUNG_GC_THRESHOLD = 100_000  # see serving_collector


@contextlib.contextmanager
def serving_collector() -> Iterator[None]:
    """The garbage collector while the gateway serves.

    What startup built (modules, FastAPI's routes, protos) lives as long as the process: frozen,
    the collector stops walking it. Each full collection under load walked all of it (~150 ms,
    tens of µs per request).

    The young generation is collected after ``YOUNG_GC_THRESHOLD`` net allocations of tracked
    objects instead of Python's 700. The data path leaves no cycles, so a young collection finds
    nothing, but it ran whenever the requests in flight grew by 700 objects (one HTTP request in
    flight holds ~60-100): at 16 connections never, at 1,000 every burst of arrivals was collected,
    promoted, and walked again in the older generations (~30 young, 3 middle and 0.25 full
    collections per 1,000 requests: ~10 µs of each request's CPU). Cyclic garbage (errors'
    tracebacks) is still collected, after 100,000 objects instead of 700 (a few ms each time)."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_GC_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


class Gateway(Dispatch):
    """The whole gateway as one ASGI application: every part built from Settings, once."""

    proxy: HttpProxy
    control: FastAPI
    recorder_class: type[Recorder] = Recorder  # gateway.workers: a worker's reports deltas, the control plane's merges
    reuse_port = False  # gateway.workers: each worker listens on its own SO_REUSEPORT socket
    grpc_socket: Any = None  # gateway.workers: the gRPC listener the supervisor bound, shared by every worker

    def __init__(self, settings: Settings, store: StateStore | None = None) -> None:
        self.settings = settings
        self.book = PolicyBook(settings.sticky_header)
        self.recorder = self.recorder_class()
        self._grpc_tls = tls.upstream_grpc(settings)  # one context for every server's grpcs:// connection
        self.fleets = Fleets(settings.fleet_specs(), grpc_connect=self._grpc_connect, pool_size=settings.pool_size,
                             connect_timeout_s=settings.connect_timeout_s, request_timeout_s=settings.request_timeout_s,
                             max_inflight=settings.max_inflight_per_server,
                             queue_timeout_s=settings.queue_timeout_s(), eject_after=settings.fleet_eject_after,
                             health_interval_s=settings.fleet_health_interval_s,
                             dns_refresh_s=settings.fleet_dns_refresh_s,
                             http_tls=tls.upstream_http(settings), max_sequence_pins=settings.max_sequence_pins,
                             max_sequence_pins_per_client=settings.max_sequence_pins_per_client)
        self.upstream: HttpUpstream = FleetHttp(self.fleets.default)
        self.access_log = AccessLog() if settings.access_log else None
        self.pins = SequencePins(settings.max_sequence_pins, max_per_client=settings.max_sequence_pins_per_client)
        self.budget = ByteBudget(settings.max_buffered_body_bytes)  # bytes held for requests, both ports and shadow
        named_http = {fleet.name: FleetHttp(fleet) for fleet in self.fleets if fleet is not self.fleets.default}
        self.shadow = ShadowMirror(self.upstream, self.recorder, budget=self.budget, fleets=named_http)
        self.pipeline = Pipeline(self.book, self.recorder, self.pins, self.shadow, self.access_log,
                                 settings.expose_version_headers, ClientAddresses(settings.trusted_proxies))
        self.grpc: GrpcProxy | None = None
        self.grpc_router: GrpcRouter | None = None
        self.grpc_server: Any = None
        self._grpc_drain: asyncio.Task[None] | None = None
        self.store = store or make_store(settings.store_url, AuditBounds(
            settings.audit_max_events, settings.audit_max_age_days * 86400))
        named = [fleet for fleet in self.fleets if fleet is not self.fleets.default]
        share_s = settings.controller_tick_s  # a rollout's tick reads Triton's index at most this old
        self.triton = TritonControl(self.fleets.default, {fleet.name: TritonControl(fleet, share_s=share_s)
                                                          for fleet in named},
                                    repository=settings.model_repository, share_s=share_s)
        self.fleets.on_join(self.triton.sync_server)
        self.policies = PolicyService(self.store, self.book, self.triton)
        self.sync = StateSync(self.store, self.policies, settings.resync_interval_s, settings.sync_unready_after_s,
                              self.recorder, on_new_store=lambda: apply_declared(self.store, settings.policies))
        self.source = make_source(settings.metrics_source, settings.prometheus_url, self.recorder,
                                  timeout_s=settings.controller_call_timeout_s)
        self.replicas = Replicas(self.store, self.recorder, self.pins)
        self.pins.directory = self.replicas  # sequence pins shared live between replicas, through the store
        self.sequence_models = SequenceModels(self.triton, self.book)  # what sequence_affinity auto follows
        self.triton.on_reload.append(self.sequence_models.wake)
        self.lifecycle = ModelLifecycle(self.store, self.triton, self.policies, self.replicas,
                                        drain_timeout_s=settings.drain_timeout_s)
        # metrics_source recorder: replicas publish their rollout windows, the lease holder judges the sum
        self.windows = ReplicaWindows(self.store, self.recorder, self.replicas.replica) \
            if settings.metrics_source == "recorder" else None
        self.rollouts = RolloutController(self.store, self.triton, self.policies, self.source, self.recorder,
                                          tick_s=settings.controller_tick_s, lifecycle=self.lifecycle,
                                          shadow=self.shadow, lease_ttl_s=settings.controller_lease_ttl_s,
                                          call_timeout_s=settings.controller_call_timeout_s,
                                          prometheus_url=settings.prometheus_url,
                                          history_per_model=settings.rollout_history_per_model,
                                          holder=self.replicas.replica, windows=self.windows)
        self.registry = make_registry(GatewayCollector(self.recorder, self.book))
        self.registry.register(FleetCollector(self.fleets))
        self.throttle = TokenThrottle()  # wrong tokens per client: console, /admin, data-port control, /metrics
        metrics_token = settings.metrics_token.get_secret_value() if settings.metrics_token is not None else None
        self.probes = Probes(self.fleets.default.live, self.book, self.registry, settings.connect_timeout_s,
                             self.sync.problem, MetricsAccess(metrics_token, settings.metrics_port, self.throttle,
                                                              self.pipeline.clients))
        self.metrics_server: MetricsServer | None = None
        self.health = Health(self.probes.problem, settings.grpc_max_health_watches_per_client)  # grpc.health.v1
        self.sessions = Sessions(settings.console_session_ttl_s)  # console logins (in this process' memory)
        self.auth = Authenticator(settings.actor_tokens(), settings.insecure_admin,
                                  {name: token.get_secret_value() for name, token in settings.viewer_tokens.items()},
                                  self.throttle)
        self.gate = control_gate(ControlMode(settings.triton_control), self.auth, self.policies)
        self.proxy = HttpProxy(self.pipeline, self.upstream, self.gate,
                               BodyReader(settings.max_body_bytes, budget=self.budget,
                                          max_inflation_ratio=settings.max_inflation_ratio),
                               named_http)
        self.timeline = Timeline(self.store, self.source)  # the console's rollout history (bounded)
        self.differences = VersionDifferences(self.triton, settings.model_repository)  # a version vs the stable
        self.control = self._control_app()

    def _grpc_connect(self, address: str) -> GrpcUpstream:
        """A fleet server's gRPC connection (the fleet holds it; ``grpc.fleet_upstream`` calls over it)."""
        settings = self.settings
        return GrpcUpstream(address, settings.connect_timeout_s, self._grpc_tls,
                            request_timeout_s=settings.request_timeout_s, keepalive_s=settings.upstream_keepalive_s,
                            keepalive_timeout_s=settings.upstream_keepalive_timeout_s)

    @property
    def started(self) -> bool:
        return self.probes.started

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="triton-gateway admin API", version="1", lifespan=self._lifespan,
                      docs_url="/admin/docs", redoc_url=None, openapi_url="/admin/openapi.json")
        app.state.auth = self.auth  # read by the shared Actor dependency (gateway.admin.deps)
        app.state.clients = self.pipeline.clients  # who a request's client is (trusted proxies, /64)
        app.add_middleware(JsonBodies)  # curl -d's bodies are JSON; other media types 415
        app.include_router(self.probes.router())
        app.include_router(admin_router(self.policies), prefix="/admin", tags=["admin"])
        app.include_router(rollout_router(self.rollouts), prefix="/admin", tags=["rollout"])
        app.include_router(versions_router(self.lifecycle, self.differences), prefix="/admin", tags=["versions"])
        app.include_router(fleets_router(self.fleets), prefix="/admin", tags=["fleets"])
        install_error_handlers(app)
        install_console(app, Views(self.policies, self.rollouts, self.fleets, self.sync, self.source, self.recorder,
                                   self.timeline, self.settings.metrics_source, self.differences),
                        self.lifecycle, self.auth, self.sessions)
        return app

    async def reconfigure(self, new: Settings) -> None:
        """SIGHUP: the settings the control plane applies at once (``gateway.reload.LIVE``). A token
        removed or replaced is refused from now on and its console sessions end."""
        gone = self.auth.replace(new.actor_tokens(), new.insecure_admin,
                                 {name: token.get_secret_value() for name, token in new.viewer_tokens.items()})
        ended = self.sessions.end_for(gone)
        if gone:
            log.warning("SIGHUP: the tokens of %s are gone or replaced: %d console session(s) ended",
                        ", ".join(sorted(f"{who.name} ({who.role})" for who in gone)), ended)
        self.probes.access.replace_token(None if new.metrics_token is None else new.metrics_token.get_secret_value())
        self.pipeline.clients.replace(new.trusted_proxies)
        self.sessions.ttl_s = new.console_session_ttl_s
        logging.getLogger().setLevel(new.log_level.upper())
        await apply_declared(self.store, new.policies)
        self.settings = self.settings.model_copy(update={name: getattr(new, name) for name in LIVE})

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        if not self.auth.enabled:
            log.error("admin API disabled: no GATEWAY_ADMIN_TOKEN / admin_tokens set (--insecure-admin to override)")
        elif self.auth.insecure:
            log.warning("admin API runs WITHOUT authentication (--insecure-admin): anyone can change routing")
        async with self.running():
            yield

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Started (``_start``), and ready for the probes, until the block ends (``_stop``): the one
        lifespan of a gateway process and of a data-plane worker (whose ``_start``/``_stop`` differ)."""
        # What the imports and the constructors built is frozen first: reading and compiling 5,000
        # policies made a few full collections walk all of it (~0.5 s of a 5,000-model startup).
        gc.collect()
        gc.freeze()
        await self._start()
        with serving_collector():
            self.probes.started = True
            try:
                yield
            finally:
                self.probes.started = False
                await self._stop()

    async def _start(self) -> None:
        await self.store.open()
        await self.fleets.start()
        await apply_declared(self.store, self.settings.policies)  # one log line per model
        # Triton's model configs (one read per model: sequence_affinity auto) are read while the
        # policies are: the one waits on Triton, the other on the store and the CPU. Either order
        # compiles the same book (set_sequence_models recompiles what it changes).
        await asyncio.gather(self.sync.resync(), self.sequence_models.first_look(self.settings.connect_timeout_s + 5))
        await self.replicas.restore_pins()  # sequences pinned before a restart stay on their version
        self.sequence_models.start()
        self.sync.start()
        self.replicas.start()
        if self.access_log is not None:
            self.access_log.start()
        self.shadow.start()
        if self.settings.grpc_enabled:
            await self._start_grpc()
        if self.windows is not None:
            self.windows.start()
        if self.settings.controller_enabled:
            self.rollouts.start()
        self.timeline.start()
        await self._start_metrics()

    async def _start_metrics(self) -> None:
        """``metrics_port``: /metrics on its own port, served by the process that holds the registry."""
        settings = self.settings
        if settings.metrics_port is not None:
            self.metrics_server = MetricsServer(self.probes.access, self.probes.metrics, settings.host, tls_options(
                settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file))
            await self.metrics_server.start()

    async def _start_grpc(self) -> None:
        settings = self.settings
        upstream = FleetGrpc(self.fleets.default)
        named = {fleet.name: FleetGrpc(fleet) for fleet in self.fleets if fleet is not self.fleets.default}
        self.grpc_router = GrpcRouter(self.pipeline, upstream, named, settings.grpc_max_streams_per_client)
        if settings.grpc_server == "grpcio":
            self.grpc = GrpcProxy(self.grpc_router, self.gate, self.health, self.budget,
                                  settings.max_connections_per_client)
            self.grpc_server = await start_grpc(self.grpc, settings.host, settings.grpc_port,
                                                tls.grpcio_server_credentials(settings), grpc_limits(settings))
        else:
            self.grpc_server = await start_front(self.grpc_router, settings.host, settings.grpc_port, self.gate,
                                                 tls.serving(settings, tls.H2), grpc_limits(settings),
                                                 self.budget, self.health, reuse_port=self.reuse_port,
                                                 sock=self.grpc_socket, backlog=LISTEN_BACKLOG)

    def drain_grpc(self) -> None:
        """SIGTERM (``gateway.server.GatewayServer``): the gRPC port stops accepting now, as the
        HTTP port does, and its calls in flight get ``drain_timeout_s`` to finish, alongside the
        HTTP port's; ``_stop`` waits for it before anything the calls use is stopped."""
        if self.grpc_server is not None and self._grpc_drain is None:
            self.health.enter_graceful_shutdown()  # health watchers hear NOT_SERVING and let go first
            self._grpc_drain = asyncio.get_running_loop().create_task(
                self.grpc_server.stop(grace=self.settings.drain_timeout_s))

    async def _grpc_drained(self) -> None:
        """The gRPC port's drain, begun at SIGTERM (or now, when the lifespan ends without one)."""
        self.drain_grpc()
        if self._grpc_drain is not None:
            await self._grpc_drain

    async def _stop(self) -> None:
        await self._grpc_drained()  # first: its calls in flight still use the fleets, shadow, log, policies
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.timeline.stop()
        await self.rollouts.stop()
        if self.windows is not None:
            await self.windows.stop()
        await self.sync.stop()
        await self.replicas.stop()
        await self.sequence_models.stop()
        if self.access_log is not None:
            await self.access_log.stop()
        await self.shadow.stop()
        if self.grpc is not None:
            await self.grpc.aclose()
        await self.fleets.stop()
        await self.store.close()
        self.registry.close()


def control_gate(mode: ControlMode, auth: Authenticator, policies: PolicyService) -> ControlGate | None:
    """What the data ports do with Triton model control; None lets it pass (triton_control=allow)."""
    if mode is ControlMode.ALLOW:
        return None

    async def audit(call: ControlCall, actor: str, protocol: str) -> None:
        await policies.audit(call.model, actor, call.action, f"{call.described} through the {protocol} data port")

    return ControlGate(mode, auth.actor, audit)


def create_app(settings: Settings | None = None) -> Any:
    return Gateway(settings or Settings.load())


def grpc_limits(settings: Settings) -> Limits:
    """The lean gRPC server's per-connection limits, from the settings."""
    return Limits(max_concurrent_streams=settings.grpc_max_concurrent_streams,
                  stream_window=settings.grpc_stream_window_bytes,
                  connection_window=settings.grpc_connection_window_bytes,
                  max_header_list=settings.grpc_max_header_list_bytes, max_message=settings.grpc_max_message_bytes,
                  max_inflation_ratio=settings.max_inflation_ratio,
                  preface_timeout=settings.grpc_preface_timeout_s, header_timeout=settings.grpc_header_timeout_s,
                  idle_timeout=settings.grpc_idle_timeout_s, max_connections=settings.grpc_max_connections,
                  stalled_timeout=settings.grpc_stalled_stream_timeout_s,
                  max_connections_per_client=settings.max_connections_per_client)
