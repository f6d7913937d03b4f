"""A/B: this tree's gateway against another commit's, interleaved, in one run.

A change that touches the hot path has to show it costs nothing. Comparing two separate `make
bench` runs on a shared 2-core machine mixes the change with the machine's mood, so this starts
one Triton and two gateways side by side (this work tree, and `--base` extracted with `git
archive`), then alternates the same load between them round by round: JSON over HTTP with wrk
at c=32 and ModelInfer over gRPC with h2load at c=32. It prints every round and the mean
gateway CPU per request (from /proc, each gateway process alone) for each side.

    .venv/bin/python bench/ab.py --base HEAD~3            # 3 rounds each (default)
    .venv/bin/python bench/ab.py --base main --rounds 5 --only http
    .venv/bin/python bench/ab.py --base main --stub   # against bench/stub_triton.py: the gateways' cost alone
    .venv/bin/python bench/ab.py --base 8c86ecb --nginx --concurrency 1   # one request at a time, nginx and
        # direct-to-Triton beside: CPU per request against nginx's, p50 added over direct
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import nginx  # noqa: E402
from overhead import CLK_TCK, LUA, POLICY, Result, bodies, cpu_seconds, grpc_body, run_h2load, run_wrk, wait_http  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402

Side = tuple[int, int, int]  # the pid whose CPU is counted, its HTTP port, its gRPC port


def extract(commit: str, into: Path) -> Path:
    """The base side's source, as committed: nothing of this work tree leaks into it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


class StubTriton:
    """bench/stub_triton.py on free ports, with the two URLs a gateway needs (as LocalTriton has)."""

    def __enter__(self) -> StubTriton:
        self.http_port, grpc_port = free_port(), free_port()
        self.http_url, self.grpc_url = f"http://127.0.0.1:{self.http_port}", f"127.0.0.1:{grpc_port}"
        self.process = subprocess.Popen([sys.executable, str(HERE / "stub_triton.py"), "--http-port",
                                         str(self.http_port), "--grpc-port", str(grpc_port)], stdout=subprocess.DEVNULL)
        wait_http(f"{self.http_url}/v2/health/ready")
        return self

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.wait(10)


def start_gateway(tree: Path, triton: LocalTriton | StubTriton,
                  config: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), GATEWAY_PORT=str(port), GATEWAY_GRPC_PORT=str(grpc_port),
               GATEWAY_TRITON_URL=triton.http_url, GATEWAY_TRITON_GRPC_URL=triton.grpc_url,
               GATEWAY_LOG_LEVEL="warning", GATEWAY_STORE_URL="memory://")
    process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], cwd=tree, env=env)
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return process, port, grpc_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare this work tree against (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each side (default 3)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of wrk load per HTTP run (default 5)")
    parser.add_argument("--grpc-requests", type=int, default=10000, help="h2load requests per gRPC run (10000)")
    parser.add_argument("--only", choices=("all", "http", "grpc"), default="all", help="which protocol to measure")
    parser.add_argument("--nginx", action="store_true",
                        help="a third side, nginx (bench/nginx.py: one worker, keep-alive / grpc_pass), in the same "
                             "rounds: the CPU ratios of both gateways to nginx's, measured together")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32; 1: one at a "
                        "time, where the added latency shows; --nginx then adds direct-to-Triton, for the p50 added)")
    parser.add_argument("--stub", action="store_true",
                        help="both gateways in front of bench/stub_triton.py (no inference: less CPU taken from the "
                             "gateways by Triton on a shared machine) instead of a real Triton")
    args = parser.parse_args()
    for tool in ("wrk", "h2load") + (("nginx",) if args.nginx else ()):
        if not shutil.which(tool):
            print(f"bench: {tool} not found (run `make bench` once: it installs wrk and nghttp2-client)",
                  file=sys.stderr)
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="gateway-ab-"))
    try:
        return run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path) -> int:
    base_tree = extract(args.base, Path(tempfile.mkdtemp(prefix="base-", dir=workdir)))
    script = workdir / "bench.lua"
    script.write_text(LUA)
    config = workdir / "gateway.yaml"
    config.write_text(POLICY)
    json_body, _ = bodies(workdir)["json"]
    grpc = grpc_body(workdir)
    faults = workdir / "faults.json"
    faults.write_text("{}")
    print(f"A = this work tree, B = {args.base}; starting {'the stub' if args.stub else 'tritonserver'} ...",
          flush=True)
    with contextlib.ExitStack() as stack:
        triton: StubTriton | LocalTriton = StubTriton() if args.stub else LocalTriton.on_free_ports(faults_file=faults)
        stack.enter_context(triton)
        processes = [start_gateway(ROOT, triton, config), start_gateway(base_tree, triton, config)]
        stack.callback(stop, processes)
        sides: dict[str, Side] = {"A": (processes[0][0].pid, processes[0][1], processes[0][2]),
                                  "B": (processes[1][0].pid, processes[1][1], processes[1][2])}
        if args.nginx:
            ports = free_port(), free_port()
            proxy = stack.enter_context(nginx.Nginx(workdir, f"127.0.0.1:{triton.http_port}", triton.grpc_url, *ports))
            sides["N"] = (proxy.worker_pids()[0], *ports)
            if args.concurrency == 1:  # straight to Triton: what each proxy adds to one request's latency
                sides["D"] = (0, triton.http_port, int(triton.grpc_url.rsplit(":", 1)[1]))
        loads: dict[str, Callable[[Side, bool], Result]] = {}
        c = args.concurrency
        if args.only != "grpc":
            loads[f"http json c={c}"] = lambda side, warm_up: run_wrk(
                f"http://127.0.0.1:{side[1]}/v2/models/qc/infer", json_body, "", c,
                1.0 if warm_up else args.seconds, script, side[0] or None)
        if args.only != "http":
            loads[f"grpc c={c}"] = lambda side, warm_up: run_h2load(
                f"127.0.0.1:{side[2]}", grpc, c, (500 if warm_up else args.grpc_requests) // (4 if c == 1 else 1),
                workdir, side[0] or None)
        table: dict[str, dict[str, list[Result]]] = {}
        for name, load in loads.items():
            for side in sides.values():
                load(side, True)  # warm-up: connections and caches on every side
            table[name] = {label: [] for label in sides}
            for round_no in range(args.rounds):
                order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
                for label in order:
                    pid = sides[label][0]
                    user_before, cpu_before = (user_seconds(pid), cpu_seconds(pid)) if pid else (0.0, 0.0)
                    result = load(sides[label], False)
                    user, cpu = (user_seconds(pid) - user_before, cpu_seconds(pid) - cpu_before) if pid else (0, 0)
                    result.user_us = (result.cpu_us or 0) * user / cpu if cpu else 0.0
                    table[name][label].append(result)
                    print(f"  {name:<15} round {round_no + 1} {label}: {result.cpu_us or 0:7.1f} us/req "
                          f"(user {result.user_us:5.1f}) {result.rps:8.0f} rps  p50 {result.p50_us / 1000:6.3f} ms  "
                          f"p99 {result.p99_us / 1000:6.2f} ms  errors {result.errors}", flush=True)
    print_summary(table, args.base)
    return 0


