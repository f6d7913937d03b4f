"""The data plane at size (issue 37): connection and body sweeps, the gateway beside nginx.

Sweeps of ``bench/scale.py`` (registered with ``scale_harness.sweep``). Against
``bench/stub_triton.py`` (a fixed answer, no inference: only the proxies are measured), one
gateway process (the first of ``scale_harness.TREES``: this tree, or ``--base``'s) and one nginx worker
(``bench/nginx.py``, keep-alive to the stub on both protocols) in front of the same stub:

- ``connections``: 16, 1,000 and 5,000 connections each sending requests back to back (wrk for
  HTTP, h2load with one stream per connection for gRPC): throughput, the share of answers that
  were not OK (the gateway's own 429 / RESOURCE_EXHAUSTED / 503 included, counted by its
  ``/metrics``), CPU per request, and useful throughput as a fraction of the 16-connection row;
- ``idle``: 0, 1,000 and 5,000 connections that sent one request (HTTP) or the HTTP/2 preface
  (gRPC) and then nothing, from 100 client addresses: the proxy's CPU per second of wall time
  while they sit (schedstat, ns), above the no-connection row, and how many are still open;
- ``bodies``: request bodies (HTTP, a binary tensor after its JSON header) and messages (gRPC
  ``ModelInferRequest.raw_input_contents``) of 1 KB, 64 KB, 1 MB and 8 MB, 8 in flight: CPU
  per MB of request, and the peak RSS growth of a fresh gateway over the bytes in flight.

Each cell alternates gateway and nginx (``--rounds``, order flipped every round; medians);
the load generator, both proxies and the stub share the machine's cores.

    .venv/bin/python bench/scale.py --only connections,idle,bodies --rounds 3
    .venv/bin/python bench/scale.py --only bodies --base 8c86ecb     # another commit's gateway
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import nginx  # noqa: E402
import scale_harness  # noqa: E402
from scale_harness import Table, sweep  # noqa: E402

from gateway.devtools.local_triton import free_port  # noqa: E402

POLICY = 'policies:\n  qc: {weights: {"2": 80, "3": 20}}\n'
SIZES = {"1KB": 1 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "8MB": 8 << 20}
BODY_CONCURRENCY = 8
ACTIVE = (16, 1000, 5000)
IDLE = (0, 1000, 5000)  # 0: the fixed cost of a gateway with no client (health checks, ticks)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LUA = r"""
wrk.method = "POST"
wrk.body = io.open(os.getenv("BENCH_BODY"), "rb"):read("*a")
local ihcl = os.getenv("BENCH_IHCL")
if ihcl ~= "" then wrk.headers["Inference-Header-Content-Length"] = ihcl end
wrk.headers["Content-Type"] = nil
local statuses = {}
response = function(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "seconds": %f, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


# -- what is measured -----------------------------------------------------------------------------
@dataclass
class Cell:
    """One proxy under one load: medians over the rounds."""

    rps: float = 0.0
    cpu_us: float = 0.0  # CPU per request
    not_ok: float = 0.0  # share of answers other than OK (refusals, errors)
    p99_ms: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Row:
    sweep: str
    label: str
    gateway: Cell
    nginx: Cell | None


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each of ``pid``'s live threads (schedstat, ns: clock ticks are 10 ms)."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                found[task] = int(stat.read().split()[0])
    return found


def cpu_s(pid: int, before: dict[str, int]) -> float:
    after = thread_cpu_ns(pid)
    return sum(ns - before.get(task, 0) for task, ns in after.items()) / 1e9


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> None:
    """VmHWM starts again from the current RSS (Linux: clear_refs 5)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def answered(port: int) -> dict[str, float]:
    """The gateway's ``gateway_requests_total`` by (protocol, code), from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for match in re.finditer(r'^gateway_requests_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        key = f"{labels.get('protocol')}:{labels.get('code')}"
        counts[key] = counts.get(key, 0.0) + float(match.group(2))
    return counts


# -- bodies ---------------------------------------------------------------------------------------
def http_body(workdir: Path, size: int) -> tuple[Path, str]:
    """A binary-tensor infer request: JSON header, then ``size`` bytes of FP32 (IHCL names the header)."""
    count = max(size // 4, 1)
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, count],
                                     "parameters": {"binary_data_size": count * 4}}]}).encode()
    path = workdir / f"http-{size}.body"
    path.write_bytes(header + bytes(count * 4))
    return path, str(len(header))


