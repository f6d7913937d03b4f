"""How cheap can a Python HTTP front be? nginx, the gateway and stripped-down Python fronts, one run.

Issue 26 asks the gateway's HTTP CPU per request at c=32 down to 1.5x nginx's. This measures
whether that is reachable from Python at all, and what each layer costs: in front of the same
upstream (a real Triton with the sample model, as bench/ab.py; ``--stub`` for
bench/stub_triton.py), the same wrk load (JSON infer on qc, c=32, bench/overhead.py's script)
drives every side in interleaved rounds (the order rotates each round), and each side's CPU
per request is read from /proc, summed over its process and every descendant:

- ``nginx``: bench/nginx.py (one worker, keep-alive upstream, no access log), the yardstick;
- ``gateway``: ``gateway serve`` from this tree, one worker;
- ``pipe``, ``bare``, ``routed``, ``pooled``, ``proxy``: the ladder of bench/ceiling_fronts.py (a
  byte relay; httptools on both sides with callbacks only; + the gateway's routing and recorder
  calls; or + a task per request over gateway.upstream's pool; + the gateway's own HttpProxy);
- ``granian``, ``granian_rust``: the ``pooled`` forwarding as an RSGI application under granian
  (HTTP in Rust; the application's coroutines as asyncio tasks, or as granian's own Rust tasks),
  if granian is installed (``pip install granian``, the bench extra).

Printed: every round, then per side the median CPU per request with its min-max over the rounds,
the median of the same-round ratios to nginx, its user-space share, throughput, p99 and errors;
the machine's load average and busy share during each run; each side's idle CPU (its background
work, which a per-request figure also carries).

    .venv/bin/python bench/ceiling.py --rounds 5 --seconds 5
    .venv/bin/python bench/ceiling.py --stub --sides nginx,bare,gateway
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from profile import read_collapsed, top_table  # noqa: E402  (bench/profile.py: HERE is ahead of the stdlib)

import nginx  # noqa: E402
from ab import StubTriton, start_gateway, user_seconds  # noqa: E402
from overhead import LUA, POLICY, Result, bodies, cpu_seconds, run_wrk, wait_http  # noqa: E402
from workers import tree  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402

SIDES = ("nginx", "gateway", "pipe", "bare", "routed", "pooled", "proxy", "granian", "granian_rust")
LADDER = {"pipe": "byte relay, no HTTP (asyncio floor)", "bare": "raw Protocol + httptools, callbacks only",
          "routed": "bare + gateway routing and recorder calls",
          "pooled": "bare + task + gateway.upstream pool", "proxy": "bare + gateway HttpProxy (routing, recorder)",
          "granian": "granian RSGI + gateway.upstream pool",
          "granian_rust": "granian RSGI, Rust tasks (--task-impl rust)", "gateway": "gateway serve, 1 worker",
          "nginx": "nginx, 1 worker (yardstick)"}


@dataclass
class Side:
    name: str
    pid: int  # the root of the side's processes: its CPU is summed over it and its descendants
    port: int
    runs: list[Result] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-min load average at the end of each run
    busy: list[float] = field(default_factory=list)  # the machine's busy share of all cores during each run
    idle_ms_per_s: float = 0.0


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def side_seconds(pid: int) -> tuple[float, float]:
    """(user, user + system) CPU seconds of ``pid`` and its descendants (those alive now)."""
    user = total = 0.0
    for each in tree(pid):
        with contextlib.suppress(OSError):
            user, total = user + user_seconds(each), total + cpu_seconds(each)
    return user, total


def measure(side: Side, body: Path, script: Path, seconds: float, connections: int) -> Result:
    busy_before, all_before = machine_ticks()
    user_before, cpu_before = side_seconds(side.pid)
    result = run_wrk(f"http://127.0.0.1:{side.port}/v2/models/qc/infer", body, "", connections, seconds, script, None)
    user_after, cpu_after = side_seconds(side.pid)
    busy_after, all_after = machine_ticks()
    requests = result.rps * seconds
    result.cpu_us = (cpu_after - cpu_before) / requests * 1e6
    result.user_us = (user_after - user_before) / requests * 1e6
    side.load.append(os.getloadavg()[0])
    side.busy.append((busy_after - busy_before) / max(1, all_after - all_before))
    return result


def start_front(kind: str, upstream: str, stack: contextlib.ExitStack) -> tuple[int, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", CEILING_UPSTREAM=upstream)
    if kind.startswith("granian"):
        granian = shutil.which("granian") or str(Path(sys.executable).parent / "granian")
        command = [granian, "--interface", "rsgi", "--loop", "uvloop", "--workers", "1", "--runtime-mode", "st",
                   "--http", "1", "--no-ws", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                   *(["--task-impl", "rust"] if kind == "granian_rust" else []), "ceiling_fronts:rsgi_app"]
    else:
        command = [sys.executable, str(HERE / "ceiling_fronts.py"), kind, "--port", str(port), "--upstream", upstream]
    process = subprocess.Popen(command, env=env, cwd=HERE)
    stack.callback(stop, process)
    wait_http(f"http://127.0.0.1:{port}/v2/health/ready")
    return process.pid, port


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved runs of each side (default 5)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of wrk load per run (default 5)")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--stub", action="store_true", help="in front of bench/stub_triton.py (no inference)")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of each side's idle CPU measured first (3)")
    parser.add_argument("--syscalls", action="store_true",
                        help="after the rounds, one more run of each side under strace -c (not measured): the system "
                             "calls each makes per request, a count the machine's load does not blur")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="after the rounds, one more run of each Python side under py-spy (not measured): "
                             "DIR/<side>.collapsed and .top.txt, as bench/profile.py writes them")
    args = parser.parse_args()
    names = [name.strip() for name in args.sides.split(",") if name.strip()]
    unknown = set(names) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if not (shutil.which("granian") or (Path(sys.executable).parent / "granian").exists()):
        skipped = [name for name in names if name.startswith("granian")]
        if skipped:
            print("bench: granian not installed (pip install granian): its sides are skipped", file=sys.stderr)
        names = [name for name in names if name not in skipped]
    for tool in ("wrk",) + (("nginx",) if "nginx" in names else ()):
        if not shutil.which(tool):
            print(f"bench: {tool} not found (run `make bench` once: it installs it)", file=sys.stderr)
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="gateway-ceiling-"))
    try:
        return run(args, names, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, names: list[str], workdir: Path) -> int:
    script = workdir / "bench.lua"
    script.write_text(LUA)
    config = workdir / "gateway.yaml"
    config.write_text(POLICY)
    body, _ = bodies(workdir)["json"]
    faults = workdir / "faults.json"
    faults.write_text("{}")
    print(f"starting {'the stub' if args.stub else 'tritonserver'} and {', '.join(names)} ...", flush=True)
    with contextlib.ExitStack() as stack:
        triton: StubTriton | LocalTriton = StubTriton() if args.stub else LocalTriton.on_free_ports(faults_file=faults)
        stack.enter_context(triton)
        sides: list[Side] = []
        for name in names:
            if name == "nginx":
                port = free_port()
                proxy = stack.enter_context(nginx.Nginx(workdir, f"127.0.0.1:{triton.http_port}", triton.grpc_url,
                                                        port, free_port()))
                assert proxy.process is not None
                sides.append(Side(name, proxy.process.pid, port))
            elif name == "gateway":
                process, port, _ = start_gateway(ROOT, triton, config)
                stack.callback(stop, process)
                sides.append(Side(name, process.pid, port))
            else:
                sides.append(Side(name, *start_front(name, triton.http_url, stack)))
        for side in sides:  # warm-up: connections, pools, caches on every side
            run_wrk(f"http://127.0.0.1:{side.port}/v2/models/qc/infer", body, "", args.connections, 1, script, None)
        idle_cpu(sides, args.idle)
        for round_no in range(args.rounds):
            shift = round_no % len(sides)
            for side in sides[shift:] + sides[:shift]:
                result = measure(side, body, script, args.seconds, args.connections)
                side.runs.append(result)
                print(f"  round {round_no + 1} {side.name:<12} {result.cpu_us or 0:7.1f} us/req "
                      f"(user {result.user_us:6.1f}) {result.rps:7.0f} rps  p99 {result.p99_us / 1000:6.2f} ms  "
                      f"errors {result.errors}  load {side.load[-1]:4.2f} busy {side.busy[-1]:4.0%}", flush=True)
        counts = {side.name: syscalls(side, body, script, args) for side in sides} if args.syscalls else {}
        if args.profile is not None:
            for side in sides:
                if side.name != "nginx":
                    sample(side, body, script, args)
    summary(sides, args)
    if counts:
        print_syscalls(counts)
    return 0


def syscalls(side: Side, body: Path, script: Path, args: argparse.Namespace) -> dict[str, float]:
    """System calls per request of ``side``'s processes (and their threads) over one wrk run under strace -c."""
    pids = [str(pid) for pid in tree(side.pid)]
    tracer = subprocess.Popen(["strace", "-c", "-f", *[arg for pid in pids for arg in ("-p", pid)]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached
    result = run_wrk(f"http://127.0.0.1:{side.port}/v2/models/qc/infer", body, "", args.connections, args.seconds,
                     script, None)
    tracer.send_signal(signal.SIGINT)
    _, report = tracer.communicate(timeout=30)
    requests = result.rps * args.seconds
    counts: dict[str, float] = {}
    for line in report.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[3].isdigit() and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3]) / requests
    return counts


