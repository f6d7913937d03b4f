"""KServe-v2 over gRPC, Triton's extensions and grpc.health: the same answer from Triton and through the gateway.

Raw calls through grpcio (request bytes in; status, details, response bytes and metadata
out), so nothing a client library smooths over is missed. The routing metadata is the one
documented difference (``differences``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from tests.compat.differences import ROUTING_HEADERS
from tests.conftest import Faults
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
SERVICE = "/inference.GRPCInferenceService/"


def qc_request(version: str = "", values: list[float] | None = None, name: str = "INPUT0",
               shape: tuple[int, ...] = (1, 4)) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="qc", model_version=version)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "FP32"
    tensor.shape.extend(shape)
    request.raw_input_contents.append(np.array(values or [1, 2, 3, 4], dtype=np.float32).tobytes())
    return request


def seq_request(sequence_id: int, value: int, start: bool = False, end: bool = False) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="seq", id=f"{sequence_id}-{value}")
    request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "INT32"
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(np.array([[value]], dtype=np.int32).tobytes())
    return request


def tok_request(text: str = "hi", tokens: int = 3) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="tok")
    for name, datatype, value in (("text_input", "BYTES", None), ("max_tokens", "INT32", tokens)):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend([1])
        if value is None:
            tensor.contents.bytes_contents.append(text.encode())
        else:
            tensor.contents.int_contents.append(value)
    return request


Outcome = tuple[str, str, bytes, tuple[tuple[str, Any], ...]]  # code, details, response, metadata


def _metadata(pairs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in (pairs or ()) if k not in ROUTING_HEADERS))


def unary(address: str, method: str, request: bytes, timeout: float = 10) -> Outcome:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            response, state = call.with_call(request, timeout=timeout)
        except grpc.RpcError as error:
            return error.code().name, error.details() or "", b"", _metadata(error.trailing_metadata())
        return "OK", "", response, _metadata(state.trailing_metadata())


@pytest.fixture(scope="module")
def addresses(triton: LocalTriton, gateway: GatewayThread) -> tuple[str, str]:
    return triton.grpc_url, f"127.0.0.1:{gateway.settings.grpc_port}"


CALLS: list[tuple[str, str, Any]] = [
    ("ServerLive", "ServerLive", service_pb2.ServerLiveRequest()),
    ("ServerReady", "ServerReady", service_pb2.ServerReadyRequest()),
    ("ModelReady", "ModelReady", service_pb2.ModelReadyRequest(name="qc")),
    ("ModelReady unknown version", "ModelReady", service_pb2.ModelReadyRequest(name="qc", version="9")),
    ("ModelReady unknown model", "ModelReady", service_pb2.ModelReadyRequest(name="nope")),
    ("ServerMetadata", "ServerMetadata", service_pb2.ServerMetadataRequest()),
    ("ModelMetadata", "ModelMetadata", service_pb2.ModelMetadataRequest(name="qc", version="2")),
    ("ModelMetadata unknown", "ModelMetadata", service_pb2.ModelMetadataRequest(name="nope")),
    ("ModelConfig", "ModelConfig", service_pb2.ModelConfigRequest(name="seq")),
    ("ModelConfig unknown", "ModelConfig", service_pb2.ModelConfigRequest(name="nope")),
    ("ModelStatistics", "ModelStatistics", service_pb2.ModelStatisticsRequest(name="qc")),
    ("RepositoryIndex", "RepositoryIndex", service_pb2.RepositoryIndexRequest()),
    ("TraceSetting read", "TraceSetting", service_pb2.TraceSettingRequest()),
    ("LogSettings read", "LogSettings", service_pb2.LogSettingsRequest()),
    ("SystemSharedMemoryStatus", "SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest()),
    ("CudaSharedMemoryStatus", "CudaSharedMemoryStatus", service_pb2.CudaSharedMemoryStatusRequest()),
    ("ModelInfer", "ModelInfer", qc_request()),
    ("ModelInfer versioned", "ModelInfer", qc_request("3")),
    ("ModelInfer wrong shape", "ModelInfer", qc_request(values=[1, 2, 3], shape=(1, 3))),
    ("ModelInfer unknown input", "ModelInfer", qc_request(name="X")),
    ("ModelInfer unknown version", "ModelInfer", qc_request("9")),
    ("ModelInfer version 0", "ModelInfer", qc_request("0")),
    ("ModelInfer sequence never started", "ModelInfer", seq_request(8400, 1)),
]


@pytest.mark.parametrize(("what", "method", "request_"), CALLS, ids=[c[0] for c in CALLS])
def test_unary_calls(addresses: tuple[str, str], what: str, method: str, request_: Any) -> None:
    raw = request_.SerializeToString()
    direct, through = (unary(address, SERVICE + method, raw) for address in addresses)
    assert through[:2] == direct[:2] and through[3] == direct[3], what
    # equal as messages: Triton writes protobuf maps (trace and log settings) in no fixed order
    response = getattr(service_pb2, f"{method}Response")
    assert response.FromString(through[2]) == response.FromString(direct[2]), what


def test_grpc_health_check(addresses: tuple[str, str]) -> None:
    """grpc.health.v1.Health/Check for the overall service: SERVING from both (serving = 1)."""
    direct, through = (unary(address, "/grpc.health.v1.Health/Check", b"") for address in addresses)
    assert direct == ("OK", "", b"\x08\x01", ()) and through == direct


def stream(address: str, requests: list[service_pb2.ModelInferRequest], expected: int,
           timeout: float = 20) -> list[bytes]:
    """ModelStreamInfer: every request sent on one stream, the first ``expected`` replies awaited,
    then the requests ended and the rest read (a reset could crash Triton: grpc.upstream)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(SERVICE + "ModelStreamInfer", request_serializer=None,
                                     response_deserializer=None)
        done = threading.Event()

        def messages() -> Iterator[bytes]:
            for request in requests:
                yield request.SerializeToString()
            done.wait(timeout)

        responses = call(messages(), timeout=timeout)
        out = []
        for reply in responses:
            out.append(reply)
            if len(out) == expected:
                break
        done.set()  # the requests end: Triton ends the stream once it has answered them
        out.extend(responses)  # never cancelled: a reset stream can crash Triton 2.51 (grpc.upstream)
        return out


