"""A rolling update of a 2-replica gateway Deployment under load, as Kubernetes runs it with
deploy/k8s/gateway.yaml's settings, without Kubernetes: zero failed requests.

What is simulated, and how:

- **the pods**: each replica is a real ``gateway serve --workers 2`` (supervisor + 2 workers +
  spare) against the real Triton, on its own loopback ports, with its own SQLite store (the
  policies are declared in the environment, the same for every replica; routing state shared
  through Redis is not what this test is about);
- **the Service and kube-proxy**: :class:`KubeProxy`, a TCP balancer in the test process that
  gives each new connection to the next ready endpoint (round-robin; kube-proxy's iptables
  mode picks at random, IPVS round-robin) and pipes bytes both ways. Removing an endpoint
  only stops *new* connections; established ones go on, as conntrack keeps them. A connection
  it cannot open to the endpoint it chose is closed at once: the client sees the reset it
  would see from a DNAT to a closed port;
- **the rollout**: ``strategy: RollingUpdate, maxSurge: 1, maxUnavailable: 0`` over 2
  replicas: a new replica starts; once its readiness probe passes it joins the endpoints
  and an old replica starts terminating, while the next new one starts; then the same for
  the second old one;
- **termination**: the pod leaves the endpoints the moment it is terminating, but kube-proxy
  applies that only ``PROPAGATION_S`` later (the endpoint controller and every node's
  kube-proxy take time); meanwhile the kubelet runs the manifest's ``preStop`` (sleep), then
  sends SIGTERM, then SIGKILL at ``terminationGracePeriodSeconds``. Both numbers come from
  deploy/k8s/gateway.yaml; the test fails if the gateway is SIGKILLed or exits non-zero;
- **readiness**: ``GET /readyz`` (the manifest probes gRPC health, which gives the same
  answer) every ``PROBE_S`` instead of the manifest's 5 s, to keep the test short: the period
  only delays when a new pod takes traffic, never whether a request fails;
- **the clients**: HTTP requests each on a new connection (many short-lived clients), HTTP
  keep-alive clients reusing one connection (pooled clients such as tritonclient.http), and
  gRPC calls on long-lived HTTP/2 connections (our own client, which opens a new connection
  when the gateway's GOAWAY ends one); Triton delays every answer by 100 ms, so requests are
  in flight at every SIGTERM.

Not simulated: the kubelet's process tree handling inside a container (the test signals the
supervisor, as the kubelet signals PID 1), network latency, iptables' random choice, several
nodes' kube-proxies seeing the change at different moments (one PROPAGATION_S for all), and
a shared store.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gateway.devtools.local_triton import LocalTriton, dies_with_parent, free_port
from tests.conftest import Faults
from tests.integration.test_workers import Supervised, workers_env
from tests.steady_load import KINDS, SteadyLoad

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]
PROPAGATION_S = 1.0  # how long after a pod starts terminating kube-proxy stops sending it new connections
PROBE_S = 0.25
INFER = "/inference.GRPCInferenceService/ModelInfer"


def manifest() -> tuple[float, float]:
    """(preStop sleep, terminationGracePeriodSeconds) of the gateway Deployment."""
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "gateway.yaml").read_text()):
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "triton-gateway":
            pod = doc["spec"]["template"]["spec"]
            command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep", command
            return float(command[1]), float(pod["terminationGracePeriodSeconds"])
    raise AssertionError("no triton-gateway Deployment")


class KubeProxy:
    """A Service's virtual address: new connections round-robin over the ready endpoints."""

    def __init__(self) -> None:
        self.endpoints: list[tuple[int, int]] = []  # (HTTP port, gRPC port) of each ready pod
        self.opened: Counter[int] = Counter()  # connections handed to each HTTP port
        self.unreachable: list[str] = []
        self._next = 0
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self.http_port, self.grpc_port = free_port(), free_port()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> KubeProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _listen(self) -> None:
        self._servers = [await asyncio.start_server(self._connect_http, "127.0.0.1", self.http_port),
                         await asyncio.start_server(self._connect_grpc, "127.0.0.1", self.grpc_port)]

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for writer in self._writers:
            writer.transport.abort()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connect_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._connect(reader, writer, 0)

    async def _connect_grpc(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._connect(reader, writer, 1)

    def set(self, endpoints: list[tuple[int, int]]) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "endpoints", list(endpoints))

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, which: int) -> None:
        self._writers.add(writer)
        try:
            await self._forward(reader, writer, which)
        finally:
            writer.close()  # both directions have ended (a failure aborted them already)
            self._writers.discard(writer)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, which: int) -> None:
        if not self.endpoints:
            writer.transport.abort()
            self.unreachable.append("no endpoint")
            return
        endpoint = self.endpoints[self._next % len(self.endpoints)]
        self._next += 1
        self.opened[endpoint[0]] += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", endpoint[which])
        except OSError as exc:
            self.unreachable.append(f"{endpoint}: {exc!r}")
            writer.transport.abort()
            return
        self._writers.add(upstream_writer)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            upstream_writer.close()
            self._writers.discard(upstream_writer)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close passes through, as it does through NAT
    except (ConnectionError, OSError):
        writer.transport.abort()  # a reset passes through too