def grpc_body(workdir: Path, size: int) -> Path:
    """One gRPC frame: a ModelInferRequest for qc (unversioned) carrying ``size`` bytes of tensor."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="qc")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, max(size // 4, 1)])
    request.raw_input_contents.append(bytes(max(size // 4, 1) * 4))
    raw = request.SerializeToString()
    path = workdir / f"grpc-{size}.body"
    path.write_bytes(b"\x00" + struct.pack(">I", len(raw)) + raw)
    return path


# -- the proxies ----------------------------------------------------------------------------------
@dataclass
class Proxy:
    name: str
    pid: int
    http_port: int
    grpc_port: int
    metrics: bool  # counts its answers in /metrics (the gateway)


class Bench:
    """The stub, and the proxies in front of it; everything started here is stopped on exit."""

    def __init__(self, workdir: Path, seconds: float, rounds: int, with_nginx: bool = True,
                 gateway_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.gateway_env = gateway_env or {}  # settings the gateways run with (GATEWAY_*), besides their defaults
        self.seconds = seconds
        self.rounds = rounds
        self.with_nginx = with_nginx and nginx.available()
        self.stack = contextlib.ExitStack()
        self.script = workdir / "scale.lua"
        self.script.write_text(LUA)
        self.config = workdir / "gateway.yaml"
        self.config.write_text(POLICY)
        self.stub_http = self.stub_grpc = 0
        self.grpc_rate: dict[Path, float] = {}  # requests per second last seen, per body (h2load counts requests)

    def __enter__(self) -> Bench:
        self.stub_http, self.stub_grpc = free_port(), free_port()
        stub = subprocess.Popen([sys.executable, str(HERE / "stub_triton.py"), "--http-port", str(self.stub_http),
                                 "--grpc-port", str(self.stub_grpc)], stdout=subprocess.DEVNULL)
        self.stack.callback(_stop, stub)
        wait_http(f"http://127.0.0.1:{self.stub_http}/v2/health/ready")
        return self

    def __exit__(self, *_: object) -> None:
        self.stack.close()

    @contextlib.contextmanager
    def gateway(self, **env: str) -> Iterator[Proxy]:
        port, grpc_port = free_port(), free_port()
        tree = next(iter(scale_harness.TREES.values()))  # one gateway: this tree, or --base's
        environment = dict(os.environ, PYTHONPATH=str(tree), GATEWAY_PORT=str(port),
                           GATEWAY_GRPC_PORT=str(grpc_port), GATEWAY_TRITON_URL=f"http://127.0.0.1:{self.stub_http}",
                           GATEWAY_TRITON_GRPC_URL=f"127.0.0.1:{self.stub_grpc}", GATEWAY_LOG_LEVEL="error",
                           GATEWAY_STORE_URL="memory://", **{**self.gateway_env, **env})
        process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(self.config)],
                                   cwd=tree, env=environment, stdout=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz")
            yield Proxy("gateway", process.pid, port, grpc_port, True)
        finally:
            _stop(process)

    @contextlib.contextmanager
    def nginx(self) -> Iterator[Proxy | None]:
        if not self.with_nginx:
            yield None
            return
        http_port, grpc_port = free_port(), free_port()
        with nginx.Nginx(self.workdir, f"127.0.0.1:{self.stub_http}", f"127.0.0.1:{self.stub_grpc}", http_port,
                         grpc_port, worker_connections=16384) as proxy:
            yield Proxy("nginx", proxy.worker_pids()[0], http_port, grpc_port, False)

    # -- loads ----------------------------------------------------------------------------------
    def wrk(self, proxy: Proxy, body: tuple[Path, str], connections: int, seconds: float) -> Cell:
        threads = 1 if connections == 1 else 2
        env = dict(os.environ, BENCH_BODY=str(body[0]), BENCH_IHCL=body[1])
        counted = answered(proxy.http_port) if proxy.metrics else {}
        before = thread_cpu_ns(proxy.pid)
        out = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s",
                              "--timeout", "10s", "-s", str(self.script),
                              f"http://127.0.0.1:{proxy.http_port}/v2/models/qc/infer"],
                             env=env, capture_output=True, text=True, check=True)
        spent = cpu_s(proxy.pid, before)
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        requests = max(stats["requests"], 1)
        not_ok = (_non_2xx(out.stdout) + stats["errors"]) / requests
        if proxy.metrics:  # what the gateway answered, refusals included (wrk counts only what it read)
            not_ok = _share_not_ok(counted, answered(proxy.http_port), "http:", ":200")
        return Cell(rps=stats["requests"] / stats["seconds"], cpu_us=spent / requests * 1e6,
                    not_ok=not_ok, p99_ms=stats["p99_us"] / 1000)

    def h2load(self, proxy: Proxy, body: Path, connections: int, seconds: float) -> Cell:
        counted = answered(proxy.http_port) if proxy.metrics else {}
        before = thread_cpu_ns(proxy.pid)
        threads = 2 if connections >= 2 else 1
        # a request count, not -D: h2load's timed mode hung when thousands of clients connect slowly
        requests = max(4 * connections, int(seconds * self.grpc_rate.get(body, 3000)))
        out = subprocess.run(["h2load", "-n", str(requests), "-c", str(connections), "-m", "1", "-t", str(threads),
                              "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
                              f"http://127.0.0.1:{proxy.grpc_port}/inference.GRPCInferenceService/ModelInfer"],
                             capture_output=True, text=True, check=True, timeout=600)
        spent = cpu_s(proxy.pid, before)
        done = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                         r"(\d+) errored", out.stdout)
        finished = re.search(r"finished in ([0-9.]+)(m?s)", out.stdout)
        assert done and finished, out.stdout
        requests = max(int(done.group(3)), 1)
        wall = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
        not_ok = (float(done.group(5)) + float(done.group(6))) / requests
        if proxy.metrics:  # a gRPC refusal is an HTTP 200 with a grpc-status: the gateway counts them
            not_ok = _share_not_ok(counted, answered(proxy.http_port), "grpc:", ":OK")
        p99 = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out.stdout)
        rps = requests / wall if wall else 0.0
        self.grpc_rate[body] = max(rps, 50.0)  # the next run of this body lasts about ``seconds``
        return Cell(rps=rps, cpu_us=spent / requests * 1e6, not_ok=not_ok,
                    p99_ms=_ms(p99.group(1)) if p99 else 0.0)

    def alternate(self, loads: list[tuple[Proxy | None, Callable[[Proxy], Cell]]]) -> list[Cell | None]:
        """Each proxy's load, round by round (order flipped every round); the median of each."""
        cells: list[list[Cell]] = [[] for _ in loads]
        for round_no in range(self.rounds):
            order = list(enumerate(loads))
            if round_no % 2:
                order.reverse()
            for index, (proxy, load) in order:
                if proxy is not None:
                    cells[index].append(load(proxy))
        return [_median(found) if found else None for found in cells]


