"""``gateway demo``: the whole canary story against a real local Triton, in about two minutes.

1. starts tritonserver (sample repository) and ``gateway serve`` with qc at 100 % version 2;
2. drives steady traffic over HTTP and gRPC (a third of it from signed-in users), paced;
3. breaks version 3 (30 % of its requests fail) and starts a rollout to it, judged by the
   default (statistical) judge against a same-size baseline (version 1, the stable's code):
   the gateway judges each interval and rolls back on its own;
4. repairs version 3 and starts a new rollout: it walks every step and is promoted;
5. prints what happened and the evidence each decision rested on;
6. the second story (``demo_ensemble``): a canary of qc v3 inside the ensemble ``pipe``, through
   a variant the gateway loads on both Tritons and, once promoted, pins into ``pipe`` itself;
   then stops everything it started, and exits 0 when every rollout ended as it should.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from gateway.ctl.views import rollout_view
from gateway.devtools.demo_ensemble import ensemble_story
from gateway.devtools.local_triton import SAMPLE_MODELS, TARGET_MODELS, LocalTriton, free_port
from gateway.upstream import HttpUpstream

BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode()
TOKEN = "demo-admin-token"
# The default judge (statistical) with every default but the interval, against a same-size baseline:
# version 1 is the stable's code, so the canary is compared at its own share (README, "A same-size
# baseline"). At RATE the error rates need ~300 requests of each at the 10% step and latency is
# not judged in the first 30 s (latency_warmup_s): the healthy rollout takes about a minute.
ROLLOUT = {"canary": "3", "baseline": "1", "steps": [10, 25, 50, 100], "interval_s": 3}
RATE = 150.0  # req/s over all clients: steady, and leaves CPU for Triton and the gateway on 2 cores
ROLLOUT_TIMEOUT_S = 180.0


class Traffic:
    """Steady clients in a background thread; counts what they saw, per phase."""

    def __init__(self, url: str, grpc_url: str, concurrency: int = 4, grpc_concurrency: int = 2,
                 rate: float = RATE) -> None:
        self.url = url
        self.grpc_url = grpc_url
        self.concurrency = concurrency
        self.grpc_concurrency = grpc_concurrency
        self.period = (concurrency + grpc_concurrency) / rate  # seconds between one worker's requests
        self.grpc_answered: Counter[str] = Counter()  # per phase
        self.phase = "warm-up"
        self.versions: dict[str, Counter[str]] = defaultdict(Counter)
        self.failures: dict[str, Counter[str]] = defaultdict(Counter)
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.users: dict[str, set[str]] = defaultdict(set)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        client = HttpUpstream(self.url, max_connections=self.concurrency, request_timeout_s=10)
        count = iter(range(10**9))

        async def worker() -> None:
            pace = self._pace()
            while not self._stop.is_set():
                await pace()
                n = next(count)
                user = f"user-{n % 60}" if n % 3 == 0 else None
                headers = [(b"x-user-id", user.encode())] if user else []
                phase, started = self.phase, time.perf_counter()
                try:
                    response = await client.request(b"POST", b"/v2/models/qc/infer", headers, BODY)
                    payload = await response.read()
                except Exception:  # reported as a failure, the demo goes on
                    self.failures[phase]["gateway unreachable"] += 1
                    continue
                if response.status != 200:
                    version = dict(response.headers).get(b"x-gateway-model-version", b"?").decode()
                    self.failures[phase][f"{response.status} from version {version}"] += 1
                    continue
                version = json.loads(payload)["model_version"]
                self.versions[phase][version] += 1
                self.latencies[version].append(time.perf_counter() - started)
                if user and phase == "warm-up":
                    self.users[user].add(version)

        await asyncio.gather(*(worker() for _ in range(self.concurrency)),
                             *(self._grpc_worker(count) for _ in range(self.grpc_concurrency)))
        await client.aclose()

    def _pace(self) -> Callable[[], Awaitable[None]]:
        """One worker's schedule: a request every ``period`` (a late answer is caught up on, never
        by sending more than the rate), so the traffic is the same whatever the machine's load."""
        due = time.monotonic()

        async def pace() -> None:
            nonlocal due
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            due += self.period
        return pace

    async def _grpc_worker(self, count: Any) -> None:
        """The same requests through tritonclient's gRPC client (a new client per worker)."""
        import numpy as np
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.grpc import InferInput
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(self.grpc_url)
        tensor = InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.array([[1, 2, 3, 4]], dtype=np.float32))
        pace = self._pace()
        while not self._stop.is_set():
            await pace()
            n = next(count)
            user = f"user-{n % 60}" if n % 3 == 0 else None
            phase = self.phase
            try:
                result = await client.infer("qc", [tensor], headers={"x-user-id": user} if user else None,
                                            client_timeout=10)
            except InferenceServerException as exc:
                self.failures[phase][f"gRPC {str(exc.status()).removeprefix('StatusCode.')}"] += 1
                continue
            version = result.get_response().model_version
            self.versions[phase][version] += 1
            self.grpc_answered[phase] += 1
            if user and phase == "warm-up":
                self.users[user].add(version)
        await client.close()


