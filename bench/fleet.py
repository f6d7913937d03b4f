"""Balancing cost: one gateway in front of a fleet of 2 Triton servers against one in front of 1.

Issue 15 asks that per-request balancing adds at most 5 µs of gateway CPU. Two numbers:

1. In process, precise: the balancer's own work per request (take the model and version the
   front read, pick a server by power-of-two-choices, note it on the exchange, take and give
   back an admission slot),
   timed over a million calls for the HTTP path and the gRPC path, 2 servers against 1.
2. End to end, to see nothing else moved: two Tritons, two gateway processes (fleet of 1 and
   fleet of 2, policy qc 2=80 3=20), the same JSON load with wrk at c=32 and ModelInfer with
   h2load at c=32, interleaved round by round; gateway CPU per request from /proc. On a shared
   2-core machine this moves by several µs between rounds: read it next to row 1.

    .venv/bin/python bench/fleet.py                 # 3 rounds of 5 s (default)
    .venv/bin/python bench/fleet.py --micro-only    # only the in-process numbers (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from overhead import LUA, POLICY, Result, bodies, grpc_body, run_h2load, run_wrk, wait_http  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402
from gateway.fleet.balancer import Fleet  # noqa: E402
from gateway.fleet.config import ServerSpec  # noqa: E402
from gateway.grpc.upstream import GrpcUpstream  # noqa: E402


def micro(servers: int, calls: int = 1_000_000) -> tuple[float, float]:
    """µs per request of the balancer's work on the HTTP and the gRPC path, no I/O (the same
    statements as FleetHttp.request / FleetGrpc.unary around the send)."""
    fleet = Fleet("bench", grpc_connect=GrpcUpstream, max_inflight=64)
    members = [fleet.add(ServerSpec(http=f"http://10.0.0.{i}:8000", grpc=f"10.0.0.{i}:8001")) for i in range(servers)]
    for member in members:
        member.in_service = True
        member.ready = {"qc": frozenset({"2", "3"})}
    fleet.changed()
    routed_model, routed_version = "qc", "2"  # what the front read of the request and routed it to

    class Exchange:
        __slots__ = ("server",)

        def __init__(self) -> None:
            self.server = ""

    noted = Exchange()  # where the fleet notes the server it chose (exchange.server)

    model: str | bytes = b""
    version: str | bytes | None = None

    async def http_path() -> float:
        nonlocal model, version
        started = time.perf_counter()
        for _ in range(calls):
            single = fleet.single
            if single is not None:
                server = single
            else:  # the HTTP front read the path once (fleet.forward): nothing is parsed here
                model, version = routed_model, routed_version
                server = fleet.pick(model, version)
            if server.limit and server.inflight >= server.limit:
                server = await fleet.admit(server, model, version, 60.0)
            else:
                server.inflight += 1
            noted.server = server.name
            server.requests += 1
            server.admitted().release()
            server.failures = 0
        return (time.perf_counter() - started) / calls * 1e6

    async def grpc_path() -> float:
        nonlocal model, version
        started = time.perf_counter()
        for _ in range(calls):
            single = fleet.single
            if single is not None:
                server = single
            else:  # the router read the model and version once (grpc.fleet_upstream): nothing is parsed here
                model, version = routed_model, routed_version
                server = fleet.pick(model, version)
            if server.limit and server.inflight >= server.limit:
                server = await fleet.admit(server, model, version, 60.0)
            else:
                server.inflight += 1
            server.requests += 1
            server.admitted().release()
            server.failures = 0
        return (time.perf_counter() - started) / calls * 1e6

    return asyncio.run(http_path()), asyncio.run(grpc_path())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of wrk load per round (default 5)")
    parser.add_argument("--grpc-requests", type=int, default=10000, help="h2load requests per round (10000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-only", action="store_true", help="only the in-process balancer timing")
    args = parser.parse_args()
    one_http, one_grpc = micro(1)
    two_http, two_grpc = micro(2)
    print("in process, balancer work per request (µs):")
    print(f"  HTTP  1 server {one_http:5.2f}   2 servers {two_http:5.2f}   added {two_http - one_http:+5.2f}")
    print(f"  gRPC  1 server {one_grpc:5.2f}   2 servers {two_grpc:5.2f}   added {two_grpc - one_grpc:+5.2f}")
    if args.micro_only:
        return 0
    if not shutil.which("wrk") or not shutil.which("h2load"):
        print("bench: wrk and h2load are needed (make system-deps)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gateway-fleet-bench-"))
    script = workdir / "bench.lua"
    script.write_text(LUA)
    config = workdir / "gateway.yaml"
    config.write_text(POLICY)
    body, ihcl = bodies(workdir)["json"]
    grpc = grpc_body(workdir)
    with LocalTriton.on_free_ports() as first, LocalTriton.on_free_ports() as second:
        gateways = {}
        for label, servers in (("1 server ", [first]), ("2 servers", [first, second])):
            port, grpc_port = free_port(), free_port()
            fleet = "[" + ",".join(f'{{"http": "{s.http_url}", "grpc": "{s.grpc_url}"}}' for s in servers) + "]"
            env = dict(os.environ, GATEWAY_PORT=str(port), GATEWAY_GRPC_PORT=str(grpc_port),
                       GATEWAY_TRITON_URL=first.http_url, GATEWAY_LOG_LEVEL="warning", GATEWAY_STORE_URL="memory://",
                       GATEWAY_FLEETS=f'{{"default": {{"servers": {fleet}}}}}')
            process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], env=env)
            gateways[label] = (process, port, grpc_port)
        try:
            for _, port, _ in gateways.values():
                wait_http(f"http://127.0.0.1:{port}/readyz")
            results: dict[str, dict[str, list[Result]]] = {label: {"http": [], "grpc": []} for label in gateways}
            for _process, port, grpc_port in gateways.values():  # warm-up
                run_wrk(f"http://127.0.0.1:{port}/v2/models/qc/infer", body, ihcl, 32, 1, script, None)
                run_h2load(f"127.0.0.1:{grpc_port}", grpc, 32, 500, workdir, None)
            for round_ in range(args.rounds):
                for label, (process, port, grpc_port) in gateways.items():
                    http = run_wrk(f"http://127.0.0.1:{port}/v2/models/qc/infer", body, ihcl, 32, args.seconds,
                                   script, process.pid)
                    via_grpc = run_h2load(f"127.0.0.1:{grpc_port}", grpc, 32, args.grpc_requests, workdir,
                                          process.pid)
                    results[label]["http"].append(http)
                    results[label]["grpc"].append(via_grpc)
                    print(f"  round {round_ + 1} {label}: HTTP {http.rps:6.0f} rps {http.cpu_us:5.1f} µs/req | "
                          f"gRPC {via_grpc.rps:6.0f} rps {via_grpc.cpu_us:5.1f} µs/req", flush=True)
        finally:
            for process, _, _ in gateways.values():
                process.terminate()
                process.wait(10)
    print("\nend to end, c=32, gateway CPU per request (mean of rounds):")
    for label, by_protocol in results.items():
        cells = []
        for protocol, rows in by_protocol.items():
            cpu = sum(r.cpu_us or 0.0 for r in rows) / len(rows)
            rps = sum(r.rps for r in rows) / len(rows)
            errors = sum(r.errors for r in rows)
            cells.append(f"{protocol} {rps:6.0f} rps {cpu:6.1f} µs/req ({errors} errors)")
        print(f"  {label}: " + " | ".join(cells))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
