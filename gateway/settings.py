"""Configuration, read once: ``GATEWAY_*`` environment variables over an optional YAML file.

``Settings.load()`` is the only place that reads the environment. A bad value raises
:class:`SettingsError` whose message names the field, and ``gateway serve`` exits non-zero
with that one line.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import DirectoryPath, Field, FilePath, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.fleet.config import DEFAULT_FLEET, FleetName, FleetSpec, single_server
from gateway.policy import HeaderName, ModelName, PolicySpec, own_model_twice

# Connections the kernel queues on a listener before the gateway accepts them, on both ports: a
# node's clients reconnecting at once (a restart, a balancer failing over) are thousands. It was
# asyncio's 100 on the gRPC port, and 5,000 h2load clients took 96 s to connect (SYN retries).
# The kernel caps it at net.core.somaxconn (4,096 on Linux 5.4+).
LISTEN_BACKLOG = 4096


class SettingsError(ValueError):
    """The configuration cannot be used; the message says which field and why."""


class Settings(BaseSettings):
    """Every knob of the gateway. Field descriptions feed ``gateway config-reference``."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in containers)")
    port: int = Field(8080, ge=1, le=65535, description="HTTP port: data path, /admin, /metrics")
    triton_url: str = Field("http://127.0.0.1:8000", description="Triton's HTTP endpoint")
    grpc_enabled: bool = Field(True, description="serve Triton's gRPC protocol on grpc_port")
    grpc_port: int = Field(8081, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    grpc_server: Literal["lean", "grpcio"] = Field(
        "lean", description="gRPC server: lean (our HTTP/2 server, ~3x less CPU per call) or grpcio")
    triton_grpc_url: str = Field("127.0.0.1:8001", pattern=r"^(grpcs?://)?[^/\s]+:[0-9]+$",
                                 description="Triton's gRPC endpoint, host:port (grpcs://host:port: over TLS)")
    tls_cert_file: FilePath | None = Field(None, description="PEM certificate chain: the HTTP port serves HTTPS and "
                                           "the gRPC port gRPC over TLS (ALPN h2); needs tls_key_file")
    tls_key_file: FilePath | None = Field(None, description="PEM private key for tls_cert_file")
    tls_client_ca_file: FilePath | None = Field(
        None, description="PEM CA bundle: both ports require a client certificate signed by it (mTLS)")
    triton_ca_file: FilePath | None = Field(
        None, description="PEM CA bundle to verify Triton's certificate (https:// and grpcs:// URLs); "
        "default: the system's trust store")
    triton_client_cert_file: FilePath | None = Field(
        None, description="PEM client certificate chain presented to a Triton that requires mTLS")
    triton_client_key_file: FilePath | None = Field(None, description="PEM private key for triton_client_cert_file")
    connect_timeout_s: float = Field(2.0, gt=0, le=60, description="upstream connect timeout")
    request_timeout_s: float = Field(60.0, gt=0, le=3600, description="deadline for one upstream request (HTTP, "
                                     "and gRPC calls whose client set no deadline; streams excepted)")
    upstream_keepalive_s: float = Field(10.0, ge=0, le=3600, description="ping each gRPC connection to Triton this "
                                        "often, idle or busy, to find a hung server (0: never)")
    upstream_keepalive_timeout_s: float = Field(
        5.0, gt=0, le=600, description="a ping unanswered this long drops the connection: its calls fail "
        "UNAVAILABLE and count toward the server's ejection")
    pool_size: int = Field(128, ge=1, le=4096, description="max upstream HTTP connections to Triton")
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="HTTP port: a request's headers must arrive "
                                    "within this, counted from its first byte or the connection's start (408 after)")
    body_idle_timeout_s: float = Field(10.0, gt=0, le=600, description="HTTP port: longest pause between two "
                                       "pieces of a request body (408 after)")
    keep_alive_timeout_s: int = Field(75, ge=1, le=3600, description="HTTP port: an idle keep-alive connection "
                                        "is closed after this (longer than clients keep theirs idle, so the client "
                                        "closes first and never sends into a close; an idle connection costs no CPU)")
    max_client_connections: int = Field(16384, ge=1, le=1_000_000, description="HTTP port: connections at once; "
                                        "one more is answered 503 with Retry-After and closed. At the limit: ~10 KB "
                                        "of RSS and a file descriptor each (~160 MB)")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest request body, and largest body the gateway "
                                "decompresses (413 above); Triton's own default --http-max-input-size")
    max_buffered_body_bytes: int = Field(256 << 20, ge=1024, description="bytes held for requests at once, all "
                                         "clients and both ports together: bodies, gRPC messages, what they inflate "
                                         "to, shadow copies (503 with Retry-After, gRPC UNAVAILABLE, above)")
    max_inflation_ratio: int = Field(100, ge=1, le=1_000_000, description="a compressed request body or gRPC "
                                     "message may inflate to at most this many times its size (64 KiB always), "
                                     "besides max_body_bytes / grpc_max_message_bytes: 413 / RESOURCE_EXHAUSTED "
                                     "above, so what a gzip bomb holds is paid for by the bytes it sends")
    max_url_bytes: int = Field(4000, ge=256, le=1 << 20, description="HTTP port: longest URL of a request line; "
                               "414 JSON above, before more of it is read. A URL Triton 2.51 cannot read whole (over "
                               "4,048 bytes as forwarded) is answered 414 whatever this allows")
    max_header_bytes: int = Field(64 << 10, ge=1 << 10, le=16 << 20, description="HTTP port: one request's header "
                                  "lines together (so any one of them too); 431 JSON above, before more is read")
    max_header_count: int = Field(100, ge=8, le=10_000, description="HTTP port: header lines in one request "
                                  "(431 JSON above)")
    linger_s: float = Field(2.0, ge=0, le=60, description="HTTP port: after an answer that ends a request early "
                            "(413, 408, 400, ...), read and drop what the client still sends for up to this long "
                            "(at most 64 MiB, or max_body_bytes if larger) before closing, so it reads the answer "
                            "instead of a reset")
    max_connections_per_client: int = Field(4096, ge=1, le=1_000_000, description="both ports: connections one "
                                            "client address may hold (a quarter of each port's, so one client "
                                            "cannot take a port, while a balancer that rewrites client addresses "
                                            "to a few of its own still fits); past it a connection is answered as "
                                            "past max_client_connections / grpc_max_connections (grpc_server "
                                            "grpcio: only connections with calls in flight count, its next call is "
                                            "answered UNAVAILABLE; grpcio exposes no accept)")
    max_sequence_pins: int = Field(100_000, ge=1, le=100_000_000, description="sequence affinity: live sequence "
                                   "pins kept per replica (per node with --workers), in the version table and in "
                                   "each fleet's server table; past it the least recently used goes")
    max_sequence_pins_per_client: int = Field(
        1_000, ge=1, le=100_000_000, description="sequence affinity: live pins one client address may hold (its "
        "sequence starts); its next start evicts its own least recently used pin, never another client's. 1% of "
        "the default table: pushing others' pins out takes 100 addresses; behind a load balancer set "
        "trusted_proxies, or every client shares the balancer's quota")
    sticky_header: HeaderName = Field("x-user-id", description="default header carrying the sticky user key")
    policies: dict[ModelName, PolicySpec] = Field(
        default_factory=dict, description="routing policies by model, as declared intent: an entry changed since "
        "it was last applied is applied at start (audited as actor config); an unchanged one leaves API changes alone"
    )
    store_url: str = Field("sqlite:///gateway-state.db",
                           description="routing state: sqlite:///path (default), redis://host:port/db, memory://")
    resync_interval_s: float = Field(5.0, gt=0, le=3600, description="full state resync period (heals missed changes)")
    sync_unready_after_s: float = Field(
        30.0, gt=0, le=86400, description="/readyz fails when policy sync has been failing this long (an unreachable "
        "store does not count: the replica keeps serving its last policies, and gateway_store_up says so)")
    drain_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="SIGTERM closes both ports' listeners and gives the requests in flight "
        "this long to finish (one process or each worker; uvicorn rounds it up to whole seconds); an unload waits "
        "this long for every replica's requests and sequences on the version to finish; sequences still pinned "
        "then make it refuse (requests in flight do not)")
    audit_max_events: int = Field(100_000, ge=100, le=100_000_000,
                                  description="audit trail: keep at most this many events (the newest)")
    audit_max_age_days: float = Field(365.0, gt=0, le=36500,
                                      description="audit trail: drop events older than this many days")
    rollout_history_per_model: int = Field(20, ge=1, le=1000,
                                           description="finished rollouts kept per model, with their verdicts and "
                                           "evidence (GET /admin/models/{model}/rollouts); the oldest goes first")
    admin_token: SecretStr | None = Field(None, description="bearer token for /admin (actor name 'admin')")
    admin_tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="more named tokens, {actor: token}: one per SRE or automation"
    )
    insecure_admin: bool = Field(False, description="serve /admin without a token (logs a warning; never in prod)")
    viewer_tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="read-only tokens, {name: token}: the console's pages and GET /admin/*, "
        "never a change (403)")
    console_session_ttl_s: float = Field(8 * 3600.0, gt=0, le=30 * 86400, description="a console login (session "
                                         "cookie) ends this many seconds after it began")
    triton_control: Literal["deny", "admin", "allow"] = Field(
        "deny", description="Triton model control (load/unload, shared memory, trace/log setting updates) on the "
        "data ports: deny (403 / PERMISSION_DENIED), admin (admin bearer token, audited) or allow")
    model_repository: DirectoryPath | None = Field(
        None, description="the default fleet's Triton model repository as this gateway can read it (a shared "
        "volume, read only): version loads and unloads read config.pbtxt there, send no config override when its "
        "version_policy serves the wanted versions, else config.pbtxt as it is now; unset: Triton's loaded "
        "configuration is sent with the versions to serve")
    metrics_source: str = Field("recorder", pattern="^(recorder|prometheus)$",
                                description="rollout analysis reads the recorders (replicas sharing a store "
                                "publish their windows through it and the lease holder judges the sum), or "
                                "Prometheus (all replicas' traffic)")
    prometheus_url: str | None = Field(None, description="Prometheus query API (e.g. http://prometheus:9090): needed "
                                       "by metrics_source prometheus and by rollouts with custom checks")
    controller_enabled: bool = Field(True, description="run the rollout controller loop (lease-elected)")
    controller_tick_s: float = Field(1.0, gt=0, le=60, description="rollout controller tick period")
    controller_lease_ttl_s: float = Field(3.0, ge=0.5, le=600, description="the controller lease, renewed every "
                                          "third of it by a task of its own: a holder silent this long (killed, "
                                          "paused) is replaced by another replica within it and one ask "
                                          "(min(controller_tick_s, a sixth of it)), and the new holder ticks at once")
    controller_call_timeout_s: float = Field(1.5, gt=0, le=60, description="timeout of each metrics query and "
                                             "Triton call in a controller tick (a tick is cut off past four of them, "
                                             "or half the lease if longer); a lease renewal gets at most a third of "
                                             "the lease")
    metrics_token: SecretStr | None = Field(None, description="/metrics answers only 'Authorization: Bearer "
                                            "<metrics_token>' (401 otherwise): it counts requests per version and "
                                            "names Triton's addresses")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve /metrics on this port only (the HTTP "
                                     "port answers 404 for it); with --workers, the control plane's. Unset: on "
                                     "the HTTP port")
    access_log: bool = Field(False, description="one JSON line per request on stdout, written off the hot path")
    expose_version_headers: bool = Field(True, description="answers name the version that served them and how it "
                                         "was picked (x-gateway-model-version, x-gateway-route); off: a client "
                                         "cannot tell which version answered, so cannot aim at one")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="CIDRs of proxies whose X-Forwarded-For names the client (the rightmost "
        "address not itself trusted): the rollout judge counts each client up to its share. Default none: the "
        "peer address is the client")
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$", description="log level")
    # -- the gRPC server's limits for each client connection (issue 12); grpcio keeps the message size and streams --
    grpc_max_message_bytes: int = Field(64 << 20, ge=1 << 10, le=1 << 30,
                                        description="largest gRPC request message, compressed and decompressed "
                                        "(RESOURCE_EXHAUSTED above)")
    grpc_max_header_list_bytes: int = Field(16 << 10, ge=1 << 10, le=1 << 20,
                                            description="SETTINGS_MAX_HEADER_LIST_SIZE, enforced while decoding")
    grpc_max_concurrent_streams: int = Field(256, ge=1, le=1 << 16,
                                             description="SETTINGS_MAX_CONCURRENT_STREAMS (REFUSED_STREAM above)")
    grpc_stream_window_bytes: int = Field(256 << 10, ge=65535, le=(1 << 31) - 1,
                                          description="HTTP/2 receive window per stream")
    grpc_connection_window_bytes: int = Field(4 << 20, ge=65535, le=(1 << 31) - 1,
                                              description="HTTP/2 receive window per connection")
    grpc_preface_timeout_s: float = Field(10.0, gt=0, le=3600, description="time for a client's HTTP/2 preface")
    grpc_header_timeout_s: float = Field(10.0, gt=0, le=3600, description="time to finish one header block")
    grpc_idle_timeout_s: float = Field(300.0, gt=0, le=86400, description="close connections idle this long")
    grpc_stalled_stream_timeout_s: float = Field(
        30.0, gt=0, le=86400, description="lean server: a call (stream or unary) whose answers queued for its "
        "client have not moved for this long (none of them taken), whether or not Triton is done, is reset "
        "ENHANCE_YOUR_CALM (gRPC clients read RESOURCE_EXHAUSTED), its queued answers dropped and a call still "
        "running left to finish on Triton; a connection whose socket, past its 1 MiB write buffer, took nothing "
        "for this long is closed. Any bytes taken restart it: a slow reader is never cut")
    grpc_max_health_watches_per_client: int = Field(
        64, ge=1, le=1_000_000, description="grpc.health.v1 Watch calls one client address (an IPv6 /64) may hold "
        "open on the gRPC port (RESOURCE_EXHAUSTED past it); every open watch shares one readiness probe a second")
    grpc_max_streams_per_client: int = Field(
        1024, ge=1, le=1_000_000, description="ModelStreamInfer streams one client address may have running on "
        "Triton, open or left: a stream its client cancels is never reset on Triton (resets crash Triton 2.51) and "
        "runs to its end; past this the client's next stream is answered RESOURCE_EXHAUSTED until one ends (per "
        "worker with --workers)")
    grpc_max_connections: int = Field(16384, ge=1, le=1_000_000, description="gRPC port, lean server only: client "
                                      "connections at once; one more has its first call answered UNAVAILABLE with "
                                      "the reason, then GOAWAY, and is closed. At the limit: ~5 KB of RSS and a "
                                      "file descriptor each (~80 MB)")

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, cidrs: list[str]) -> list[str]:
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IP network (CIDR such as 10.0.0.0/8 or an address)") from None
        return cidrs

    @field_validator("policies")
    @classmethod
    def _one_spelling_per_target(cls, policies: dict[str, PolicySpec]) -> dict[str, PolicySpec]:
        for model, spec in policies.items():
            clash = own_model_twice(model, spec)
            if clash is not None:
                raise ValueError(f"policy of {model}: {clash}")
        return policies

    @field_validator("triton_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return url.rstrip("/")

    @field_validator("store_url")
    @classmethod
    def _known_store(cls, url: str) -> str:
        if not url.startswith(("sqlite://", "redis://", "rediss://", "unix://", "memory://")):
            raise ValueError("must be sqlite:///path, redis://host:port/db or memory://")
        return url

    @model_validator(mode="after")
    def _one_body_fits(self) -> Settings:
        largest = max(self.max_body_bytes, self.grpc_max_message_bytes)
        if self.max_buffered_body_bytes < 2 * largest:
            raise ValueError(f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least twice "
                             f"max_body_bytes and grpc_max_message_bytes ({largest}): a body or message of the "
                             "largest size, and what it inflates to, must fit")
        return self

    @model_validator(mode="after")
    def _prometheus_named(self) -> Settings:
        # No default URL: a rollout check against a Prometheus nobody configured would only
        # ever fail to connect, so it is refused at start instead (gateway/rollout/checks.py).
        if self.metrics_source == "prometheus" and not self.prometheus_url:
            raise ValueError("metrics_source prometheus needs prometheus_url (e.g. http://prometheus:9090)")
        return self

    @model_validator(mode="after")
    def _tls_files_pair_up(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both to serve TLS, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mTLS) needs TLS: set tls_cert_file and tls_key_file too")
        if (self.triton_client_cert_file is None) != (self.triton_client_key_file is None):
            raise ValueError("triton_client_cert_file and triton_client_key_file go together: set both, or neither")
        return self

    @model_validator(mode="after")
    def _tokens_are_distinct(self) -> Settings:
        secrets = [t.get_secret_value() for t in (*self.admin_tokens.values(), *self.viewer_tokens.values())]
        if self.admin_token is not None:
            secrets.append(self.admin_token.get_secret_value())
        if self.metrics_token is not None:
            secrets.append(self.metrics_token.get_secret_value())
        if any(len(secret) < 8 for secret in secrets):
            raise ValueError("admin tokens must be at least 8 characters")
        if len(set(secrets)) != len(secrets):
            raise ValueError("two admin tokens are the same: each actor needs its own")
        if self.triton_control == "admin" and not self.actor_tokens() and not self.insecure_admin:
            raise ValueError("triton_control=admin needs an admin token to check: set GATEWAY_ADMIN_TOKEN "
                             "(or admin_tokens), or choose triton_control=deny")
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> Settings:
        if self.metrics_port is not None and self.metrics_port in (self.port, self.grpc_port):
            raise ValueError(f"metrics_port {self.metrics_port} is the HTTP or gRPC port: give /metrics a port of its "
                             "own, or leave metrics_port unset to serve it on the HTTP port")
        return self

    def actor_tokens(self) -> dict[str, str]:
        tokens = {name: token.get_secret_value() for name, token in self.admin_tokens.items()}
        if self.admin_token is not None:
            tokens.setdefault("admin", self.admin_token.get_secret_value())
        return tokens

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """CLI ``overrides`` over ``GATEWAY_*`` environment over the YAML file over defaults."""
        file_values = _read_yaml(config_file) if config_file else {}

        class Layered(cls):  # type: ignore[valid-type,misc]
            @classmethod
            def settings_customise_sources(
                cls,
                settings_cls: type[BaseSettings],
                init_settings: PydanticBaseSettingsSource,
                env_settings: PydanticBaseSettingsSource,
                dotenv_settings: PydanticBaseSettingsSource,
                file_secret_settings: PydanticBaseSettingsSource,
            ) -> tuple[PydanticBaseSettingsSource, ...]:
                return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

        try:
            layered = Layered(**overrides)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, config_file)) from None
        return cls.model_validate(dict(layered))

    # -- fleets (issue 15): many Triton servers, balanced, health-checked, admission-controlled --
    fleets: dict[FleetName, FleetSpec] = Field(
        default_factory=dict, description="named groups of Triton servers: {name: {servers: [{http, grpc}]} or "
        "{dns: {name, http_port, grpc_port}}}; without 'default', triton_url/triton_grpc_url form it")
    fleet_dns_refresh_s: float = Field(5.0, gt=0, le=3600, description="how often a dns fleet re-resolves its name")
    fleet_health_interval_s: float = Field(1.0, gt=0, le=60, description="active health check period per server "
                                           "(/v2/health/ready and per-version readiness)")
    fleet_eject_after: int = Field(3, ge=1, le=1000, description="consecutive connect/transport failures that eject a "
                                   "server until its health check passes again")
    max_inflight_per_server: int = Field(
        64, ge=0, le=100_000, description="requests in flight at each Triton server (sent, not answered yet; 0: no "
        "limit); past it a request waits at the gateway, in order, for the first server to answer one")
    queue_timeout_ms: int | None = Field(
        None, ge=0, le=600_000, description="shedding: the longest wait for a free slot, then 429 with Retry-After / "
        "RESOURCE_EXHAUSTED (0: refuse at once); unset (the default): a request waits until its own deadline "
        "(request_timeout_s, or the gRPC call's), as in Triton's own queue, and only then is refused")
    # -- processes on one node (issue 26): gateway.workers --
    workers: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        1, description="data-plane worker processes (auto: the cores this process may use); above 1, each has its "
        "own SO_REUSEPORT listeners and one control plane (admin, controller, /metrics) runs in the supervisor")
    worker_stall_s: float = Field(5.0, gt=0, le=600, description="a worker whose event loop has not reported for "
                                  "this long is killed and replaced (workers above 1)")
    worker_listeners: Literal["auto", "reuse_port", "shared"] = Field(
        "auto", description="workers above 1: reuse_port gives each worker slot its own SO_REUSEPORT listeners "
        "(the kernel spreads connections), bound by the supervisor and inherited by each worker of the slot, "
        "so replacing a worker closes none; shared binds one socket per port in the supervisor and hands it to every "
        "worker; auto is reuse_port where the OS has SO_REUSEPORT (Linux), else shared")

    def queue_timeout_s(self) -> float | None:
        """``queue_timeout_ms`` in seconds; None: no shedding, a request waits until its deadline."""
        return None if self.queue_timeout_ms is None else self.queue_timeout_ms / 1000

    def worker_count(self) -> int:
        """``workers`` as a number: ``auto`` is the cores the process may use (its CPU affinity)."""
        if self.workers == "auto":
            try:
                return max(1, len(os.sched_getaffinity(0)))
            except AttributeError:  # not Linux
                return max(1, os.cpu_count() or 1)
        return self.workers

    def worker_reuse_port(self) -> bool:
        """Whether each worker binds its own ``SO_REUSEPORT`` listeners (else they share the supervisor's)."""
        if self.worker_listeners == "auto":
            return hasattr(socket, "SO_REUSEPORT")
        return self.worker_listeners == "reuse_port"

    def fleet_specs(self) -> dict[str, FleetSpec]:
        """Every fleet, ``default`` always among them."""
        specs = dict(self.fleets)
        specs.setdefault(DEFAULT_FLEET, single_server(self.triton_url, self.triton_grpc_url))
        return specs


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings at the top level")
    return data


def _describe(exc: ValidationError, source: str | Path | None) -> str:
    where = f" in {source}" if source else ""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
    )
    return f"invalid setting{where}: {problems}"
