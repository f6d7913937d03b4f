"""Admission control against two real Triton servers: overload is refused early and clearly, and
never counted against a version."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from gateway.upstream import HttpUpstream
from tests.conftest import Faults
from tests.fleet_support import INFER, fleet_settings, infer_message
from tests.support import INFER_BODY, GatewayThread

pytestmark = pytest.mark.triton
ADMITTED = 4  # 2 servers x max_inflight_per_server 2
BACK_OFF_S = 0.05  # a refused client waits a little (a real one would honour Retry-After) rather than spin


async def timed_http(url: str, requests: int, concurrency: int) -> list[tuple[int, float, bool]]:
    """(status, seconds, has Retry-After) per request."""
    client = HttpUpstream(url, max_connections=concurrency, request_timeout_s=30)
    out: list[tuple[int, float, bool]] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for _ in counter:
            started = time.monotonic()
            try:
                response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                await response.read()
                status = response.status
            except Exception:  # a transport failure or timeout: the test asserts there are none
                status = 0
                response = None
            retry = response is not None and any(name == b"retry-after" for name, _ in response.headers)
            out.append((status, time.monotonic() - started, retry))
            if status == 429:
                await asyncio.sleep(BACK_OFF_S)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return out


async def timed_grpc(address: str, requests: int, concurrency: int) -> list[tuple[int, float]]:
    from gateway.grpc.upstream import GrpcUpstream

    client = GrpcUpstream(address)
    message = infer_message()
    out: list[tuple[int, float]] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for _ in counter:
            started = time.monotonic()
            code, _, _ = await client.unary(INFER, message, (), 30.0)
            out.append((code, time.monotonic() - started))
            if code == StatusCode.RESOURCE_EXHAUSTED:
                await asyncio.sleep(BACK_OFF_S)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def test_three_times_the_admitted_concurrency_gets_quick_refusals_and_bounded_latency(
        triton_pair: tuple[LocalTriton, LocalTriton], faults: Faults) -> None:
    faults.set("qc", "2", delay_ms=40)  # each server runs one request at a time: ~40 ms each
    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}}, max_inflight_per_server=2,
                              queue_timeout_ms=100)
    with GatewayThread(settings) as gw:
        results = asyncio.run(timed_http(gw.url, 300, concurrency=3 * ADMITTED))
        statuses = Counter(status for status, _, _ in results)
        assert set(statuses) == {200, 429}, statuses  # nothing timed out, nothing failed otherwise
        refused = [seconds for status, seconds, _ in results if status == 429]
        accepted = [seconds for status, seconds, _ in results if status == 200]
        assert all(retry for status, _, retry in results if status == 429), "every 429 says Retry-After"
        assert max(refused) < 0.6, max(refused)  # the queue wait is 100 ms: refused quickly, never hung
        assert p99(accepted) < 1.0, p99(accepted)  # at most 2 running + 2 queued per server, never a pile-up
        assert statuses[200] >= 50 and statuses[429] >= 50, statuses
        window = gw.app.recorder.window("qc", "2", 120)
        assert window.requests == statuses[200] and window.errors == 0, "overload is never held against a version"
        servers = gw.app.fleets.default.describe()
        assert sum(int(s["refused"]) for s in servers) == statuses[429]  # type: ignore[call-overload]

        codes = asyncio.run(timed_grpc(f"127.0.0.1:{gw.settings.grpc_port}", 300, concurrency=3 * ADMITTED))
        by_code = Counter(code for code, _ in codes)
        assert set(by_code) == {StatusCode.OK, StatusCode.RESOURCE_EXHAUSTED}, by_code
        assert max(s for c, s in codes if c == StatusCode.RESOURCE_EXHAUSTED) < 0.6
        assert p99([s for c, s in codes if c == StatusCode.OK]) < 1.0
        window = gw.app.recorder.window("qc", "2", 120)
        assert window.errors == 0 and window.requests == statuses[200] + by_code[StatusCode.OK]


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_probes_answer_within_a_second_while_every_server_is_saturated(
        triton_pair: tuple[LocalTriton, LocalTriton], faults: Faults, grpc_server: str) -> None:
    """The issue's case: max_inflight_per_server 4 and 24 requests in flight (3x what is admitted)
    on a slow model. /readyz and the gRPC health check go over each server's probe connection,
    not admission: each answers ready within the 1 s a Kubernetes probe allows."""
    faults.set("qc", "2", delay_ms=200)  # one request at a time per server: the queue stays full
    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}}, max_inflight_per_server=4,
                              queue_timeout_ms=3000, grpc_server=grpc_server)
    with GatewayThread(settings) as gw:
        stop = time.monotonic() + 60

        async def saturate() -> None:
            client = HttpUpstream(gw.url, max_connections=24, request_timeout_s=30)

            async def worker() -> None:
                while time.monotonic() < stop:
                    try:
                        response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                        await response.read()
                    except Exception:  # load only: what it gets is not the test
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(worker() for _ in range(24)))
            await client.aclose()

        loop = asyncio.new_event_loop()
        load = threading.Thread(target=loop.run_until_complete, args=(saturate(),), daemon=True)
        load.start()
        try:
            servers = gw.app.fleets.default.servers.values()
            deadline = time.monotonic() + 10
            while sum(s.inflight for s in servers) < 2 * 4 or sum(len(s.waiters) for s in servers) < 4:
                assert time.monotonic() < deadline, "the load never saturated the fleet"
                time.sleep(0.05)
            channel = grpc.insecure_channel(f"127.0.0.1:{gw.settings.grpc_port}")
            health = health_pb2_grpc.HealthStub(channel)
            probes: list[tuple[str, int | str, float]] = []
            for _ in range(5):
                started = time.monotonic()
                try:
                    with urllib.request.urlopen(f"{gw.url}/readyz", timeout=1) as ready:
                        probes.append(("readyz", ready.status, time.monotonic() - started))
                except (OSError, urllib.error.HTTPError) as exc:
                    probes.append(("readyz", getattr(exc, "code", repr(exc)), time.monotonic() - started))
                started = time.monotonic()
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    probes.append(("grpc", health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status),
                                   time.monotonic() - started))
                except grpc.RpcError as exc:
                    probes.append(("grpc", exc.code().name, time.monotonic() - started))
                assert sum(s.inflight for s in servers) >= 2 * 4, "still saturated while probing"
                time.sleep(0.2)
            channel.close()
            assert all(answer in (200, "SERVING") and seconds < 1.0 for _, answer, seconds in probes), probes
        finally:
            stop = 0.0
            load.join(40)
            loop.close()
