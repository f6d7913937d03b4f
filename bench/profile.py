"""Where the gateway's CPU goes per request: py-spy profiles of the HTTP and gRPC data paths.

Starts ``bench/stub_triton.py`` (a fixed answer, no inference: every sample is the gateway's own
work) and one gateway in front of it, warms both ports up, then for each protocol samples the
gateway with py-spy while wrk (JSON infer, c=32) or h2load (ModelInfer, c=32) loads it. Writes,
per protocol, under ``--out`` (default ``bench/profiles/``):

- ``<name>.collapsed``: folded stacks (``frame;frame;frame count``), the input of any flame graph
  tool (Brendan Gregg's flamegraph.pl, speedscope, inferno);
- ``<name>.svg``: a flame graph of them, drawn here (open it in a browser);
- ``<name>.top.txt``: the functions with the most samples on top of the stack (self) and
  anywhere in it (inclusive), in percent of all samples.

    .venv/bin/pip install py-spy          # once
    .venv/bin/python bench/profile.py --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from overhead import LUA, POLICY, Result, bodies, grpc_body, run_h2load, run_wrk, wait_http  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds sampled per protocol (default 10)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    parser.add_argument("--out", type=Path, default=HERE / "profiles", help="where the profiles go")
    parser.add_argument("--only", choices=("all", "http", "grpc"), default="all")
    parser.add_argument("--label", default="", help="prefix of the output files (e.g. before-, after-)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32; 1: one request "
                        "at a time, where per-request work shows whole)")
    parser.add_argument("--triton", action="store_true",
                        help="in front of a real Triton (the sample repository) instead of the stub: the request "
                             "rate Triton allows, as in bench/overhead.py's nginx rows")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("bench: py-spy not found (.venv/bin/pip install py-spy)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-profile-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with contextlib.ExitStack() as stack:
            if args.triton:
                faults = workdir / "faults.json"
                faults.write_text("{}")
                triton = stack.enter_context(LocalTriton.on_free_ports(faults_file=faults))
                upstream = triton.http_url, triton.grpc_url
            else:
                http_port, grpc_port = free_port(), free_port()
                processes.append(subprocess.Popen([sys.executable, str(HERE / "stub_triton.py"), "--http-port",
                                                   str(http_port), "--grpc-port", str(grpc_port)],
                                                  stdout=subprocess.DEVNULL))
                wait_http(f"http://127.0.0.1:{http_port}/v2/health/ready")
                upstream = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
            profile(args, spy, workdir, upstream, processes)
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def profile(args: argparse.Namespace, spy: str, workdir: Path, upstream: tuple[str, str],
            processes: list[subprocess.Popen[bytes]]) -> None:
    (workdir / "gateway.yaml").write_text(POLICY)
    port, gport = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), GATEWAY_PORT=str(port), GATEWAY_GRPC_PORT=str(gport),
               GATEWAY_TRITON_URL=upstream[0], GATEWAY_TRITON_GRPC_URL=upstream[1], GATEWAY_LOG_LEVEL="warning",
               GATEWAY_STORE_URL="memory://")
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(workdir / "gateway.yaml")]
    gateway = subprocess.Popen(command, cwd=ROOT, env=env)
    processes.append(gateway)
    wait_http(f"http://127.0.0.1:{port}/readyz")
    script = workdir / "bench.lua"
    script.write_text(LUA)
    json_body, _ = bodies(workdir)["json"]
    grpc = grpc_body(workdir)
    url = f"http://127.0.0.1:{port}/v2/models/qc/infer"
    loads: dict[str, Callable[[float, int | None], Result]] = {
        "http": lambda seconds, pid: run_wrk(url, json_body, "", args.concurrency, seconds, script, pid),
        "grpc": lambda seconds, pid: run_h2load(f"127.0.0.1:{gport}", grpc, args.concurrency,
                                                int(seconds * (3000 if args.concurrency > 1 else 800)), workdir, pid),
    }
    for name, load in loads.items():
        if args.only not in ("all", name):
            continue
        load(1.0, None)  # warm-up
        raw = workdir / f"{name}.raw"
        recorder = subprocess.Popen([spy, "record", "--pid", str(gateway.pid), "--rate", str(args.rate),
                                     "--duration", str(int(args.seconds)), "--format", "raw", "--output", str(raw)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = load(args.seconds, gateway.pid)
        recorder.wait(args.seconds + 30)
        stacks = read_collapsed(raw)
        stem = args.out / f"{args.label}{name}"
        (stem.with_suffix(".collapsed")).write_text("".join(f"{s} {n}\n" for s, n in stacks.items()))
        (stem.with_suffix(".svg")).write_text(flame_svg(stacks, f"gateway {name} c={args.concurrency} "
                                                                 f"({result.cpu_us or 0:.0f} "
                                                                 f"us CPU/request, {result.rps:.0f} rps)"))
        top = top_table(stacks)
        (stem.with_suffix(".top.txt")).write_text(top)
        print(f"{name}: {result.cpu_us or 0:.1f} us CPU/request (sampled, so slower), {result.rps:.0f} rps, "
              f"{sum(stacks.values())} samples -> {stem}.svg / .collapsed / .top.txt")
        print("\n".join(top.splitlines()[:28]))


def read_collapsed(raw: Path) -> Counter[str]:
    """py-spy's raw output, with idle samples (the event loop waiting in epoll) left out."""
    stacks: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or "select (selectors.py" in stack or stack.endswith("run_forever (asyncio/base_events.py:607)"):
            continue
        frames = [short(frame) for frame in stack.split(";")]
        stacks[";".join(frames)] += int(count)
    return stacks