def print_syscalls(counts: dict[str, dict[str, float]]) -> None:
    print("\nsystem calls per request (strace -c over one more run of each side; strace slows the sides down, so "
          "fewer requests share each epoll_wait than in the rounds)")
    for name, calls in counts.items():
        top = sorted(calls.items(), key=lambda item: -item[1])
        shown = ", ".join(f"{call} {n:.2f}" for call, n in top if n >= 0.01)
        print(f"{name:<12} {sum(calls.values()):5.2f}: {shown}")


def sample(side: Side, body: Path, script: Path, args: argparse.Namespace) -> None:
    """py-spy over one run of ``side`` (its processes and subprocesses; idle samples left out)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args.profile.mkdir(parents=True, exist_ok=True)
    raw = args.profile / f"{side.name}.raw"
    seconds = int(args.seconds)
    recorder = subprocess.Popen([spy, "record", "--pid", str(side.pid), "--subprocesses", "--rate", "200",
                                 "--duration", str(seconds), "--format", "raw", "--output", str(raw)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_wrk(f"http://127.0.0.1:{side.port}/v2/models/qc/infer", body, "", args.connections, seconds, script, None)
    recorder.wait(seconds + 30)
    stacks = read_collapsed(raw)
    raw.unlink(missing_ok=True)
    (args.profile / f"{side.name}.collapsed").write_text("".join(f"{s} {n}\n" for s, n in stacks.items()))
    (args.profile / f"{side.name}.top.txt").write_text(top_table(stacks))
    print(f"  profiled {side.name}: {sum(stacks.values())} samples -> {args.profile / side.name}.top.txt", flush=True)


def idle_cpu(sides: list[Side], seconds: float) -> None:
    """Every side's CPU without traffic, over the same window: background work (timers, ticks)."""
    if seconds <= 0:
        return
    before = {side.name: side_seconds(side.pid)[1] for side in sides}
    time.sleep(seconds)
    for side in sides:
        side.idle_ms_per_s = (side_seconds(side.pid)[1] - before[side.name]) / seconds * 1000


