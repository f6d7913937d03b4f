"""The lean HTTP/2 client (``gateway.grpc.upstream``) straight against the real Triton."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton, free_port
from gateway.grpc.status import StatusCode
from gateway.grpc.upstream import GrpcUpstream
from tests.conftest import Faults

pytestmark = pytest.mark.triton
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def request(version: str = "2", batch: int = 1) -> bytes:
    message = service_pb2.ModelInferRequest(model_name="qc", model_version=version)
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[batch, 4])  # data: raw_input_contents
    message.raw_input_contents.append(np.arange(batch * 4, dtype=np.float32).tobytes())
    encoded: bytes = message.SerializeToString()
    return encoded


def output(raw: bytes) -> np.ndarray[Any, Any]:
    response = service_pb2.ModelInferResponse.FromString(raw)
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32)


async def test_unary_calls_with_metadata_and_deadline(triton: LocalTriton) -> None:
    upstream = GrpcUpstream(triton.grpc_url)
    try:
        code, _, raw = await upstream.unary(INFER, request("3"), (("x-user", "u1"), ("trace-bin", b"\x00\xff")), 5.0)
        assert code == StatusCode.OK and output(raw).tolist() == [0.0, 3.0, 6.0, 9.0]
        code, _, raw = await upstream.unary("/inference.GRPCInferenceService/ServerLive", b"")
        assert code == StatusCode.OK and service_pb2.ServerLiveResponse.FromString(raw).live
        code, details, _ = await upstream.unary("/inference.GRPCInferenceService/NoSuchMethod", b"")
        assert code == 12  # UNIMPLEMENTED, Triton's own answer
        code, details, _ = await upstream.unary(INFER, request("9"))
        assert code != StatusCode.OK and "qc" in details  # Triton's message passes through (percent-decoded)
    finally:
        await upstream.aclose()


async def test_many_concurrent_calls_share_one_connection(triton: LocalTriton) -> None:
    upstream = GrpcUpstream(triton.grpc_url)
    try:
        replies = await asyncio.gather(*(upstream.unary(INFER, request("2")) for _ in range(300)))
        assert {reply[0] for reply in replies} == {StatusCode.OK}
        assert all(output(reply[2]).tolist() == [0.0, 2.0, 4.0, 6.0] for reply in replies)
        assert upstream._connection is not None and not upstream._connection.streams
    finally:
        await upstream.aclose()


async def test_a_request_larger_than_the_flow_control_window(triton: LocalTriton) -> None:
    """2 MiB is far past HTTP/2's initial 64 KiB windows: the client must wait for WINDOW_UPDATEs."""
    upstream = GrpcUpstream(triton.grpc_url)
    try:
        code, details, _ = await asyncio.wait_for(upstream.unary(INFER, request("2", batch=131072)), 20)
        assert code == 3 and "batch" in details  # INVALID_ARGUMENT: Triton read it all, then refused it
        code, _, raw = await upstream.unary(INFER, request("2"))
        assert code == StatusCode.OK
    finally:
        await upstream.aclose()


