"""Configuration, read once: ``GATEWAY_*`` environment variables over an optional YAML file.

``Settings.load()`` is the only place that reads the environment. A bad value raises
:class:`SettingsError` whose message names the field, and ``gateway serve`` exits non-zero
with that one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.fleet.config import DEFAULT_FLEET, FleetName, FleetSpec, single_server
from gateway.policy import HeaderName, PolicySpec


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
    triton_grpc_url: str = Field("127.0.0.1:8001", pattern=r"^[^/\s]+:[0-9]+$",
                                 description="Triton's gRPC endpoint, host:port")
    connect_timeout_s: float = Field(2.0, gt=0, le=60, description="upstream connect timeout")
    request_timeout_s: float = Field(60.0, gt=0, le=3600, description="deadline for one upstream request")
    pool_size: int = Field(128, ge=1, le=4096, description="max upstream HTTP connections to Triton")
    sticky_header: HeaderName = Field("x-user-id", description="default header carrying the sticky user key")
    policies: dict[str, PolicySpec] = Field(
        default_factory=dict, description="static routing policies by model; seed an empty store"
    )
    store_url: str = Field("sqlite:///gateway-state.db",
                           description="routing state: sqlite:///path (default), redis://host:port/db, memory://")
    resync_interval_s: float = Field(5.0, gt=0, le=3600, description="full state resync period (heals missed changes)")
    admin_token: SecretStr | None = Field(None, description="bearer token for /admin (actor name 'admin')")
    admin_tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="more named tokens, {actor: token}: one per SRE or automation"
    )
    insecure_admin: bool = Field(False, description="serve /admin without a token (logs a warning; never in prod)")
    metrics_source: str = Field("recorder", pattern="^(recorder|prometheus)$",
                                description="rollout analysis reads this process's recorder, or Prometheus "
                                "(all replicas' traffic)")
    prometheus_url: str = Field("http://127.0.0.1:9090", description="Prometheus query API, for metrics_source")
    controller_enabled: bool = Field(True, description="run the rollout controller loop (lease-elected)")
    controller_tick_s: float = Field(1.0, gt=0, le=60, description="rollout controller tick period")
    access_log: bool = Field(False, description="one JSON line per request on stdout, written off the hot path")
    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$", description="log level")

    @field_validator("triton_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith("http://"):
            raise ValueError("must start with http:// (TLS to Triton is not supported yet)")
        return url.rstrip("/")

    @field_validator("store_url")
    @classmethod
    def _known_store(cls, url: str) -> str:
        if not url.startswith(("sqlite://", "redis://", "rediss://", "unix://", "memory://")):
            raise ValueError("must be sqlite:///path, redis://host:port/db or memory://")
        return url

    @model_validator(mode="after")
    def _tokens_are_distinct(self) -> Settings:
        secrets = [t.get_secret_value() for t in self.admin_tokens.values()]
        if self.admin_token is not None:
            secrets.append(self.admin_token.get_secret_value())
        if any(len(secret) < 8 for secret in secrets):
            raise ValueError("admin tokens must be at least 8 characters")
        if len(set(secrets)) != len(secrets):
            raise ValueError("two admin tokens are the same: each actor needs its own")
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
        64, ge=0, le=100_000, description="admitted requests in flight per Triton server (0: no limit); past it "
        "requests queue up to queue_timeout_ms, then get 429 / RESOURCE_EXHAUSTED")
    queue_timeout_ms: int = Field(1000, ge=0, le=600_000, description="longest wait for a free slot on a full server "
                                  "(0: refuse at once)")

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
