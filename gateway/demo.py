"""``gateway demo``: a local Triton, the gateway in front of it, and real traffic.

Starts tritonserver from the wheel with the sample repository, starts ``gateway serve``
with an 80/20 policy on model ``qc``, sends anonymous and sticky requests, and prints the
observed split, stickiness and per-version latency. Everything it started is stopped at
the end unless ``--keep-running``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gateway.local_triton import LocalTriton, free_port
from gateway.upstream import HttpUpstream

BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode()
POLICY_YAML = 'policies:\n  qc:\n    weights: {"2": 80, "3": 20}\n    sticky_header: x-user-id\n'


class Traffic:
    """Counts what the clients saw: version per request, per user, and latencies."""

    def __init__(self) -> None:
        self.versions: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.users: dict[str, set[str]] = defaultdict(set)

    def add(self, status: int, version: str | None, latency: float, user: str | None) -> None:
        self.statuses[status] += 1
        if version:
            self.versions[version] += 1
            self.latencies[version].append(latency)
            if user:
                self.users[user].add(version)


async def send_traffic(url: str, requests: int, progress: Progress, concurrency: int = 8) -> Traffic:
    client = HttpUpstream(url, max_connections=concurrency, request_timeout_s=10)
    traffic = Traffic()
    task = progress.add_task("sending requests", total=requests)
    numbers = iter(range(requests))

    async def worker() -> None:
        for n in numbers:
            user = f"user-{n % 50}" if n % 3 == 0 else None  # a third of the traffic is signed in
            headers = [(b"x-user-id", user.encode())] if user else []
            started = time.perf_counter()
            try:
                response = await client.request(b"POST", b"/v2/models/qc/infer", headers, BODY)
                payload = await response.read()
                version = json.loads(payload).get("model_version") if response.status == 200 else None
                traffic.add(response.status, version, time.perf_counter() - started, user)
            except Exception:  # the demo reports failures instead of stopping
                traffic.add(0, None, 0.0, user)
            progress.advance(task)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return traffic


def report(console: Console, traffic: Traffic) -> None:
    table = Table(title="What the clients saw (policy qc: 2=80%, 3=20%)")
    for column in ("version", "requests", "share", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    total = sum(traffic.versions.values())
    for version in sorted(traffic.versions):
        lat = sorted(traffic.latencies[version])
        table.add_row(version, str(traffic.versions[version]), f"{traffic.versions[version] / total:.1%}",
                      f"{lat[len(lat) // 2] * 1000:.2f}", f"{lat[int(len(lat) * 0.99)] * 1000:.2f}")
    console.print(table)
    sticky = sum(1 for versions in traffic.users.values() if len(versions) == 1)
    console.print(f"stickiness: {sticky} of {len(traffic.users)} signed-in users always got the same version")
    failed = sum(count for status, count in traffic.statuses.items() if status != 200)
    console.print(f"failed requests: {failed} of {sum(traffic.statuses.values())}")


def start_gateway(triton: LocalTriton, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    config = workdir / "gateway.yaml"
    config.write_text(POLICY_YAML)
    port = free_port()
    env = dict(os.environ, GATEWAY_PORT=str(port), GATEWAY_TRITON_URL=triton.http_url, GATEWAY_LOG_LEVEL="warning")
    process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the gateway did not become ready")


def run_demo(requests: int = 3000, keep_running: bool = False) -> int:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-demo-"))
    console.print("[bold]starting a local Triton[/] (nvidia-pytriton wheel, sample model repository) ...")
    triton = LocalTriton.on_free_ports().start()
    gateway = None
    try:
        gateway, url = start_gateway(triton, workdir)
        console.print(f"Triton at {triton.http_url}, gateway at {url}")
        with Progress(console=console) as progress:
            traffic = asyncio.run(send_traffic(url, requests, progress))
        report(console, traffic)
        if keep_running:
            console.print(f"[bold]keeping the stack up[/]: gateway {url}, Triton {triton.http_url}. Ctrl-C stops it.")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0 if traffic.statuses.get(200) == requests else 1
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        triton.stop()