# -- the sweeps -----------------------------------------------------------------------------------
def connection_sweep(bench: Bench) -> list[Row]:
    rows = []
    small = http_body(bench.workdir, 16)
    message = grpc_body(bench.workdir, 16)
    with bench.gateway() as gateway, bench.nginx() as proxy:
        bench.wrk(gateway, small, 16, 1)  # warm-up
        for protocol in ("http", "grpc"):
            base: dict[str, float] = {}
            for connections in ACTIVE:
                print(f"  connections: {protocol} {connections} active ...", flush=True)

                def load(p: Proxy, c: int = connections, proto: str = protocol) -> Cell:
                    if proto == "http":
                        return bench.wrk(p, small, c, bench.seconds)
                    return bench.h2load(p, message, c, bench.seconds)

                cells = bench.alternate([(gateway, load), (proxy, load)])
                for name, cell in zip(("gateway", "nginx"), cells):
                    if cell is not None:
                        base.setdefault(name, cell.rps * (1 - cell.not_ok))
                        cell.extra["of_16"] = cell.rps * (1 - cell.not_ok) / base[name] if base[name] else 0.0
                rows.append(Row("connections", f"{protocol} {connections} active", cells[0] or Cell(), cells[1]))
    return rows


def idle_sweep(bench: Bench) -> list[Row]:
    rows = []
    with bench.gateway() as gateway, bench.nginx() as proxy:
        for protocol in ("http", "grpc"):
            for count in IDLE:
                print(f"  idle: {protocol} {count} connections ...", flush=True)
                cells: list[Cell | None] = []
                for target in (gateway, proxy):
                    if target is None:
                        cells.append(None)
                        continue
                    port = target.http_port if protocol == "http" else target.grpc_port
                    cells.append(idle_cpu(target.pid, port, protocol, count, bench.seconds))
                rows.append(Row("idle", f"{protocol} {count} idle", cells[0] or Cell(), cells[1]))
    return rows


