"""The plane rules of the agreed design, read from the imports of ``gateway/`` (ast, no import).

- the data plane (fronts, pipeline, routing, upstream clients, HTTP/2) imports nothing from the
  store, admin, rollout or control-plane services: it meets the control plane only at the
  policy book and the recorder;
- routing imports no transport (it stays pure);
- the store imports no admin, rollout or service code;
- no control-plane service imports admin (admin is only the HTTP surface over the services);
- the pipeline imports no front (it knows exchanges; the shadow queue is a port it is given);
- telemetry imports nothing of the data plane (the fleet collector reads its own small views);
- HTTP/2 imports nothing of gRPC (``grpc.server_connection`` and ``grpc.client_connection`` put
  gRPC on top of it) and no front's module;
- the fleet imports no front, no gRPC and no HTTP/2: the front hands over the model, version and
  sequence fields it read once, and the gRPC calls over a fleet live on the gRPC side;
- the modules both ports share (the write-joining transport, the byte budget) import neither
  port's modules nor HTTP/2: each front puts its own behaviour on top of them.

Checked to fail: adding ``from gateway.store.base import StateStore`` to ``gateway/routing.py``
(and, separately, ``from gateway.admin.deps import Actor`` to ``gateway/services/policies.py``)
makes this test fail and name the file and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"

DATA_PLANE = ("gateway.proxy", "gateway.grpc", "gateway.pipeline", "gateway.routing", "gateway.upstream",
              "gateway.http2", "gateway.fleet")  # fleet: the balancer picks each request's server
CONTROL_PLANE = ("gateway.store", "gateway.admin", "gateway.rollout", "gateway.services")
TRANSPORT = ("gateway.proxy", "gateway.grpc", "gateway.pipeline", "gateway.upstream", "gateway.http2",
             "gateway.asgi", "gateway.server", "asyncio", "socket", "httptools", "httpx", "grpc", "uvicorn")
# The modules that speak a client's wire format (and the shadow queue the HTTP front's package holds).
FRONTS = ("gateway.proxy", "gateway.grpc", "gateway.http_front", "gateway.http_output", "gateway.asgi",
          "gateway.server")
# Used by both ports (the HTTP front, HTTP/2 under gRPC) and so below both.
SHARED = ("gateway.batched_transport", "gateway.byte_budget", "gateway.sweep")
# (who, may not import, why)
RULES = [
    (DATA_PLANE, CONTROL_PLANE, "the data plane meets the control plane only at the policy book and the recorder"),
    (("gateway.routing",), TRANSPORT, "routing is pure: no transport, no I/O"),
    (("gateway.store",), ("gateway.admin", "gateway.rollout", "gateway.services"), "the store knows no callers"),
    (("gateway.services",), ("gateway.admin",), "admin is the HTTP surface over the services, not below them"),
    (("gateway.pipeline",), FRONTS, "the pipeline knows exchanges and the ports it is given, not a front's module"),
    (("gateway.telemetry",), DATA_PLANE, "telemetry reads the data plane through small views of its own"),
    (("gateway.http2",), ("gateway.grpc", "gateway.pipeline", "gateway.fleet"),
     "HTTP/2 is a plain layer: gRPC's framing, statuses and trailers live in grpc/, on top of it"),
    (("gateway.http2",), FRONTS, "HTTP/2 sits below the fronts: what it shares with the HTTP port lives in "
     "a module of its own (SHARED)"),
    (("gateway.fleet",), (*FRONTS, "gateway.http2", "gateway.pipeline"),
     "the fleet is the upstream side: what it chooses by comes with the request, it reads no front's wire"),
    (SHARED, (*FRONTS, "gateway.http2"), "what both ports share sits below both: each front builds on it"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


MODULES = {module_name(path): imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize(("owners", "forbidden", "why"), RULES, ids=[rule[2] for rule in RULES])
def test_plane_rules(owners: tuple[str, ...], forbidden: tuple[str, ...], why: str) -> None:
    broken = sorted(f"{module} imports {name}" for module, names in MODULES.items() if within(module, owners)
                    for name in names if within(name, forbidden))
    assert not broken, f"{why}: " + "; ".join(broken)


def test_every_rule_looks_at_real_modules() -> None:
    """A rule about a package that no longer exists would pass forever: each owner must exist."""
    for owners, _, why in RULES:
        assert any(within(module, owners) for module in MODULES), why
