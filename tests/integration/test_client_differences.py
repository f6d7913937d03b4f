"""What a client developer meets, as docs/differences.md says it (issue 33 item 7): a gRPC
message over the limit is refused in the gateway's words, naming the setting (it said "message
of N bytes is above the limit": no `gateway:`, no setting); the `x-gateway-*` keys are initial
metadata of an answer with a message and trailing metadata of an error (the README said
initial for both)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
LIMIT = 1 << 20  # the default is 64 MiB: the words are the same, the test sends 2 MiB instead of 70


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_max_message_bytes=LIMIT,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def infer(gateway: GatewayThread, values: np.ndarray[Any, Any], name: str = "INPUT0") -> tuple[
        service_pb2.ModelInferResponse | None, grpc.Call | grpc.RpcError]:
    request = service_pb2.ModelInferRequest(model_name="qc", inputs=[service_pb2.ModelInferRequest.InferInputTensor(
        name=name, datatype="FP32", shape=[1, values.size])], raw_input_contents=[values.astype(np.float32).tobytes()])
    with grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}", options=[
            ("grpc.max_send_message_length", -1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            response, call = stub.ModelInfer.with_call(request, timeout=30)
        except grpc.RpcError as error:
            return None, error
    return response, call


def test_a_message_over_the_limit_is_refused_in_the_gateways_words(gateway: GatewayThread) -> None:
    _, error = infer(gateway, np.zeros(2 * LIMIT // 4))
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    details = error.details() or ""
    assert details.startswith("gateway: ") and "grpc_max_message_bytes" in details, details


def keys(metadata: object) -> set[str]:
    return {key for key, _ in metadata or ()}  # type: ignore[attr-defined]


def test_routing_keys_are_initial_metadata_of_an_answer_and_trailing_metadata_of_an_error(
        gateway: GatewayThread) -> None:
    response, call = infer(gateway, np.arange(4))
    assert response is not None and isinstance(call, grpc.Call)
    assert {"x-gateway-route", "x-gateway-model-version"} <= keys(call.initial_metadata())
    _, error = infer(gateway, np.arange(4), name="NO_SUCH_INPUT")
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "x-gateway-route" in keys(error.trailing_metadata()), error.trailing_metadata()
    assert "x-gateway-route" not in keys(error.initial_metadata())