def short(frame: str) -> str:
    """``handle (gateway/x.py:12)`` -> ``handle (gateway/x.py)``: lines split one function into many."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("/site-packages/", "/lib/python3.11/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})" if where else name


def top_table(stacks: Counter[str], rows: int = 40) -> str:
    total = sum(stacks.values()) or 1
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples (idle excluded)", "", "self %   function"]
    lines += [f"{100 * n / total:6.1f}   {frame}" for frame, n in own.most_common(rows)]
    lines += ["", "incl %   function"]
    lines += [f"{100 * n / total:6.1f}   {frame}" for frame, n in inclusive.most_common(rows)]
    return "\n".join(lines) + "\n"


def flame_svg(stacks: Counter[str], title: str, width: int = 1600, row: int = 17) -> str:
    """A plain flame graph: the root at the bottom, each frame as wide as its samples."""
    tree: dict[str, object] = {}
    for stack, count in stacks.items():
        node = tree
        for frame in stack.split(";"):
            child = node.setdefault(frame, {"#": 0})
            assert isinstance(child, dict)
            child["#"] += count
            node = child
    total = sum(stacks.values()) or 1
    depth = max((stack.count(";") + 1 for stack in stacks), default=1)
    height = (depth + 2) * row
    boxes: list[str] = []

    def draw(node: dict[str, object], x: float, level: int) -> None:
        for frame, child in sorted((k, v) for k, v in node.items() if k != "#"):
            assert isinstance(child, dict)
            w = width * child["#"] / total
            if w >= 0.5:
                y = height - (level + 2) * row
                hue = 20 + (hash(frame.split(" (")[-1]) % 40)
                label = html.escape(frame)
                text = label[: int(w / 7)] if w > 21 else ""
                boxes.append(f'<g><title>{label} ({100 * child["#"] / total:.1f}%)</title>'
                             f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                             f'fill="hsl({hue},85%,60%)"/><text x="{x + 3:.1f}" y="{y + row - 5}">{text}</text></g>')
                draw(child, x, level + 1)
            x += w

    draw(tree, 0.0, 0)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
            f'font-size="11"><text x="4" y="14">{html.escape(title)}</text>{"".join(boxes)}</svg>\n')


if __name__ == "__main__":
    raise SystemExit(main())
