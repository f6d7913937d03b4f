"""A/B: gateway CPU per inference request with one SRE console open and live, and without.

One Triton and one gateway (this work tree); rounds alternate between "console" (a client
that logs in to /console and then asks for the page's JSON every 2 s, as an open page does
while its tab is visible) and "no console", under the same HTTP load (JSON, wrk, c=32). The
gateway's CPU per request is read from /proc for the gateway process alone. Issue 25 asks for
the console's cost to stay within +2%.

    .venv/bin/python bench/console_ab.py                    # 4 rounds each (default)
    .venv/bin/python bench/console_ab.py --rounds 6 --page model
"""

from __future__ import annotations

import argparse
import http.cookiejar
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from overhead import LUA, POLICY, Result, bodies, cpu_seconds, run_wrk, wait_http  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402

TOKEN = "console-bench-token"
POLL_S = 2.0  # the page's own period (gateway/console/static/console.js POLL_MS)


class Console:
    """What one open console page asks of the gateway: a login, then its page's JSON every 2 s."""

    def __init__(self, base: str, page: str) -> None:
        self.base = base
        self.path = {"overview": "/console/api/overview", "model": "/console/api/models/qc"}[page]
        self.polls = 0
        self._stop = threading.Event()
        self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        login = urllib.request.Request(base + "/console/login", data=json.dumps({"token": TOKEN}).encode(),
                                       headers={"Content-Type": "application/json"}, method="POST")
        self._opener.open(login, timeout=10).close()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        with self._opener.open(self.base + self.path, timeout=10) as response:
            response.read()
        self.polls += 1

    def __enter__(self) -> Console:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved runs of each side (default 4)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of wrk load per run (default 8)")
    parser.add_argument("--page", choices=("overview", "model"), default="overview", help="the page left open")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("bench: wrk not found (run `make bench` once: it installs it)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gateway-console-ab-"))
    try:
        return run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path) -> int:
    script = workdir / "bench.lua"
    script.write_text(LUA)
    config = workdir / "gateway.yaml"
    config.write_text(POLICY)
    json_body, _ = bodies(workdir)["json"]
    faults = workdir / "faults.json"
    faults.write_text("{}")
    print("starting tritonserver and the gateway ...", flush=True)
    with LocalTriton.on_free_ports(faults_file=faults) as triton:
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), GATEWAY_PORT=str(port), GATEWAY_GRPC_PORT=str(free_port()),
                   GATEWAY_TRITON_URL=triton.http_url, GATEWAY_TRITON_GRPC_URL=triton.grpc_url,
                   GATEWAY_LOG_LEVEL="warning", GATEWAY_STORE_URL="memory://", GATEWAY_ADMIN_TOKEN=TOKEN)
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], cwd=ROOT,
                                   env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_http(base + "/readyz")
            url = base + "/v2/models/qc/infer"
            run_wrk(url, json_body, "", 32, 1.0, script, gateway.pid)  # warm-up
            table: dict[str, list[Result]] = {"console": [], "no console": []}
            polls = 0
            for round_no in range(args.rounds):
                order = ("console", "no console") if round_no % 2 == 0 else ("no console", "console")
                for side in order:
                    if side == "console":
                        with Console(base, args.page) as console:
                            result = run_wrk(url, json_body, "", 32, args.seconds, script, gateway.pid)
                        polls += console.polls
                    else:
                        result = run_wrk(url, json_body, "", 32, args.seconds, script, gateway.pid)
                    table[side].append(result)
                    print(f"  round {round_no + 1} {side:<10}: {result.cpu_us or 0:7.1f} us/req {result.rps:8.0f} rps "
                          f"p99 {result.p99_us / 1000:6.2f} ms errors {result.errors}", flush=True)
            poll_cpu = poll_cost(base, args.page, gateway.pid)
        finally:
            gateway.terminate()
            gateway.wait(10)
    on, off = (sum(r.cpu_us or 0.0 for r in table[s]) / len(table[s]) for s in ("console", "no console"))
    rps = sum(r.rps for r in table["no console"]) / len(table["no console"])
    print(f"\nmean gateway CPU per request, HTTP JSON c=32: console open ({args.page}, {polls} polls) {on:.1f} us, "
          f"none {off:.1f} us: {on / off - 1:+.2%} (as measured; on a shared machine the rounds' spread is larger)")
    implied = poll_cpu / POLL_S / (rps * off * 1e-6)
    print(f"one poll of the {args.page} page costs the gateway {poll_cpu * 1e3:.2f} ms of CPU (mean of {POLLS} polls, "
          f"idle): one open console adds {poll_cpu / POLL_S * 1e3:.2f} ms of CPU per second, {implied:+.2%} of the "
          f"CPU the gateway spends at {rps:.0f} req/s")
    return 0


POLLS = 50


def poll_cost(base: str, page: str, pid: int) -> float:
    """The gateway's CPU seconds per poll of the page, the gateway otherwise idle (the stable measure:
    the A/B rounds' noise on a busy 2-core machine is far larger than the console's share)."""
    console = Console(base, page)
    console.poll()  # warm
    before = cpu_seconds(pid)
    for _ in range(POLLS):
        console.poll()
    return (cpu_seconds(pid) - before) / POLLS


if __name__ == "__main__":
    raise SystemExit(main())