def admin(url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, method=method, data=data,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def start_gateway(triton: LocalTriton, workdir: Path,
                  fleet: list[LocalTriton] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, GATEWAY_PORT=str(port), GATEWAY_TRITON_URL=triton.http_url, GATEWAY_LOG_LEVEL="warning",
               GATEWAY_ADMIN_TOKEN=TOKEN, GATEWAY_STORE_URL=f"sqlite:///{workdir}/state.db",
               GATEWAY_CONTROLLER_TICK_S="0.5", GATEWAY_GRPC_PORT=str(grpc_port),
               GATEWAY_TRITON_GRPC_URL=triton.grpc_url,
               # the gateway reads config.pbtxt itself, so a version load sends no stale config override
               GATEWAY_MODEL_REPOSITORY=str(triton.repository))
    if fleet:  # every request balanced across these servers (the fleet 'default')
        servers = [{"http": server.http_url, "grpc": server.grpc_url} for server in fleet]
        env["GATEWAY_FLEETS"] = json.dumps({"default": {"servers": servers}})
    config = workdir / "gateway.yaml"
    config.write_text('policies:\n  qc: {weights: {"2": 100}, sticky_header: x-user-id}\n')
    process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1):
                return process, url, f"127.0.0.1:{grpc_port}"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the gateway did not become ready")


def watch_rollout(console: Console, url: str, timeout_s: float = ROLLOUT_TIMEOUT_S) -> dict[str, Any]:
    doc = admin(url, "GET", "/admin/models/qc/rollout")
    deadline = time.monotonic() + timeout_s
    with Live(rollout_view(doc), console=console, refresh_per_second=4) as live:
        while doc["state"] in ("progressing", "paused", "rolling_back") and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = admin(url, "GET", "/admin/models/qc/rollout")
            live.update(rollout_view(doc))
    console.print()
    return doc


def set_faults(path: Path, spec: dict[str, Any]) -> None:
    path.write_text(json.dumps(spec))
    time.sleep(0.3)  # the sample model re-reads the file at most every 100 ms


def summary(console: Console, traffic: Traffic, outcomes: list[tuple[str, dict[str, Any]]], url: str) -> None:
    table = Table(title="what the clients saw, by phase")
    for column in ("phase", "version 2", "version 1 (baseline)", "version 3", "via gRPC", "failed", "failures"):
        table.add_column(column, justify="right")
    for phase in ("warm-up", "faulty canary", "healthy canary", "after promotion"):
        failed = sum(traffic.failures[phase].values())
        table.add_row(phase, *(str(traffic.versions[phase][version]) for version in ("2", "1", "3")),
                      str(traffic.grpc_answered[phase]), str(failed),
                      ", ".join(f"{n}x {what}" for what, n in traffic.failures[phase].most_common(2)))
    console.print(table)
    for title, doc in outcomes:
        console.print(f"[bold]{title}[/]: {doc['state']} - {doc['reason']}")
        console.print(f"  requests judged on the canary during it: {doc['canary_requests']}")
        console.print(evidence(doc))
    sticky = sum(1 for versions in traffic.users.values() if len(versions) == 1)
    console.print(f"stickiness during warm-up: {sticky} of {len(traffic.users)} signed-in users kept one version")
    events = admin(url, "GET", "/admin/events?model=qc&limit=50")["events"]
    console.print("audit trail (oldest first):")
    for event in reversed(events):
        if event["action"].startswith("rollout_") and event["action"] != "rollout_weights":
            console.print(f"  {event['actor']:<18} {event['action']:<20} {event['reason']}")


def deciding_verdict(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict the rollout's end rested on: its last unhealthy one when rolled back, else its last."""
    wanted = "unhealthy" if doc["state"] == "rolled_back" else "healthy"
    chosen = [v for v in doc["verdicts"] if v["outcome"] == wanted] or doc["verdicts"]
    return chosen[-1] if chosen else None


def evidence(doc: dict[str, Any]) -> Table:
    """Per metric of the deciding verdict: the effect against the reference with its 95% interval,
    the evidence (e-value) against the one its share of the alpha budget needs, and the clients
    counted (each metric's one-line summary is in the rollout's reason and the live view)."""
    verdict = deciding_verdict(doc)
    reference = f"baseline {doc['baseline']}" if doc.get("baseline") else f"stable {doc['stable']}"
    spec = doc["spec"]
    if verdict is None:
        return Table(title=f"no verdict: the rollout against {reference} ended before its first interval")
    alpha = verdict.get("alpha") or {}
    clients = verdict.get("clients") or {}
    sides = {"canary": f"canary {doc['canary']}", "stable": reference}  # "stable": the reference, either
    counted = "; ".join(f"{sides.get(side, side)}: {c['counted']} of {c['requests']} requests from {c['clients']} "
                        "client(s)" for side, c in clients.items() if c)
    table = Table(title=f"the evidence it decided on: its last {verdict['outcome']} verdict, judge {spec['judge']}, "
                        f"canary {doc['canary']} vs {reference}, over the whole rollout",
                  caption=f"false_rollback_rate {alpha.get('false_rollback_rate')} split over "
                          f"{len(alpha.get('tests', []))} tests: {alpha.get('per_test', 0):.4f} each"
                          + (f"; counted (per client, capped): {counted}" if counted else ""),
                  title_justify="left", caption_justify="left")
    table.add_column("metric", no_wrap=True)  # whole names; the numbers wrap instead
    for column in ("verdict", "effect (95% interval)", "floor", "e-value (needed)"):
        table.add_column(column, justify="right")
    for metric in verdict.get("metrics", []):
        ratio = metric["name"] in ("latency", "time_to_first_response", "response_gap")
        digits = 1 if ratio else 2
        interval = "" if metric["low"] is None else \
            f" ({_signed(metric['low'], digits)} .. {_signed(metric['high'], digits)})"
        effect = metric["effect"]
        if metric["name"] == "error_ceiling":  # the canary's own rate, not a difference
            effect_text = "-" if effect is None else f"{effect:.2%}"
            floor_text = f"max {metric['floor']:.0%}"
        else:
            effect_text = _signed(effect, digits)
            floor_text = f"+{metric['floor']:.0%}"
        table.add_row(metric["name"], metric["verdict"], effect_text + interval, floor_text,
                      f"{_times(metric['e_value'])} ({_times(metric['e_threshold'])})")
    return table


def _signed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:+.{digits}%}"