def summary(sides: list[Side], args: argparse.Namespace) -> None:
    nginx_side = next((side for side in sides if side.name == "nginx"), None)
    print(f"\nCPU per request at HTTP c={args.connections}, summed over each side's processes; "
          f"{'bench/stub_triton.py' if args.stub else 'Triton (qc, Python backend)'} upstream; "
          f"median of {args.rounds} interleaved rounds of {args.seconds:g} s (min-max)")
    head = (f"{'side':<12} {'what':<44} | {'us/req':>6} {'min-max':>13} | {'x nginx':>7} {'min-max':>11} | "
            f"{'user':>5} | {'rps':>6} {'p99 ms':>6} | {'idle ms/s':>9} | errors")
    print(head)
    print("-" * len(head))
    for side in sides:
        cpu = [r.cpu_us or 0.0 for r in side.runs]
        ratio = "" if nginx_side is None else ratios(side, nginx_side)
        print(f"{side.name:<12} {LADDER[side.name]:<44} | {median(cpu):6.1f} {min(cpu):6.1f}-{max(cpu):<6.1f} | "
              f"{ratio} | {median([r.user_us for r in side.runs]):5.1f} | {median([r.rps for r in side.runs]):6.0f} "
              f"{median([r.p99_us for r in side.runs]) / 1000:6.2f} | {side.idle_ms_per_s:9.1f} | "
              f"{sum(r.errors for r in side.runs)}")
    loads = [load for side in sides for load in side.load]
    busy = [share for side in sides for share in side.busy]
    print(f"load average (1 min) at the end of the runs: min {min(loads):.2f} median {median(loads):.2f} "
          f"max {max(loads):.2f}; machine busy during the runs: median {median(busy):.0%} of {os.cpu_count()} cores")
    print("x nginx: the median of the same-round ratios to nginx; user: the us/req spent in user space; idle: "
          "each side's CPU without traffic (part of its us/req)")


def ratios(side: Side, yardstick: Side) -> str:
    same_round = [(a.cpu_us or 0.0) / (b.cpu_us or 1.0) for a, b in zip(side.runs, yardstick.runs)]
    return f"{median(same_round):6.2f}x {min(same_round):5.2f}-{max(same_round):<5.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
