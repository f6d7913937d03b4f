"""Admission control against two real Triton servers: overload is refused early and clearly, and
never counted against a version."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

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
