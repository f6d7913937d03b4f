"""Our HTTP/2 gRPC server (``grpc_server: lean``) at the protocol level, against the real Triton."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from gateway.drain import DRAIN_GRACE_S
from gateway.http2.endpoint import Endpoint
from tests.conftest import Faults
from tests.support import GatewayThread, gateway_settings, wait_for

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}})
    assert settings.grpc_server == "lean", "the default"
    with GatewayThread(settings) as running:
        yield running


def stub(gateway: GatewayThread, **options: int) -> tuple[grpc.Channel, service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}", options=list(options.items()))
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def infer_request(batch: int = 1) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="qc")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[batch, 4])
    message.raw_input_contents.append(np.ones(batch * 4, dtype=np.float32).tobytes())
    return message


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_requests_are_read(gateway: GatewayThread, compression: grpc.Compression) -> None:
    channel, client = stub(gateway)
    answer, call = client.ModelInfer.with_call(infer_request(), compression=compression)
    assert answer.model_version == "2" and dict(call.initial_metadata())["x-gateway-route"] == "weighted"
    channel.close()


def test_unknown_methods_are_unimplemented(gateway: GatewayThread) -> None:
    channel, _ = stub(gateway)
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/other.Service/Method")(b"", timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    channel.close()


def test_responses_wait_for_a_small_client_window(gateway: GatewayThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that reads 64 bytes ahead: a 240-byte answer goes out as its window opens."""
    blocked: list[int] = []
    original = Endpoint._flush_blocked

    def counting(self: Endpoint) -> None:
        blocked.extend(stream.id for stream in self._blocked)
        original(self)

    monkeypatch.setattr(Endpoint, "_flush_blocked", counting)
    channel, client = stub(gateway, **{"grpc.http2.lookahead_bytes": 64, "grpc.http2.bdp_probe": 0})
    for _ in range(3):
        assert client.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=5).name == "triton"
    channel.close()
    assert blocked, "the answers never had to wait for window: the test does not test flow control"


def frame_types(data: bytes) -> list[int]:
    types, pos = [], 0
    while len(data) - pos >= 9:
        types.append(data[pos + 3])
        pos += 9 + int.from_bytes(data[pos:pos + 3], "big")
    return types


def test_a_client_that_is_not_http2_is_dropped_and_others_are_served(gateway: GatewayThread) -> None:
    with socket.create_connection(("127.0.0.1", gateway.settings.grpc_port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 100)
        received = b""
        while chunk := raw.recv(4096):  # until the gateway closes the connection
            received += chunk
    assert frame_types(received) == [4, 8, 7], "SETTINGS, WINDOW_UPDATE, then GOAWAY and the close"
    channel, client = stub(gateway)
    assert client.ModelInfer(infer_request()).model_version == "2"
    channel.close()


def test_a_malformed_infer_request_is_invalid_argument(gateway: GatewayThread) -> None:
    channel, _ = stub(gateway)
    truncated = infer_request().SerializeToString()[:-3]  # a length-delimited field now runs past the end
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(truncated, timeout=5)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_stopping_lets_calls_in_flight_finish(triton: LocalTriton, faults: Faults) -> None:
    """The call outlasts the drain's first grace (``DRAIN_GRACE_S``, before the second GOAWAY): it
    is answered in the time the open calls get after it. With 600 ms it ended inside that first
    grace, and a stop that gave open calls nothing after the second GOAWAY still passed."""
    faults.set("qc", "2", delay_ms=round((DRAIN_GRACE_S + 0.5) * 1000))
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}})
    gateway = GatewayThread(settings).__enter__()
    channel, client = stub(gateway)
    future = client.ModelInfer.future(infer_request(), timeout=10)
    # the call is in flight before the stop (a 0.2 s sleep did not promise that on a loaded machine)
    wait_for(lambda: gateway.app.recorder.inflight.get(("qc", "2")), 5, interval=0.01, what="the call to be forwarded")
    started = time.monotonic()
    gateway.__exit__(None, None, None)  # GOAWAY; waits up to 5 s for calls in flight
    assert future.result().model_version == "2", "the call in flight was answered, not cut off"
    assert time.monotonic() - started < 4
    with pytest.raises(grpc.RpcError):
        client.ModelInfer(infer_request(), timeout=2)
    channel.close()


@pytest.mark.parametrize("settings", [b"\x00\x05\x00\x00\x00\x00", b"\x00\x04\x80\x00\x00\x00"])
def test_impossible_settings_close_the_connection(gateway: GatewayThread, settings: bytes) -> None:
    """MAX_FRAME_SIZE 0 or a window above 2^31-1 would wedge every answer: refuse them."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gateway.settings.grpc_port), timeout=5) as raw:
        raw.sendall(preface + len(settings).to_bytes(3, "big") + b"\x04\x00\x00\x00\x00\x00" + settings)
        received = b""
        while chunk := raw.recv(4096):
            received += chunk
    assert frame_types(received)[-1] == 7, "GOAWAY, then the close"
