"""Control-plane calls to Triton's HTTP API: repository index and model readiness.

Low rate, correctness first; it shares the data plane's connection pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import Conflict, GatewayError, UpstreamError
from gateway.upstream import HttpUpstream


@dataclass(frozen=True)
class VersionState:
    version: str
    state: str  # READY, UNAVAILABLE, LOADING, UNLOADING, UNKNOWN
    reason: str


class TritonControl:
    def __init__(self, upstream: HttpUpstream, timeout_s: float = 10.0) -> None:
        self.upstream = upstream
        self.timeout_s = timeout_s

    async def call(self, method: bytes, path: str, body: Any = None, timeout_s: float | None = None) -> tuple[int, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        headers = [(b"content-type", b"application/json")] if payload else []
        response = await self.upstream.request(method, path.encode(), headers, payload,
                                               timeout_s=timeout_s or self.timeout_s)
        raw = await response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError as exc:
            raise UpstreamError(f"upstream {self.upstream.name} answered {path} with invalid JSON") from exc

    async def index(self) -> list[dict[str, Any]]:
        status, body = await self.call(b"POST", "/v2/repository/index", {})
        if status != 200 or not isinstance(body, list):
            raise UpstreamError(f"upstream {self.upstream.name} repository index failed ({status}): {body}")
        return body

    async def versions(self, model: str) -> dict[str, VersionState]:
        """Every version of ``model`` the repository index lists, with its state."""
        return {str(e["version"]): VersionState(str(e["version"]), e.get("state", "UNKNOWN"), e.get("reason", ""))
                for e in await self.index() if e.get("name") == model and "version" in e}

    async def require_ready(self, model: str, versions: set[str]) -> None:
        """Conflict (409) naming the first version that is not READY on Triton."""
        if not versions:
            return
        known = await self.versions(model)
        for version in sorted(versions, key=int):
            state = known.get(version)
            if state is None:
                raise Conflict(f"version {version} of model '{model}' is not known to Triton "
                               f"(known: {', '.join(sorted(known, key=int)) or 'none'})")
            if state.state != "READY":
                why = f" ({state.reason})" if state.reason else ""
                raise Conflict(f"version {version} of model '{model}' is {state.state} on Triton{why}, not READY")

    async def is_version_ready(self, model: str, version: str) -> bool | None:
        """True/False from Triton; None when Triton could not be asked."""
        try:
            status, _ = await self.call(b"GET", f"/v2/models/{model}/versions/{version}/ready", timeout_s=2.0)
        except GatewayError:
            return None
        return status == 200
