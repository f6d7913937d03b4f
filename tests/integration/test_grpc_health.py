"""``grpc.health.v1.Health`` on both gRPC servers, asked the way Kubernetes' ``grpc:`` probe and
``grpc_health_probe`` ask (grpcio and the official ``grpc_health`` protos), against the real Triton."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from tests.support import TOKEN, GatewayProcess, GatewayThread, admin_call, gateway_settings

pytestmark = pytest.mark.triton
SERVICE = "inference.GRPCInferenceService"


def check(address: str, service: str = "", timeout: float = 5.0) -> str:
    """What ``grpc_health_probe -addr ADDRESS -service SERVICE`` reports: the serving status, or the
    status code of a failed call."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class Watcher:
    """One ``Watch`` call, its answers collected in a thread until ``close``."""

    def __init__(self, address: str, service: str = "") -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.RpcError:
            pass  # cancelled by close()

    def wait_for(self, status: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.seen or self.seen[-1] != status:
            assert time.monotonic() < deadline, f"Watch sent {self.seen}, never {status}"
            time.sleep(0.05)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)
        self.channel.close()


@pytest.fixture(params=["lean", "grpcio"])
def gateway(triton: LocalTriton, request: pytest.FixtureRequest) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=request.param,
                                admin_token=TOKEN, resync_interval_s=0.1, sync_unready_after_s=0.5,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def test_health_follows_readiness_serving_then_not_serving_while_store_sync_is_unready(
        gateway: GatewayThread) -> None:
    address = f"127.0.0.1:{gateway.settings.grpc_port}"
    assert check(address) == "SERVING"
    assert check(address, SERVICE) == "SERVING"
    assert check(address, "no.such.Service") == "NOT_FOUND", "the standard's answer for an unknown service"
    unknown = Watcher(address, "no.such.Service")
    watcher = Watcher(address)
    try:
        watcher.wait_for("SERVING")
        unknown.wait_for("SERVICE_UNKNOWN")  # the call stays open, as the standard says
        healthy = gateway.app.store.scan_policies

        async def broken() -> None:
            raise KeyError("a bug in the sync path")

        gateway.app.store.scan_policies = broken  # type: ignore[method-assign,assignment]
        watcher.wait_for("NOT_SERVING")
        assert check(address) == "NOT_SERVING" and check(address, SERVICE) == "NOT_SERVING"
        status, body = admin_call(gateway.url, "GET", "/readyz")
        assert status == 503 and "policy sync has been failing" in body["error"], "the same answer as /readyz"
        gateway.app.store.scan_policies = healthy  # type: ignore[method-assign]
        watcher.wait_for("SERVING")
        assert check(address) == "SERVING"
        with urllib.request.urlopen(f"{gateway.url}/readyz", timeout=5) as ready:
            assert ready.status == 200
        assert watcher.seen == ["SERVING", "NOT_SERVING", "SERVING"], "one message per change"
    finally:
        watcher.close()
        unknown.close()


def test_a_malformed_health_request_is_invalid_argument(gateway: GatewayThread) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"\x0a\x05ab", timeout=5)  # a truncated string
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_sigterm_tells_watchers_not_serving_and_ends_their_watch_so_the_drain_is_not_held(
        triton: LocalTriton, tmp_path: Path, server: str) -> None:
    """At SIGTERM every Watch hears NOT_SERVING and ends OK (grpcio's HealthServicer does the same
    at enter_graceful_shutdown): the watching client moves to another replica, and the gateway
    stops without waiting drain_timeout_s. Before, the open Watch held its connection, and with it
    every shutdown, to the bound (20 s here), and was then cut."""
    gw = GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
                         "GATEWAY_STORE_URL": f"sqlite:///{tmp_path / 'state.db'}", "GATEWAY_GRPC_SERVER": server,
                         "GATEWAY_DRAIN_TIMEOUT_S": "20"}).start()
    try:
        watcher = Watcher(f"127.0.0.1:{gw.grpc_port}")
        watcher.wait_for("SERVING")
        signalled = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)
        watcher.thread.join(15)
        gw.process.wait(30)
        stopped_after = time.monotonic() - signalled
        assert watcher.seen[-1] == "NOT_SERVING" and watcher.call.code() == grpc.StatusCode.OK, \
            (watcher.seen, watcher.call.code())
        assert stopped_after < 10, f"stopped {stopped_after:.1f} s after SIGTERM: the watch held the drain"
        watcher.close()
    finally:
        gw.kill()


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_watchers_share_one_probe_a_second_and_one_client_holds_a_bounded_number(triton: LocalTriton,
                                                                                  server: str) -> None:
    """Each open Watch asked Triton for itself every second (4,000 watchers: 2.9 CPU s per 10 s;
    8,000 from one address slowed /readyz to 2.1 s). Now: one probe per second for all of them,
    and one client (address) holds at most grpc_max_health_watches_per_client; past it, each
    further Watch is answered RESOURCE_EXHAUSTED."""
    from tests.abuse.attack import DATA, Attacker, frame, grpc_status, request_headers

    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=server,
                                grpc_max_health_watches_per_client=20, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gateway:
        health = gateway.app.health
        asked, readiness = [0], health.readiness

        async def counted() -> str | None:
            asked[0] += 1
            return await readiness()

        health.readiness = counted
        attacker = Attacker(settings.grpc_port)
        streams = list(range(1, 101, 2))  # 50 watches on one connection
        attacker.send(b"".join(attacker.headers(stream, request_headers(b"/grpc.health.v1.Health/Watch"))
                               + frame(DATA, 1, stream, b"\x00\x00\x00\x00\x00") for stream in streams))

        def answered(frames: list[Any]) -> bool:  # every watch has its first message, or its refusal
            return all(grpc_status(frames, s) is not None or any(f.kind == DATA and f.stream_id == s for f in frames)
                       for s in streams)

        frames = attacker.frames(until=10, done=answered)
        refused = [s for s in streams if grpc_status(frames, s) == 8]  # RESOURCE_EXHAUSTED
        watching = [s for s in streams if any(f.kind == DATA and f.stream_id == s for f in frames)]
        assert (len(watching), len(refused)) == (20, 30), (watching, refused)
        before = asked[0]
        time.sleep(2.5)  # two or three intervals: 20 watchers asking each would make 40-60 probes
        probes = asked[0] - before
        assert 1 <= probes <= 4, f"{probes} readiness probes in 2.5 s for 20 watchers"
        assert check(f"127.0.0.1:{settings.grpc_port}") == "SERVING"
        attacker.close()
