"""What ``bench/scale.py``'s sweeps share: the stub, a gateway process, CPU from /proc, wrk, tables.

A sweep is a function registered with :func:`sweep`: it gets the parsed arguments and returns
the tables it measured (:class:`Table`); ``bench/scale.py --only NAME`` runs it alone. Every
process a sweep starts is stopped by the ``with`` block that started it, also when it fails.

CPU is read per thread from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds): the few
milliseconds per second a control plane spends are below what clock ticks (10 ms) can show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from gateway.devtools.local_triton import free_port  # noqa: E402

TOKEN = "bench-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
POLICY = {"weights": {"2": 80, "3": 20}}  # every model's policy in the sweeps


# -- the sweeps' registry -------------------------------------------------------------------------
@dataclass
class Table:
    """One printed table: a title, its columns in order, a row per configuration, notes under it."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        cells = [[_cell(row.get(column)) for column in self.columns] for row in self.rows]
        widths = [max([len(column), *(len(row[i]) for row in cells)]) for i, column in enumerate(self.columns)]
        lines = [f"## {self.title}", "| " + " | ".join(c.ljust(w) for c, w in zip(self.columns, widths)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in cells]
        return "\n".join([*lines, *self.notes])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@dataclass(frozen=True)
class Sweep:
    name: str
    help: str
    run: Callable[[argparse.Namespace], list[Table]]


SWEEPS: dict[str, Sweep] = {}


def sweep(name: str, help: str) -> Callable[[Callable[[argparse.Namespace], list[Table]]],
                                          Callable[[argparse.Namespace], list[Table]]]:
    """Register a sweep under ``name`` (``--only name``)."""
    def register(run: Callable[[argparse.Namespace], list[Table]]) -> Callable[[argparse.Namespace], list[Table]]:
        SWEEPS[name] = Sweep(name, help, run)
        return run
    return register


def spread(values: Sequence[float]) -> str:
    """min / median / max over rounds: a wide spread is the machine, a shifted one a cost."""
    if not values:
        return "-"
    if len(values) == 1:
        return _cell(values[0])
    return f"{_cell(min(values))} / {_cell(median(values))} / {_cell(max(values))}"


# -- CPU and memory from /proc ------------------------------------------------------------------------
def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each live thread of ``pid`` (ns)."""
    found: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                found[f"{pid}/{task}"] = int(stat.read().split()[0])
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


class CpuMeter:
    """CPU seconds spent by a set of processes' threads between :meth:`start` and :meth:`stop`
    (threads that ended meanwhile are missing, never counted negative)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.before: dict[str, int] = {}

    def _now(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for pid in self.pids():
            found.update(thread_cpu_ns(pid))
        return found

    def start(self) -> None:
        self.before = self._now()

    def stop(self) -> float:
        after = self._now()
        return sum(ns - self.before.get(task, 0) for task, ns in after.items()) / 1e9


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


# -- HTTP ------------------------------------------------------------------------------------------
def call(url: str, method: str = "GET", body: object = None, timeout_s: float = 30,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, method=method, data=data,
                                     headers={**AUTH, "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {timeout_s:g} s")


# -- the stub and the gateway ------------------------------------------------------------------------
class Stub:
    """``bench/stub_triton.py --models N`` on a free port (HTTP only), with its request counts."""

    def __init__(self, models: int) -> None:
        self.models = models
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, str(HERE / "stub_triton.py"), "--http-port", str(self.port),
                                         "--models", str(models)], stdout=subprocess.DEVNULL)
        wait_until(lambda: call(f"{self.url}/v2/health/ready")[0] == 200, 30, "the stub's start")

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = json.loads(call(f"{self.url}/stub/counts")[1])
        return counts

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@contextmanager
def stubs(sizes: Sequence[int]) -> Iterator[dict[int, Stub]]:
    started: dict[int, Stub] = {}
    try:
        for size in sizes:
            started[size] = Stub(size)
        yield started
    finally:
        for stub in started.values():
            stub.stop()


def model_names(count: int) -> list[str]:
    """The stub's model names (bench/stub_triton.py: ``qc`` first)."""
    return ["qc", *(f"m{i:05d}" for i in range(1, count))]


def prepare_store(path: Path, models: Sequence[str], policy: dict[str, Any] = POLICY) -> None:
    """A SQLite store holding a policy for each model, written directly (no gateway)."""
    from gateway.policy import PolicySpec
    from gateway.store.base import EventDraft
    from gateway.store.sqlite import SQLiteStore

    async def fill() -> None:
        store = SQLiteStore(path)
        await store.open()
        spec = PolicySpec.model_validate(policy)
        try:
            for model in models:
                await store.put_policy(model, spec, None, EventDraft("bench", "put_policy", "bench/scale.py"))
        finally:
            await store.close()

    asyncio.run(fill())


# The gateways' source trees by label: this one, and/or other commits' (bench/scale.py --base,
# --versus), as bench/ab.py does; a sweep runs each configuration once per tree, interleaved.
TREES: dict[str, Path] = {"this tree": ROOT}


def extract(commit: str, into: Path) -> Path:
    """``commit``'s tree, as committed: nothing of this work tree leaks into it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


class GatewayProcess:
    """``python -m gateway serve`` against a stub, on free ports, over a SQLite store file;
    ``startup_s`` is the time from the process' start to ready (every worker up)."""

    def __init__(self, stub: Stub, store: Path, workers: int = 1, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        cwd = cwd or next(iter(TREES.values()))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        environment = {**os.environ, "PYTHONPATH": str(cwd), "GATEWAY_PORT": str(self.port),
                       "GATEWAY_GRPC_ENABLED": "false", "GATEWAY_TRITON_URL": stub.url,
                       "GATEWAY_WORKERS": str(workers), "GATEWAY_STORE_URL": f"sqlite:///{store}",
                       "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_ADMIN_TOKEN": TOKEN, **(env or {})}
        started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=environment, cwd=cwd)
        try:
            wait_until(self._ready, 300, "the gateway's start")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {self.process.returncode}")
        if self.workers == 1:
            return call(f"{self.url}/readyz", timeout_s=2)[0] == 200
        status, body = call(f"{self.url}/admin/workers", timeout_s=2)
        return status == 200 and all(worker["up"] for worker in json.loads(body)["workers"])

    def pids(self) -> list[int]:
        return descendants(self.process.pid)

    def own(self) -> CpuMeter:
        """The main process alone (one process: the gateway; workers: the supervisor and its control plane)."""
        return CpuMeter(lambda: [self.process.pid])

    def whole(self) -> CpuMeter:
        return CpuMeter(self.pids)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextmanager
def gateway(stub: Stub, store: Path, workers: int = 1, env: dict[str, str] | None = None,
            tree: Path | None = None) -> Iterator[GatewayProcess]:
    process = GatewayProcess(stub, store, workers, env, tree)
    try:
        yield process
    finally:
        process.stop()


@contextmanager
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gateway-scale-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- load ------------------------------------------------------------------------------------------
# Requests spread over BENCH_MODELS models (bench/stub_triton.py's names), each thread from its own
# offset; done() prints one JSON line with the counts and the latency distribution (microseconds).
WRK_MODELS = r"""
local count = tonumber(os.getenv("BENCH_MODELS"))
local body = os.getenv("BENCH_BODY")
local next_model = 0
setup = function(thread) thread:set("offset", math.random(0, count - 1)) end
init = function(args) next_model = offset or 0 end
request = function()
  local name = next_model == 0 and "qc" or string.format("m%05d", next_model)
  next_model = (next_model + 1) % count
  return wrk.format("POST", "/v2/models/" .. name .. "/infer", {["Content-Type"] = "application/json"}, body)
end
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "errors": %d, "max_us": %d, "p99_us": %d, "p50_us": %d}\n',
    summary.requests, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status +
    summary.errors.timeout, latency.max, latency:percentile(99), latency:percentile(50)))
end
"""


def wrk(url: str, models: int, seconds: float, connections: int, script_dir: Path, threads: int = 1,
        timeout_s: float = 30) -> dict[str, float]:
    """wrk POSTing KServe-v2 JSON over ``models`` models for ``seconds``: requests, errors, latency (ms)."""
    script = script_dir / "models.lua"
    if not script.exists():
        script.write_text(WRK_MODELS)
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                          f"--timeout={timeout_s:g}s", "-s", str(script), url], capture_output=True, text=True,
                         env={**os.environ, "BENCH_BODY": BODY, "BENCH_MODELS": str(models)}, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {"requests": found["requests"], "errors": found["errors"], "rps": found["requests"] / max(1, seconds),
            "max_ms": found["max_us"] / 1000, "p99_ms": found["p99_us"] / 1000, "p50_ms": found["p50_us"] / 1000}


class Scraper:
    """Scrapes ``/metrics`` on a thread until stopped, one scrape every ``every_s`` (or back to
    back when one takes longer): each scrape's seconds and bytes."""

    def __init__(self, url: str, every_s: float = 1.0) -> None:
        self.url = url
        self.every_s = every_s
        self.seconds: list[float] = []
        self.sizes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            status, body = call(f"{self.url}/metrics", timeout_s=120)
            if status == 200:
                self.seconds.append(time.monotonic() - started)
                self.sizes.append(len(body))
            self._stop.wait(max(0.0, started + self.every_s - time.monotonic()))


def exposition(url: str) -> tuple[int, int, float]:
    """One scrape: (bytes, series, seconds)."""
    started = time.monotonic()
    _, body = call(f"{url}/metrics", timeout_s=120)
    seconds = time.monotonic() - started
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return len(body), series, seconds