def idle_cpu(pid: int, port: int, protocol: str, count: int, seconds: float) -> Cell:
    """Open ``count`` idle connections from a child process, then the proxy's CPU per second while they sit."""
    holder = subprocess.Popen([sys.executable, __file__, "--hold", f"{protocol}:{port}:{count}"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        opened = int(holder.stdout.readline().split()[0] or 0)
        time.sleep(1.0)  # what the opening cost has settled
        before = thread_cpu_ns(pid)
        started = time.monotonic()
        time.sleep(seconds)
        spent = cpu_s(pid, before)
        wall = time.monotonic() - started
        os.kill(holder.pid, 10)  # SIGUSR1: report how many are still open
        still = int(holder.stdout.readline().split()[0] or 0)
    finally:
        _stop(holder)
    return Cell(extra={"cpu_ms_per_s": spent / wall * 1000, "opened": opened, "open_at_end": still})


def body_sweep(bench: Bench) -> list[Row]:
    rows = []
    for protocol in ("http", "grpc"):
        for label, size in SIZES.items():
            print(f"  bodies: {protocol} {label} ...", flush=True)
            if protocol == "http":
                body = http_body(bench.workdir, size)

                def load(p: Proxy, b: tuple[Path, str] = body) -> Cell:
                    return bench.wrk(p, b, BODY_CONCURRENCY, bench.seconds)
            else:
                message = grpc_body(bench.workdir, size)

                def load(p: Proxy, m: Path = message) -> Cell:  # type: ignore[misc]
                    return bench.h2load(p, m, BODY_CONCURRENCY, bench.seconds)
            mb = size / (1 << 20)
            with bench.gateway() as gateway, bench.nginx() as proxy:  # fresh: RSS growth from its idle size
                idle_kb = status_kb(gateway.pid, "VmRSS")
                reset_peak_rss(gateway.pid)
                cells = bench.alternate([(gateway, load), (proxy, load)])
                peak_kb = status_kb(gateway.pid, "VmHWM")
            for cell in cells:
                if cell is not None:
                    cell.extra["cpu_ms_per_mb"] = cell.cpu_us / 1000 / mb
            gateway_cell = cells[0] or Cell()
            in_flight = BODY_CONCURRENCY * size
            gateway_cell.extra["rss_growth_mb"] = (peak_kb - idle_kb) / 1024
            gateway_cell.extra["rss_over_in_flight"] = (peak_kb - idle_kb) * 1024 / in_flight
            rows.append(Row("bodies", f"{protocol} {label} x{BODY_CONCURRENCY}", gateway_cell, cells[1]))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connections, idle and bodies sweeps (issue 37)")
    group.add_argument("--data-s", type=float, default=5.0, help="seconds of load (or idling) per cell (5)")
    group.add_argument("--data-set", action="append", default=[], metavar="NAME=VALUE",
                       help="a gateway setting for these sweeps, e.g. --data-set max_connections_per_client=10000")
    group.add_argument("--no-nginx", action="store_true", help="the gateway alone")


@contextlib.contextmanager
def _bench(args: argparse.Namespace) -> Iterator[Bench]:
    for tool in ("wrk", "h2load"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found (`make bench` installs it)")
    settings = dict(pair.split("=", 1) for pair in args.data_set)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-scale-data-"))
    try:
        with Bench(workdir, args.data_s, args.rounds, with_nginx=not args.no_nginx,
                   gateway_env={f"GATEWAY_{name.upper()}": value for name, value in settings.items()}) as bench:
            yield bench
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _settings_note(args: argparse.Namespace) -> list[str]:
    changed = ", ".join(args.data_set) or "none"
    return [f"gateway settings besides its defaults: {changed}; medians of {args.rounds} alternating round(s) of "
            f"{args.data_s:g} s; load generator, proxies and stub share the machine's cores"]


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


@sweep("connections", "16, 1,000 and 5,000 active connections on both protocols, nginx beside: throughput, "
       "refusals, CPU per request")
def connections_table(args: argparse.Namespace) -> list[Table]:
    with _bench(args) as bench:
        rows = connection_sweep(bench)
    table = Table("active connections (issue 37)", ["load", "gateway rps", "not OK", "of 16", "CPU us/req",
                                                    "p99 ms", "nginx rps", "nginx not OK", "nginx of 16",
                                                    "nginx CPU us/req"], notes=_settings_note(args) + [
        "not OK: answers other than 200 / OK (the gateway's from its /metrics); of 16: useful throughput "
        "(OK answers per second) over the same proxy's 16-connection row"])
    for row in rows:
        g, n = row.gateway, row.nginx
        table.rows.append({"load": row.label, "gateway rps": _f(g.rps, 0), "not OK": f"{g.not_ok:.1%}",
                           "of 16": _f(g.extra.get("of_16")), "CPU us/req": _f(g.cpu_us, 0),
                           "p99 ms": _f(g.p99_ms, 1), "nginx rps": _f(n.rps, 0) if n else "-",
                           "nginx not OK": f"{n.not_ok:.1%}" if n else "-",
                           "nginx of 16": _f(n.extra.get("of_16")) if n else "-",
                           "nginx CPU us/req": _f(n.cpu_us, 0) if n else "-"})
    return [table]


@sweep("idle", "0, 1,000 and 5,000 idle connections on both protocols, nginx beside: CPU per second")
def idle_table(args: argparse.Namespace) -> list[Table]:
    with _bench(args) as bench:
        rows = idle_sweep(bench)
    base: dict[str, float] = {}
    table = Table("idle connections (issue 37)", ["load", "gateway CPU ms/s", "above 0 conns", "open at end",
                                                  "nginx CPU ms/s", "nginx open at end"],
                  notes=_settings_note(args) + ["above 0 conns: less the same port's row without connections "
                                                "(the gateway's own health checks and ticks)"])
    for row in rows:
        g, n = row.gateway, row.nginx
        protocol = row.label.split()[0]
        cpu = g.extra.get("cpu_ms_per_s", 0.0)
        base.setdefault(protocol, cpu)
        table.rows.append({"load": row.label, "gateway CPU ms/s": _f(cpu), "above 0 conns": _f(cpu - base[protocol]),
                           "open at end": int(g.extra.get("open_at_end", 0)),
                           "nginx CPU ms/s": _f(n.extra.get("cpu_ms_per_s")) if n else "-",
                           "nginx open at end": int(n.extra.get("open_at_end", 0)) if n else "-"})
    return [table]


@sweep("bodies", "1 KB to 8 MB bodies and messages on both protocols, nginx beside: CPU per MB, peak RSS")
def bodies_table(args: argparse.Namespace) -> list[Table]:
    with _bench(args) as bench:
        rows = body_sweep(bench)
    table = Table("request size (issue 37)", ["load", "gateway rps", "CPU ms/MB", "RSS +MB", "RSS / in flight",
                                              "not OK", "nginx rps", "nginx CPU ms/MB"],
                  notes=_settings_note(args) + [
                      f"{BODY_CONCURRENCY} requests in flight; RSS +MB: a fresh gateway's peak RSS (VmHWM) over its "
                      "idle RSS; RSS / in flight: that growth over the bytes of the requests in flight"])
    for row in rows:
        g, n = row.gateway, row.nginx
        table.rows.append({"load": row.label, "gateway rps": _f(g.rps, 0),
                           "CPU ms/MB": _f(g.extra.get("cpu_ms_per_mb"), 3),
                           "RSS +MB": _f(g.extra.get("rss_growth_mb"), 1),
                           "RSS / in flight": _f(g.extra.get("rss_over_in_flight")), "not OK": f"{g.not_ok:.1%}",
                           "nginx rps": _f(n.rps, 0) if n else "-",
                           "nginx CPU ms/MB": _f(n.extra.get("cpu_ms_per_mb"), 3) if n else "-"})
    return [table]


# -- helpers --------------------------------------------------------------------------------------
def _share_not_ok(before: dict[str, float], after: dict[str, float], protocol: str, ok: str) -> float:
    """The share of answers other than ``ok``; requests the client left (499, CANCELLED: the load
    generator closing its connections at the end of its run, ~1,000 at 1,000 connections) are
    neither: wrk does not count them for nginx either."""
    counts = {key: value - before.get(key, 0.0) for key, value in after.items()
              if key.startswith(protocol) and not key.endswith((":499", ":CANCELLED"))}
    total = sum(counts.values())
    return sum(value for key, value in counts.items() if not key.endswith(ok)) / total if total else 0.0


def _non_2xx(wrk_output: str) -> int:
    match = re.search(r"Non-2xx or 3xx responses: (\d+)", wrk_output)
    return int(match.group(1)) if match else 0


def _ms(value: str) -> float:
    number = float(re.sub(r"[a-z]+$", "", value))
    return number / 1000 if value.endswith("us") else number * 1000 if value.endswith("s") and \
        not value.endswith("ms") else number


def _median(cells: list[Cell]) -> Cell:
    extra = {key: median(c.extra.get(key, 0.0) for c in cells) for key in cells[0].extra}
    return Cell(median(c.rps for c in cells), median(c.cpu_us for c in cells), median(c.not_ok for c in cells),
                median(c.p99_ms for c in cells), extra)


def _stop(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


# -- the idle connections' holder (a child process) -----------------------------------------------
def hold(spec: str) -> None:
    """``protocol:port:count``: open the connections (one HTTP request, or the HTTP/2 preface and
    SETTINGS, on each), print how many opened, then sit; on SIGUSR1 print how many are still open."""
    protocol, port, count = spec.split(":")
    import signal

    async def main() -> None:
        loop = asyncio.get_running_loop()
        opened: list[asyncio.StreamWriter] = []
        closed = 0
        gate = asyncio.Semaphore(100)

        async def watch(reader: asyncio.StreamReader) -> None:
            nonlocal closed
            with contextlib.suppress(OSError):
                while await reader.read(1 << 16):
                    pass
            closed += 1

        async def one(index: int) -> None:
            # from 100 loopback addresses, as many client pods would (one address meets the per-client cap)
            source = (f"127.0.{1 + index % 100 // 250}.{1 + index % 100}", 0)
            async with gate:
                with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                    reader, writer = await asyncio.open_connection("127.0.0.1", int(port), limit=1 << 20,
                                                                   local_addr=source)
                    if protocol == "http":
                        writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: bench\r\n\r\n")
                        await reader.readuntil(b"\r\n\r\n")
                    else:
                        writer.write(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                        await reader.readexactly(9)
                        writer.write(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")  # SETTINGS ACK
                    opened.append(writer)
                    watchers.add(loop.create_task(watch(reader)))

        watchers: set[asyncio.Task[None]] = set()
        await asyncio.gather(*(one(index) for index in range(int(count))))
        print(len(opened), flush=True)
        report = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, report.set)
        await report.wait()
        print(len(opened) - closed, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description="the idle connections' holder of the idle sweep (a child process)")
    parser.add_argument("--hold", required=True, help="protocol:port:count")
    hold(parser.parse_args().hold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