class Pod:
    """One replica: ``gateway serve --workers 2``, started without waiting."""

    def __init__(self, triton: LocalTriton, tmp_path: Path, name: str) -> None:
        (tmp_path / name).mkdir()
        self.name = name
        self.gateway = Supervised(workers_env(triton, tmp_path / name, 2))
        self.gateway.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=self.gateway.env,
                                                preexec_fn=dies_with_parent())
        self.endpoint = (self.gateway.port, self.gateway.grpc_port)
        self.exit: tuple[str, int | None] | None = None  # how it ended: drained, or killed at the grace period

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway.url}/readyz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while not self.ready():
            assert self.gateway.process.poll() is None, f"{self.name} exited"
            assert time.monotonic() < deadline, f"{self.name} never became ready"
            time.sleep(PROBE_S)

    def terminate(self, kube: KubeProxy, pods: list[Pod], pre_stop_s: float, grace_s: float) -> None:
        """The kubelet and the endpoint controller on a pod being deleted (run in a thread)."""
        started = time.monotonic()
        pods.remove(self)  # terminating: out of the endpoints ...
        threading.Timer(PROPAGATION_S, lambda: kube.set([pod.endpoint for pod in pods])).start()  # ... later
        time.sleep(pre_stop_s)
        self.gateway.process.send_signal(signal.SIGTERM)
        try:
            code = self.gateway.process.wait(max(0.0, grace_s - (time.monotonic() - started)))
            self.exit = ("drained", code)
        except subprocess.TimeoutExpired:
            self.gateway.kill()
            self.exit = ("SIGKILL at the grace period", None)


def test_a_rolling_update_of_two_replicas_with_two_workers_each_fails_no_request(
        triton: LocalTriton, tmp_path: Path, faults: Faults) -> None:
    """Over 30 s: two replicas of two worker processes each are started, and each is replaced in turn under
    load."""
    pre_stop_s, grace_s = manifest()
    assert PROPAGATION_S < pre_stop_s < grace_s
    faults.set("qc", "2", delay_ms=100)
    old = [Pod(triton, tmp_path, "a"), Pod(triton, tmp_path, "b")]
    new: list[Pod] = []
    try:
        for pod in old:
            pod.wait_ready()
        serving = list(old)  # the pods in the Service's endpoints
        with KubeProxy() as kube:
            kube.set([pod.endpoint for pod in serving])
            with SteadyLoad(f"http://127.0.0.1:{kube.http_port}", kube.grpc_port) as load:
                time.sleep(2.0)
                new.append(Pod(triton, tmp_path, "c"))  # maxSurge 1
                terminating: list[threading.Thread] = []
                for index, victim in enumerate(old):
                    new[index].wait_ready()
                    serving.append(new[index])
                    kube.set([pod.endpoint for pod in serving])
                    thread = threading.Thread(target=victim.terminate, args=(kube, serving, pre_stop_s, grace_s))
                    thread.start()
                    terminating.append(thread)
                    if index == 0:
                        new.append(Pod(triton, tmp_path, "d"))  # the terminating pod no longer counts
                for thread in terminating:
                    thread.join(grace_s + 10)
                during = sum(load.ok.values())
                time.sleep(1.0)
            opened_after = dict(kube.opened)
        print(f"answered: {dict(load.ok)}; connections per pod: {opened_after}; "
              f"exits: {[(pod.name, pod.exit) for pod in old]}")
        assert not load.failures, (len(load.failures), load.failures[:5])
        assert not kube.unreachable, kube.unreachable[:5]
        assert [pod.exit for pod in old] == [("drained", 0), ("drained", 0)]
        assert all(load.ok[kind] >= 10 for kind in KINDS), \
            load.ok
        assert sum(load.ok.values()) > during, "the new replicas serve after the old ones are gone"
        assert all(opened_after.get(pod.endpoint[0], 0) > 0 for pod in [*old, *new]), opened_after
    finally:
        for pod in [*old, *new]:
            pod.gateway.stop()
        print(json.dumps({pod.name: pod.exit for pod in old}))