def _times(value: float) -> str:
    return f"{value:.3g}" if value < 1e6 else f"{value:.1e}"


def split(console: Console, url: str) -> None:
    """How the gateway spread the requests over the fleet's servers (``gateway ctl fleets``)."""
    table = Table(title="per-server split (fleet default, balanced per request)")
    for column in ("server", "requests", "share", "errors", "ejections", "READY versions of qc"):
        table.add_column(column, justify="right")
    servers = admin(url, "GET", "/admin/fleets")["fleets"]["default"]
    total = sum(server["requests"] for server in servers) or 1
    for server in servers:
        table.add_row(server["server"], str(server["requests"]), f"{100 * server['requests'] / total:.1f}%",
                      str(server["errors"]), str(server["ejections"]), ",".join(server["ready"].get("qc", [])))
    console.print(table)


def run_demo(keep_running: bool = False) -> int:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-demo-"))
    faults = workdir / "faults.json"
    faults.write_text("{}")
    console.print("[bold]1. starting two local Tritons[/] (nvidia-pytriton wheel, sample model repository), "
                  "one fleet ...")
    models = SAMPLE_MODELS + TARGET_MODELS  # the ensemble pipe and qc_2026_12 too (the second story)
    triton = LocalTriton.on_free_ports(faults_file=faults, models=models).start()
    second: LocalTriton | None = None
    gateway: subprocess.Popen[bytes] | None = None
    traffic: Traffic | None = None
    try:
        second = LocalTriton.on_free_ports(faults_file=faults, models=models).start()
        gateway, url, grpc_url = start_gateway(triton, workdir, [triton, second])
        console.print(f"   Tritons {triton.http_url} and {second.http_url}, gateway {url} (gRPC {grpc_url}); "
                      "policy qc: 100% version 2")
        traffic = Traffic(url, grpc_url)
        traffic.start()
        time.sleep(3)
        console.print("[bold]2. version 3 is broken[/] (30% of its requests fail); starting a rollout to it")
        set_faults(faults, {"qc": {"3": {"error_rate": 0.3}}})
        traffic.phase = "faulty canary"
        admin(url, "POST", "/admin/models/qc/rollout", ROLLOUT)
        first = watch_rollout(console, url)
        console.print("[bold]3. version 3 repaired[/]; starting a new rollout (\"retry\": true: a rolled-back "
                      "version is not rolled out again by accident)")
        set_faults(faults, {})
        traffic.phase = "healthy canary"
        admin(url, "POST", "/admin/models/qc/rollout", {**ROLLOUT, "retry": True})
        healthy = watch_rollout(console, url)
        traffic.phase = "after promotion"
        time.sleep(2)
        traffic.stop()
        summary(console, traffic, [("faulty canary", first), ("healthy canary", healthy)], url)
        split(console, url)
        ok = first["state"] == "rolled_back" and healthy["state"] == "promoted"
        console.print("[bold green]the gateway rolled back the bad version and promoted the good one[/]" if ok
                      else "[bold red]unexpected outcome[/]")
        console.print("[bold]4. a canary inside an ensemble[/]: qc version 3 inside pipe (pre -> qc 2 -> post), "
                      "through the variant pipe__qc_3 the gateway loads on both Tritons")
        inside = ensemble_story(console, url, admin)
        console.print("[bold green]promoted into pipe itself, no request mixing the arms[/]" if inside
                      else "[bold red]unexpected outcome inside the ensemble[/]")
        ok = ok and inside
        if keep_running:
            console.print(f"[bold]keeping the stack up[/]: gateway {url} (admin token {TOKEN}), Triton "
                          f"{triton.http_url}. Ctrl-C stops it.")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0 if ok else 1
    finally:
        if traffic is not None:
            traffic.stop()
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        if second is not None:
            second.stop()
        triton.stop()
