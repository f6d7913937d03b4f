"""What an SRE writes about fleets: named groups of Triton servers, static or discovered by DNS.

```yaml
fleets:
  default:
    servers:
      - {http: "http://10.0.0.1:8000", grpc: "10.0.0.1:8001"}
  green:
    dns: {name: triton-green.ns.svc.cluster.local, http_port: 8000, grpc_port: 8001}
```

Validated once at start (pydantic): a bad entry stops the start with one line naming the
field, e.g. ``fleets.green.dns.http_port: Input should be less than or equal to 65535``.
Without ``fleets`` (or without a ``default`` entry), ``triton_url``/``triton_grpc_url`` form
the one-server fleet ``default``, as before fleets existed.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_FLEET = "default"
FleetName = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9_-]{0,62})$", description="fleet name")]
GrpcAddress = Annotated[str, Field(pattern=r"^(grpcs?://)?[^/\s]+:[0-9]{1,5}$",
                                   description="host:port (grpcs://host:port: over TLS)")]


class ServerSpec(BaseModel):
    """One Triton server: its HTTP URL and its gRPC host:port."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    http: str = Field(description="Triton's HTTP endpoint, http://host:port (https://: over TLS)")
    grpc: GrpcAddress = Field(description="Triton's gRPC endpoint, host:port")

    @field_validator("http")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        host, _, port = url.removeprefix("https://").removeprefix("http://").rstrip("/").partition(":")
        if not host or "/" in host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
            raise ValueError("must be http(s)://host[:port] with no path")
        return url.rstrip("/")

    @property
    def name(self) -> str:
        """How the server is named in logs, metrics and admin answers: its HTTP host:port."""
        return self.http.removeprefix("https://").removeprefix("http://")


class DnsSpec(BaseModel):
    """A headless Service: every A/AAAA record of ``name`` is one server on these ports."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.-]+$", description="DNS name to resolve")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(8001, ge=1, le=65535)


class FleetSpec(BaseModel):
    """Exactly one of ``servers`` (a static list) or ``dns`` (discovered, re-resolved)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    servers: list[ServerSpec] | None = Field(None, min_length=1, max_length=256)
    dns: DnsSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> FleetSpec:
        if (self.servers is None) == (self.dns is None):
            raise ValueError("a fleet needs exactly one of 'servers' (a list) or 'dns' (a name to resolve)")
        if self.servers is not None:
            names = [server.name for server in self.servers]
            if len(set(names)) != len(names):
                raise ValueError(f"servers repeat the same HTTP endpoint: {sorted(names)}")
        return self


def single_server(http_url: str, grpc_address: str) -> FleetSpec:
    """The fleet ``default`` when only ``triton_url``/``triton_grpc_url`` are set."""
    return FleetSpec(servers=[ServerSpec(http=http_url, grpc=grpc_address)])