def test_decoupled_model_on_a_stream(addresses: tuple[str, str]) -> None:
    direct, through = (stream(address, [tok_request(tokens=4)], 4) for address in addresses)
    assert len(direct) == 4 and through == direct


def test_sequences_on_a_stream_oldest_strategy(addresses: tuple[str, str]) -> None:
    """Interleaved sequences on one stream (the seq model batches them, oldest strategy)."""
    def requests(base: int) -> list[service_pb2.ModelInferRequest]:
        return [seq_request(base + s, value, start=value == 1, end=value == 3)
                for value in (1, 2, 3) for s in range(3)]

    direct = stream(addresses[0], requests(8500), 9)
    through = stream(addresses[1], requests(8500 + 100), 9)

    def sums(replies: list[bytes]) -> list[tuple[str, bytes]]:
        out = []
        for reply in replies:
            message = service_pb2.ModelStreamInferResponse.FromString(reply)
            assert not message.error_message, message.error_message
            response = message.infer_response
            out.append((response.id[-1:], response.raw_output_contents[0]))  # the step, the running sum
        return sorted(out)

    assert sums(through) == sums(direct)


@pytest.fixture(scope="module")
def own_addresses(faults_path: Path) -> Iterator[tuple[str, str]]:
    """A Triton of the module's own, and a gateway in front of it, for the calls Triton is sent a
    deadline or a cancel on straight: Triton 2.51 can crash on those (``grpc.upstream``), and the
    session's Triton serves every other test of the worker."""
    with LocalTriton.on_free_ports(models=("qc",), faults_file=faults_path) as triton:
        settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url)
        with GatewayThread(settings):
            yield triton.grpc_url, f"127.0.0.1:{settings.grpc_port}"


def test_deadlines(own_addresses: tuple[str, str], faults: Faults) -> None:
    """A call that outlives the client's deadline ends DEADLINE_EXCEEDED either way."""
    addresses = own_addresses
    faults.set("qc", "1", delay_ms=1500)
    raw = qc_request("1").SerializeToString()
    direct, through = (unary(address, SERVICE + "ModelInfer", raw, timeout=0.3) for address in addresses)
    assert direct[0] == "DEADLINE_EXCEEDED" and through[0] == direct[0]


def test_cancellation(own_addresses: tuple[str, str], faults: Faults) -> None:
    """A call the client cancels ends CANCELLED either way, and the next call is served."""
    addresses = own_addresses
    faults.set("qc", "1", delay_ms=800)
    raw = qc_request("1").SerializeToString()
    codes = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            future = channel.unary_unary(SERVICE + "ModelInfer", request_serializer=None,
                                         response_deserializer=None).future(raw, timeout=10)
            threading.Timer(0.2, future.cancel).start()
            try:
                future.result()
                codes.append("OK")
            except grpc.FutureCancelledError:
                codes.append("CANCELLED")
    assert codes == ["CANCELLED", "CANCELLED"]
    faults.clear()
    direct, through = (unary(address, SERVICE + "ModelInfer", qc_request().SerializeToString())
                       for address in addresses)
    assert through == direct and direct[0] == "OK"
