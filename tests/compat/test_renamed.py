"""A renamed target, compared with Triton: ``qc -> {qc_2026_12: 100}`` and ``chat -> {tok: 100}``.

Each call is sent to Triton naming the model that answers (``qc_2026_12``, ``tok``) and through
the gateway naming the policy's model (``qc``, ``chat``). The answers must be Triton's, byte
for byte (gRPC: message for message), with only the documented difference "renamed targets"
applied, written here on its own from Triton's answer: the model's name in the answer's JSON
(``"model_name"``, metadata's and config's ``"name"``), in Triton's error texts (``'...'``),
in gRPC's ``model_name`` / ``name`` fields and status details, and the framing that follows
(Inference-Header-Content-Length).
"""

from __future__ import annotations

import gzip
import json
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from tests.compat.http_compare import Answer, assert_same, call
from tests.compat.test_grpc import SERVICE, qc_request, stream, tok_request, unary
from tests.support import TOKEN, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
JSON = {"Content-Type": "application/json"}
RENAMED = {"qc": "qc_2026_12", "chat": "tok"}  # the name called -> the model that answers


@pytest.fixture(scope="module")
def gateway(target_models: LocalTriton) -> Iterator[GatewayThread]:
    triton = target_models
    policies = {called: {"weights": {answering: 100}} for called, answering in RENAMED.items()}
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN, policies=policies)
    with GatewayThread(settings) as running:
        yield running


def expected(direct: Answer, called: str) -> Answer:
    """Triton's answer as the client of ``called`` sees it (the documented difference, nothing else)."""
    answering = RENAMED[called]
    body = direct.body
    head_length = int(direct.headers.get("inference-header-content-length", 0)) or len(body)
    head, tail = body[:head_length], body[head_length:]
    for old, new in ((f'"model_name":"{answering}"', f'"model_name":"{called}"'),
                     (f'{{"name":"{answering}"', f'{{"name":"{called}"'), (f"'{answering}'", f"'{called}'")):
        head = head.replace(old.encode(), new.encode())
    headers = dict(direct.headers)
    if "inference-header-content-length" in headers:
        headers["inference-header-content-length"] = str(len(head))
    return Answer(direct.status, headers, head + tail, {})