def stop(processes: list[tuple[subprocess.Popen[bytes], int, int]]) -> None:
    for process, _, _ in processes:
        process.terminate()
        process.wait(10)


def print_summary(table: dict[str, dict[str, list[Result]]], base: str) -> None:
    print(f"\nmean gateway CPU per request (A = this tree, B = {base}); load generator, both gateways and Triton "
          "share the machine's cores")
    print(f"{'load':<15} | {'A us/req':>9} {'B us/req':>9} {'A/B':>7} | {'A user':>7} {'B user':>7} {'A/B':>7} | "
          f"{'A rps':>8} {'B rps':>8}")
    for name, results in table.items():
        a, b = (mean([r.cpu_us or 0.0 for r in results[s]]) for s in ("A", "B"))
        a_user, b_user = (mean([r.user_us for r in results[s]]) for s in ("A", "B"))
        a_rps, b_rps = (mean([r.rps for r in results[s]]) for s in ("A", "B"))
        print(f"{name:<15} | {a:>9.1f} {b:>9.1f} {a / b - 1:>+7.1%} | {a_user:>7.1f} {b_user:>7.1f} "
              f"{a_user / (b_user or 1) - 1:>+7.1%} | {a_rps:>8.0f} {b_rps:>8.0f}")
    print("user: the CPU time spent in user space (the Python work); the rest is the kernel's (syscalls, loopback TCP)")
    for name, results in table.items():
        if "N" in results:
            n, a, b = (mean([r.cpu_us or 0.0 for r in results[s]]) for s in ("N", "A", "B"))
            n_rps = mean([r.rps for r in results["N"]])
            print(f"{name:<15} | nginx {n:6.1f} us/req ({n_rps:.0f} rps): A/nginx {a / n:4.2f}x, B/nginx {b / n:4.2f}x")
        if "D" in results:  # the p50 each proxy adds to one request (medians over the rounds)
            d, n, a, b = (sorted(r.p50_us for r in results[s])[len(results[s]) // 2] for s in ("D", "N", "A", "B"))
            print(f"{name:<15} | p50 direct {d / 1000:.3f} ms; added: A +{(a - d) / 1000:.3f} ms, "
                  f"B +{(b - d) / 1000:.3f} ms, nginx +{(n - d) / 1000:.3f} ms")


def user_seconds(pid: int) -> float:
    """The process's CPU time in user space: the Python work, apart from the kernel's (syscalls, loopback TCP)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    raise SystemExit(main())