async def test_a_cancelled_call_is_left_to_finish_never_reset_and_the_connection_stays_usable(
        triton: LocalTriton, faults: Faults, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's cancel ends its wait at once; upstream the call runs to Triton's answer and no
    RST_STREAM goes out (Triton 2.51 crashes on resets: grpc.upstream). Its slot comes back then."""
    faults.set("qc", "3", delay_ms=1500)
    upstream = GrpcUpstream(triton.grpc_url)
    try:
        code, _, _ = await upstream.unary(INFER, request("2"))  # the connection is open
        connection = upstream._connection
        assert connection is not None and code == StatusCode.OK
        resets: list[int] = []
        monkeypatch.setattr(connection, "reset", lambda stream, code=0: resets.append(stream.id))
        slot = Slot()
        call = asyncio.ensure_future(upstream.unary(INFER, request("3"), slot=slot))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert len(connection.streams) == 1 and slot.released == 0, "left running upstream, its slot taken"
        started = time.monotonic()
        code, _, _ = await upstream.unary(INFER, request("2"))
        assert code == StatusCode.OK and upstream._connection is connection and time.monotonic() - started < 1.0
        await ended(connection)
        assert resets == [] and slot.released == 1
        code, _, _ = await upstream.unary(INFER, request("3"), timeout=0.3)
        assert code == 4  # DEADLINE_EXCEEDED: grpc-timeout reached Triton
    finally:
        await upstream.aclose()


async def test_a_cancelled_stream_ends_its_requests_instead_of_a_reset(triton: LocalTriton, faults: Faults,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A ModelStreamInfer whose caller leaves is half-closed: Triton answers what it was sent and
    ends the stream (reset after or between a decoupled model's replies, 5-540 streams killed it)."""
    faults.set("qc", "3", delay_ms=1000)
    upstream = GrpcUpstream(triton.grpc_url)
    heard = Heard()
    try:
        stream = await upstream.open(STREAM_INFER, heard)
        connection = upstream._connection
        assert connection is not None
        resets: list[int] = []
        monkeypatch.setattr(connection, "reset", lambda stream, code=0: resets.append(stream.id))
        stream.send(request("3"))
        await asyncio.sleep(0.2)
        stream.cancel()
        stream.cancel()  # once is enough: a second changes nothing
        assert heard.closed == [(StatusCode.CANCELLED, "cancelled")] and len(connection.streams) == 1
        assert stream.call.requests_ended
        await ended(connection)  # Triton answers the request it had and ends the stream
        assert resets == [] and heard.closed == [(StatusCode.CANCELLED, "cancelled")] and heard.data == 0
    finally:
        await upstream.aclose()


async def ended(connection: Any, within_s: float = 10.0) -> None:
    """Until the connection has no call open (Triton answered them all): a left call is reset only
    after 60 s, so a call that never ends fails here first, not at the suite's timeout."""
    ends = time.monotonic() + within_s
    while connection.streams:
        assert time.monotonic() < ends, f"{len(connection.streams)} calls still open upstream after {within_s:g} s"
        await asyncio.sleep(0.02)


class Slot:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


class Heard:
    """A stream listener that keeps what it heard."""

    def __init__(self) -> None:
        self.data = 0
        self.closed: list[tuple[int, str]] = []

    def on_headers(self, headers: Any) -> None:
        pass

    def on_data(self, payload: bytes | memoryview) -> None:
        self.data += len(payload)

    def on_close(self, code: int, details: str) -> None:
        self.closed.append((code, details))

    def on_drained(self) -> None:
        pass


async def test_unreachable_or_wrong_upstreams_are_unavailable(triton: LocalTriton) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    code, details, _ = await GrpcUpstream(nobody).unary(INFER, request())
    assert code == StatusCode.UNAVAILABLE and details.startswith("gateway: cannot connect to Triton"), details
    assert nobody not in details and "127.0.0.1" not in details, "no internal address in what a client is told"
    http_port = triton.http_url.rsplit(":", 1)[1]  # an HTTP/1.1 server: it answers the preface and hangs up
    wrong = GrpcUpstream(f"127.0.0.1:{http_port}")
    code, details, _ = await asyncio.wait_for(wrong.unary(INFER, request()), 10)
    assert code in (StatusCode.UNAVAILABLE, 13), details


async def test_a_call_without_a_deadline_gets_request_timeout(triton: LocalTriton, faults: Faults) -> None:
    faults.set("qc", "3", delay_ms=1500)
    upstream = GrpcUpstream(triton.grpc_url, request_timeout_s=0.3)
    try:
        started = time.monotonic()
        code, details, _ = await upstream.unary(INFER, request("3"))  # no timeout of its own
        assert code == StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 1.2, details
        assert not details.startswith("gateway: "), "Triton, told the deadline, answered it itself"
    finally:
        await upstream.aclose()


async def test_keepalive_pings_keep_an_idle_connection_to_triton_open(triton: LocalTriton) -> None:
    """Triton (grpc core's default ping policy) closes a connection with GOAWAY too_many_pings at
    the third PING frame received while it sent nothing: the keepalive must not look like that."""
    upstream = GrpcUpstream(triton.grpc_url, keepalive_s=0.2, keepalive_timeout_s=1)
    try:
        assert (await upstream.unary(INFER, request("2")))[0] == StatusCode.OK
        connection = upstream._connection
        assert connection is not None
        await asyncio.sleep(3)  # idle: ~14 keepalive rounds
        assert not connection.closing and connection._settings_acked >= 10, "answered, and the connection kept"
        assert (await upstream.unary(INFER, request("2")))[0] == StatusCode.OK and upstream._connection is connection
    finally:
        await upstream.aclose()
