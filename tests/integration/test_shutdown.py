"""SIGTERM on one gateway process (``workers: 1``, the shipped k8s manifest's mode), against the
real Triton: both ports stop accepting at once, and the requests in flight get ``drain_timeout_s``
to finish, no more and no less (the workers' drain is in tests/integration/test_workers.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from gateway.grpc.upstream import GrpcUpstream
from tests.conftest import Faults
from tests.fleet_support import INFER, infer_message
from tests.support import INFER_BODY, GatewayProcess

pytestmark = pytest.mark.triton


def http_infer(url: str, version: str) -> str:
    """One request on its own connection: its status, or how it ended without one."""
    request = urllib.request.Request(f"{url}/v2/models/qc/versions/{version}/infer", data=INFER_BODY)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return str(response.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return f"cut: {exc!r}"


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_closes_both_ports_and_gives_requests_in_flight_drain_timeout_s(
        triton: LocalTriton, tmp_path: Path, faults: Faults) -> None:
    """drain_timeout_s 3 s: a request with 1 s left at the signal finishes, one with 7 s (or more:
    the two share a version) left is cut at the bound, on either port. uvicorn's former fixed 10 s
    finished the long HTTP request, and the gRPC port went on accepting (and stopped only after
    the HTTP port had drained)."""
    drain = 3.0
    # one model instance per version runs one request at a time: each short call has its own version
    faults.set("qc", "1", delay_ms=2000)
    faults.set("qc", "2", delay_ms=2000)
    faults.set("qc", "3", delay_ms=8000)
    gw = GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
                         "GATEWAY_STORE_URL": f"sqlite:///{tmp_path / 'state.db'}",
                         "GATEWAY_DRAIN_TIMEOUT_S": str(drain)}).start()

    async def scenario() -> tuple[dict[str, object], float]:
        grpc = GrpcUpstream(f"127.0.0.1:{gw.grpc_port}", request_timeout_s=30)

        async def grpc_infer(version: str) -> object:
            code, details, _ = await grpc.unary(INFER, infer_message(version=version))
            return StatusCode(code) if code == StatusCode.OK else f"{StatusCode(code).name}: {details}"

        calls = {"http 2 s": asyncio.create_task(asyncio.to_thread(http_infer, gw.url, "1")),
                 "http 8 s": asyncio.create_task(asyncio.to_thread(http_infer, gw.url, "3")),
                 "grpc 2 s": asyncio.create_task(grpc_infer("2")),
                 "grpc 8 s": asyncio.create_task(grpc_infer("3"))}
        await asyncio.sleep(1.0)  # every call is at Triton, sleeping
        assert not any(call.done() for call in calls.values()), {k: c.result() for k, c in calls.items() if c.done()}
        gw.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.5)
        closed = await asyncio.to_thread(lambda: (refuses(gw.port), refuses(gw.grpc_port)))
        assert closed == (True, True), f"(HTTP, gRPC) listeners closed 0.5 s after SIGTERM: {closed}"
        results = {name: await call for name, call in calls.items()}
        await asyncio.to_thread(gw.process.wait, 30)
        await grpc.aclose()
        return results, time.monotonic() - signalled

    try:
        results, stopped_after = asyncio.run(scenario())
    finally:
        gw.kill()
    print(f"stopped {stopped_after:.2f} s after SIGTERM: {results}")
    assert results["http 2 s"] == "200" and results["grpc 2 s"] == StatusCode.OK, results
    assert results["http 8 s"] != "200" and results["grpc 8 s"] != StatusCode.OK, results  # cut at the bound
    # the bound, then the application's stop: well before the 8 s calls (7 s from the signal) would end
    assert drain <= stopped_after < drain + 3.5, (stopped_after, results)
    assert gw.process.returncode == 0, "a clean drain is a clean exit (it was -15: uvicorn raised the signal again)"


def test_a_request_cut_by_drain_timeout_s_is_answered_503_in_tritons_error_shape(
        triton: LocalTriton, tmp_path: Path, faults: Faults) -> None:
    """An HTTP request still running when drain_timeout_s ends is cut; its client learns why, in
    Triton's error shape: 503, the gateway is shutting down (retry elsewhere). It was uvicorn's
    plain-text 500 "Internal Server Error"."""
    faults.set("qc", "3", delay_ms=8000)
    gw = GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
                         "GATEWAY_STORE_URL": f"sqlite:///{tmp_path / 'state.db'}",
                         "GATEWAY_DRAIN_TIMEOUT_S": "1"}).start()
    answer: dict[str, object] = {}

    def call() -> None:
        request = urllib.request.Request(f"{gw.url}/v2/models/qc/versions/3/infer", data=INFER_BODY)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer.update(status=response.status, body=response.read())
        except urllib.error.HTTPError as exc:
            answer.update(status=exc.code, type=exc.headers.get("content-type"), body=exc.read())

    try:
        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(1.0)  # at Triton, sleeping
        gw.process.send_signal(signal.SIGTERM)
        thread.join(30)
        gw.process.wait(30)
    finally:
        gw.kill()
    assert answer.get("status") == 503, answer
    assert answer["type"] == "application/json", answer
    assert "shutting down" in json.loads(answer["body"])["error"], answer  # type: ignore[arg-type]


def test_a_grpc_call_cut_by_drain_timeout_s_is_answered_unavailable_with_the_reason(
        triton: LocalTriton, tmp_path: Path, faults: Faults) -> None:
    """A gRPC call still running when drain_timeout_s ends is answered UNAVAILABLE (a status
    clients retry on) saying why, as the HTTP port's 503 does. It was a connection abort: the
    client saw only that its connection was lost."""
    faults.set("qc", "3", delay_ms=8000)
    gw = GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
                         "GATEWAY_STORE_URL": f"sqlite:///{tmp_path / 'state.db'}",
                         "GATEWAY_DRAIN_TIMEOUT_S": "1"}).start()

    async def scenario() -> tuple[int, str]:
        grpc = GrpcUpstream(f"127.0.0.1:{gw.grpc_port}", request_timeout_s=30)
        call = asyncio.create_task(grpc.unary(INFER, infer_message(version="3")))
        await asyncio.sleep(1.0)  # at Triton, sleeping
        assert not call.done(), call.result()
        gw.process.send_signal(signal.SIGTERM)
        code, details, _ = await call
        await grpc.aclose()
        return code, details

    try:
        code, details = asyncio.run(scenario())
        gw.process.wait(30)
    finally:
        gw.kill()
    assert (StatusCode(code), "shutting down" in details) == (StatusCode.UNAVAILABLE, True), details
