"""What ``--workers N`` costs: the gateway's CPU per request, summed over all its processes,
with N workers against one, and what the control plane spends on the workers' reports.

Against ``bench/stub_triton.py`` (a fixed answer, no inference: the gateway's own cost), wrk
at the same concurrency drives each configuration for the same time, in interleaved rounds.
CPU is read from /proc for the gateway's process and every descendant (workers, spare).
The control plane's cost per worker per second is the supervisor process' own CPU under load
minus its CPU over as long without traffic (its fixed cost: health checks, sync, ticks),
divided by (workers x seconds); its decode + merge time per report is
``gateway_worker_merge_seconds_total`` / ``gateway_worker_reports_total``.

    .venv/bin/python bench/workers.py --seconds 10 --rounds 6 --connections 64

Each configuration's figures are printed as min / median / max over the rounds, and so is
the same-round ratio of N workers to one: on a loaded machine the spread shows whether a
difference is a cost or noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.devtools.local_triton import free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
LUA = """
wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY")
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "errors": %d}\\n', summary.requests,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status +
    summary.errors.timeout))
end
"""


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each of ``pid``'s live threads, at nanosecond resolution (schedstat): the
    supervisor's few ms per second above idle are below what clock ticks (10 ms) can show."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                found[task] = int(stat.read().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return found


def own_cpu_s(before: dict[str, int], after: dict[str, int]) -> float:
    """The CPU the threads alive at the end spent since ``before`` (a thread started meanwhile:
    all of it); a thread that ended meanwhile is missing, never counted negative."""
    return sum(ns - before.get(task, 0) for task, ns in after.items()) / 1e9


def tree(pid: int) -> list[int]:
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


def tree_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += cpu_ticks(pid)
        except OSError:
            pass
    return total


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines
            if line.startswith(("gateway_worker_merge_seconds_total", "gateway_worker_reports_total"))}


class Gateway:
    def __init__(self, workers: int, stub_port: int, tmp: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "GATEWAY_PORT": str(self.port), "GATEWAY_GRPC_PORT": str(free_port()),
               "GATEWAY_TRITON_URL": f"http://127.0.0.1:{stub_port}", "GATEWAY_WORKERS": str(workers),
               "GATEWAY_STORE_URL": f"sqlite:///{tmp / f'state-{workers}.db'}", "GATEWAY_LOG_LEVEL": "warning",
               "GATEWAY_POLICIES": json.dumps({"qc": {"weights": {"2": 80, "3": 20}}}),
               "GATEWAY_ADMIN_TOKEN": "bench-admin-token", "PYTHONPATH": str(ROOT)}
        self.workers = workers
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"{self.url}/admin/workers" if workers > 1 else f"{self.url}/readyz",
                                                 headers={"Authorization": "Bearer bench-admin-token"})
                with urllib.request.urlopen(request, timeout=1) as response:
                    doc = json.loads(response.read())
                if workers == 1 or all(w["up"] for w in doc["workers"]):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("gateway did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def wrk(url: str, seconds: float, connections: int, script: Path) -> dict[str, int]:
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{int(seconds)}s", "-s", str(script),
                          f"{url}/v2/models/qc/infer"], capture_output=True, text=True,
                         env={**os.environ, "BENCH_BODY": BODY}, check=True)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def measure(gateway: Gateway, seconds: float, connections: int, script: Path) -> dict[str, float]:
    wrk(gateway.url, 1, connections, script)  # warm: pools, caches
    idle_own = 0.0
    if gateway.workers > 1:  # the control plane's fixed cost (health checks, sync, ticks) without traffic
        idle_before = thread_cpu_ns(gateway.process.pid)
        time.sleep(seconds)
        idle_own = own_cpu_s(idle_before, thread_cpu_ns(gateway.process.pid))
    pids = tree(gateway.process.pid)
    before, own_before = tree_ticks(pids), thread_cpu_ns(gateway.process.pid)
    metrics_before = scrape(gateway.url) if gateway.workers > 1 else {}
    result = wrk(gateway.url, seconds, connections, script)
    pids = tree(gateway.process.pid)  # the same processes (none restarted: checked below)
    spent = (tree_ticks(pids) - before) / CLK_TCK
    own = own_cpu_s(own_before, thread_cpu_ns(gateway.process.pid))
    row = {"requests": result["requests"], "errors": result["errors"], "rps": result["requests"] / seconds,
           "cpu_us_per_request": spent / max(1, result["requests"]) * 1e6}
    if gateway.workers > 1:
        after = scrape(gateway.url)
        reports = after["gateway_worker_reports_total"] - metrics_before["gateway_worker_reports_total"]
        merge = after["gateway_worker_merge_seconds_total"] - metrics_before["gateway_worker_merge_seconds_total"]
        row["control_plane_cpu_us_per_worker_second"] = (own - idle_own) / (gateway.workers * seconds) * 1e6
        row["merge_us_per_report"] = merge / max(1, reports) * 1e6
        row["reports_per_worker_second"] = reports / (gateway.workers * seconds)
    return row


def merge_cost(requests_per_report: int = 2500, reports: int = 400) -> tuple[float, float, int]:
    """Decode + merge of one report of a worker at 10,000 req/s (2,500 requests in 250 ms over a
    realistic label mix: 2 models x 2 versions x 2 routes x 2 protocols, 3 codes, a watched
    canary): (µs per report on the control plane, µs per report to take it on the worker, bytes)."""
    import pickle
    import random

    from gateway.telemetry.recorder import Outcome
    from gateway.workers.deltas import DeltaRecorder, MergedRecorder

    rng = random.Random(1)
    worker, merged = DeltaRecorder(), MergedRecorder()
    merged.watch_latencies("qc", "3")
    worker.watch_only({("qc", "3")})
    labels = [(m, v, r, p, c) for m in ("qc", "tok") for v in ("2", "3") for r in ("weighted", "sticky")
              for p in ("http", "grpc") for c in ("200", "200", "200", "500", "429")]
    blobs, take_s = [], 0.0
    for _ in range(reports):
        for _ in range(requests_per_report):
            model, version, route, protocol, code = rng.choice(labels)
            outcome = Outcome.SUCCESS if code == "200" else Outcome.UPSTREAM_ERROR if code == "500" else \
                Outcome.OVERLOAD
            worker.record(model, version, outcome, rng.random() / 50, route, protocol, code)
        started = time.perf_counter()
        blobs.append(pickle.dumps(("delta", worker.take_delta(), 0.0, 1), protocol=pickle.HIGHEST_PROTOCOL))
        take_s += time.perf_counter() - started
    started = time.process_time()
    for blob in blobs:
        message = pickle.loads(blob)
        merged.merge(0, message[1])
    spent = time.process_time() - started
    return spent / reports * 1e6, take_s / reports * 1e6, sum(map(len, blobs)) // reports


def spread_cost(models: int, requests_per_report: int = 2500, reports: int = 120) -> tuple[float, float, int]:
    """As :func:`merge_cost`, with the worker's requests spread round-robin over ``models`` models
    (versions 2 and 3, 80/20: bench/scale.py's workers sweep): (µs CPU per report on the control
    plane, µs to take it on the worker, bytes), over the reports after the first third (the
    control plane has named every label set by then: the steady state)."""
    import pickle
    import random

    from gateway.telemetry.recorder import Outcome
    from gateway.workers.deltas import DeltaRecorder, MergedRecorder

    now = [1000.0]
    rng = random.Random(1)
    worker, merged = DeltaRecorder(clock=lambda: now[0]), MergedRecorder(clock=lambda: now[0])
    names = ["qc" if index == 0 else f"m{index:05d}" for index in range(models)]
    blobs, take_s, at = [], 0.0, 0
    for _ in range(reports):
        for request in range(requests_per_report):
            version = "2" if rng.random() < 0.8 else "3"
            worker.record(names[at], version, Outcome.SUCCESS, rng.random() / 50, "weighted", "http", "200")
            at = (at + 1) % models
            if request % (requests_per_report // 10) == 0:
                now[0] += 0.025  # 250 ms per report
        started = time.process_time()
        blobs.append(pickle.dumps(("delta", worker.take_delta(), 0.0, 1), protocol=pickle.HIGHEST_PROTOCOL))
        take_s += time.process_time() - started
    warm = reports // 3
    for blob in blobs[:warm]:
        merged.merge(0, pickle.loads(blob)[1])
    started = time.process_time()
    for blob in blobs[warm:]:
        merged.merge(0, pickle.loads(blob)[1])
    spent = time.process_time() - started
    return spent / (reports - warm) * 1e6, take_s / reports * 1e6, sum(map(len, blobs)) // reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (order flipped every round)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="compared with 1")
    parser.add_argument("--merge-only", action="store_true", help="only the report decode + merge micro-measure")
    parser.add_argument("--spread-models", default="1,100,1000", help="the micro-measure again with the requests "
                        "spread over each of these numbers of models (comma-separated; empty: not)")
    args = parser.parse_args()
    control, take, size = merge_cost()
    print(f"one report of a worker at 10,000 req/s ({size} bytes): {take:.0f} us to take on the worker, "
          f"{control:.0f} us CPU to decode and merge on the control plane; 32 workers x 4 reports/s: "
          f"{32 * 4 * control / 1e6:.3f} CPU seconds per second", flush=True)
    for models in [int(part) for part in args.spread_models.split(",") if part]:
        control, take, size = spread_cost(models)
        print(f"  spread over {models} models ({size} bytes): {take:.0f} us to take, {control:.0f} us to decode "
              f"and merge; 32 workers x 4 reports/s: {32 * 4 * control / 1e6:.3f} CPU seconds per second", flush=True)
    if args.merge_only:
        return
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        script = tmp / "bench.lua"
        script.write_text(LUA)
        stub_port = free_port()
        stub = subprocess.Popen([sys.executable, str(ROOT / "bench" / "stub_triton.py"), "--http-port",
                                 str(stub_port)], stdout=subprocess.DEVNULL)
        time.sleep(1.5)
        rows: dict[int, list[dict[str, float]]] = {1: [], args.workers: []}
        try:
            for round_ in range(args.rounds):
                # ABBA: the order flips every round, so a drift of the machine's load over the run
                # weighs on both configurations alike
                for count in (1, args.workers) if round_ % 2 == 0 else (args.workers, 1):
                    gateway = Gateway(count, stub_port, tmp)
                    try:
                        row = measure(gateway, args.seconds, args.connections, script)
                    finally:
                        gateway.stop()
                    rows[count].append(row)
                    print(f"round {round_ + 1} workers={count}: " + ", ".join(
                        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        finally:
            stub.terminate()
            stub.wait(10)
    summarize(rows, args)


def spread(values: list[float], unit: str = "", digits: int = 1) -> str:
    """min / median / max: a reader tells noise (a wide spread) from a cost (a shifted one)."""
    return f"{min(values):.{digits}f} / {median(values):.{digits}f} / {max(values):.{digits}f}{unit}"


def summarize(rows: dict[int, list[dict[str, float]]], args: argparse.Namespace) -> None:
    many = rows[args.workers]
    cpu_one = [r["cpu_us_per_request"] for r in rows[1]]
    cpu_many = [r["cpu_us_per_request"] for r in many]
    # each round's two runs are neighbours in time: their ratio cancels the load both saw
    ratios = [(m / o - 1) * 100 for m, o in zip(cpu_many, cpu_one)]
    print(f"\n{args.rounds} interleaved rounds (ABBA), wrk -c{args.connections}, {args.seconds:g} s each; "
          "min / median / max over rounds:")
    print(f"  workers=1: {spread(cpu_one)} us CPU/request, {spread([r['rps'] for r in rows[1]], digits=0)} req/s")
    print(f"  workers={args.workers}: {spread(cpu_many)} us CPU/request, "
          f"{spread([r['rps'] for r in many], digits=0)} req/s")
    print(f"  workers={args.workers} vs 1, the same round: {spread(ratios, ' %', digits=1)} CPU/request "
          "(a spread wider than the median is noise, not a cost)")
    errors = sum(r["errors"] for rs in rows.values() for r in rs)
    if errors:
        print(f"  WARNING: wrk counted {errors:.0f} errors: the figures above include them")
    cp = [r["control_plane_cpu_us_per_worker_second"] for r in many]
    merge = [r["merge_us_per_report"] for r in many]
    reports = median(r["reports_per_worker_second"] for r in many)
    print(f"  control plane: {spread(cp, digits=0)} us CPU per worker per second above idle "
          f"({reports:.1f} reports/worker/s, {spread(merge, digits=0)} us to decode and merge one)")
    print(f"  32 workers: {32 * median(cp) / 1e6:.3f} CPU seconds per second on the control plane "
          f"(decoding and merging alone {32 * reports * median(merge) / 1e6:.3f}); a report's size follows the "
          "label sets touched in 250 ms, not the request rate")


if __name__ == "__main__":
    main()