def compare(triton: LocalTriton, gateway: GatewayThread, method: str, path: str, data: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[Answer, Answer]:
    called = path.split("/")[3]
    direct = call(triton.http_url, method, path.replace(f"/{called}", f"/{RENAMED[called]}", 1), data, headers)
    through = call(gateway.url, method, path, data, headers)
    assert_same(expected(direct, called), through, f"{method} {path}")
    return direct, through


QC = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
HTTP_CALLS: list[tuple[str, str, str, Any]] = [
    ("metadata", "GET", "/v2/models/qc", None),
    ("ready", "GET", "/v2/models/qc/ready", None),
    ("config", "GET", "/v2/models/qc/config", None),
    ("json", "POST", "/v2/models/qc/infer", QC),
    ("request id and parameters", "POST", "/v2/models/qc/infer", {**QC, "id": "r-1", "parameters": {"priority": 0}}),
    ("binary_data_output", "POST", "/v2/models/qc/infer", {**QC, "parameters": {"binary_data_output": True}}),
    ("wrong shape", "POST", "/v2/models/qc/infer",
     {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}),
    ("unknown input", "POST", "/v2/models/qc/infer",
     {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}),
    ("not JSON", "POST", "/v2/models/qc/infer", "{not json"),
    ("generate", "POST", "/v2/models/chat/generate", {"text_input": "hi", "max_tokens": 1}),
    ("generate, bad field", "POST", "/v2/models/chat/generate", {"text_input": "hi", "max_tokens": "x"}),
    ("generate_stream", "POST", "/v2/models/chat/generate_stream", {"text_input": "hi", "max_tokens": 3}),
    ("infer of a decoupled model", "POST", "/v2/models/chat/infer",
     {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}),
]


@pytest.mark.parametrize(("what", "method", "path", "document"), HTTP_CALLS, ids=[c[0] for c in HTTP_CALLS])
def test_http_answers_are_tritons_with_the_called_name(target_models: LocalTriton, gateway: GatewayThread, what: str,
                                                       method: str, path: str, document: Any) -> None:
    data = None if document is None else document.encode() if isinstance(document, str) else json.dumps(
        document).encode()
    direct, through = compare(target_models, gateway, method, path, data, JSON if data else None)
    called = path.split("/")[3]
    if what == "config":  # the stable target's configuration: its instance groups keep Triton's names
        assert json.loads(through.body)["name"] == called
    else:
        assert RENAMED[called].encode() not in through.body, through.body[:300]
    if method == "POST":
        assert through.routing["x-gateway-model-version"] == RENAMED[called]


def test_binary_tensors_both_ways(target_models: LocalTriton, gateway: GatewayThread) -> None:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    data = header + struct.pack("<4f", 1, 2, 3, 4)
    direct, _ = compare(target_models, gateway, "POST", "/v2/models/qc/infer", data,
                        {"Inference-Header-Content-Length": str(len(header)),
                         "Content-Type": "application/octet-stream"})
    assert "inference-header-content-length" in direct.headers


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_answers_are_renamed_and_compressed_again(target_models: LocalTriton, gateway: GatewayThread,
                                                             encoding: str) -> None:
    """Compressed, the bytes differ (zlib's output is not Triton's): the answers are compared inflated."""
    import zlib

    raw = json.dumps(QC).encode()
    data = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    headers = {"Content-Encoding": encoding, "Accept-Encoding": encoding, **JSON}
    direct = call(target_models.http_url, "POST", "/v2/models/qc_2026_12/infer", data, headers)
    through = call(gateway.url, "POST", "/v2/models/qc/infer", data, headers)
    assert direct.headers["content-encoding"] == through.headers["content-encoding"] == encoding

    def inflated(answer: Answer) -> Answer:
        return Answer(answer.status, answer.headers, zlib.decompress(answer.body, 47), {})

    assert_same(expected(inflated(direct), "qc"), inflated(through), f"{encoding} answer")


def renamed(message: Any, model: str) -> Any:
    copy = type(message)()
    copy.CopyFrom(message)
    if hasattr(copy, "model_name"):
        copy.model_name = model
    else:
        copy.name = model
    return copy


GRPC_CALLS: list[tuple[str, str, Any]] = [
    ("ModelReady", "ModelReady", service_pb2.ModelReadyRequest(name="qc")),
    ("ModelMetadata", "ModelMetadata", service_pb2.ModelMetadataRequest(name="qc")),
    ("ModelConfig", "ModelConfig", service_pb2.ModelConfigRequest(name="qc")),
    ("ModelInfer", "ModelInfer", qc_request()),
    ("ModelInfer wrong shape", "ModelInfer", qc_request(values=[1, 2, 3], shape=(1, 3))),
    ("ModelInfer unknown input", "ModelInfer", qc_request(name="X")),
]


@pytest.mark.parametrize(("what", "method", "request_"), GRPC_CALLS, ids=[c[0] for c in GRPC_CALLS])
def test_grpc_answers_are_tritons_with_the_called_name(target_models: LocalTriton, gateway: GatewayThread, what: str,
                                                       method: str, request_: Any) -> None:
    direct = unary(target_models.grpc_url, SERVICE + method, renamed(request_, "qc_2026_12").SerializeToString())
    through = unary(f"127.0.0.1:{gateway.settings.grpc_port}", SERVICE + method, request_.SerializeToString())
    assert through[0] == direct[0] and through[3] == direct[3], what
    assert through[1] == direct[1].replace("'qc_2026_12'", "'qc'") and "qc_2026_12" not in through[1], what
    response = getattr(service_pb2, f"{method}Response")
    wanted = response.FromString(direct[2])
    if method == "ModelInfer" and direct[0] == "OK":
        wanted.model_name = "qc"
    elif method == "ModelMetadata":
        wanted.name = "qc"
    elif method == "ModelConfig":
        wanted.config.name = "qc"
    assert response.FromString(through[2]) == wanted, what


@pytest.mark.parametrize(("called", "requests", "replies"), [
    ("qc", [qc_request(), qc_request(values=[1, 2, 3], shape=(1, 3)), qc_request(name="X")], 3),
    ("chat", [tok_request(tokens=4)], 4),
], ids=["requests and errors", "a decoupled model"])
def test_streams_are_tritons_with_the_called_name(target_models: LocalTriton, gateway: GatewayThread, called: str,
                                                  requests: list[Any], replies: int) -> None:
    answering = RENAMED[called]
    direct = stream(target_models.grpc_url, [renamed(r, answering) for r in requests], replies)
    through = stream(f"127.0.0.1:{gateway.settings.grpc_port}", [renamed(r, called) for r in requests], replies)
    assert len(direct) == replies
    wanted = []
    for raw in direct:
        message = service_pb2.ModelStreamInferResponse.FromString(raw)
        message.error_message = message.error_message.replace(f"'{answering}'", f"'{called}'")
        if message.infer_response.model_name == answering:
            message.infer_response.model_name = called
        wanted.append(message)
    assert [service_pb2.ModelStreamInferResponse.FromString(raw) for raw in through] == wanted
    assert not any(answering.encode() in raw for raw in through)
