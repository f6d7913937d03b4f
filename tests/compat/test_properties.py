"""A differential property (issue 22 item 3): for generated valid KServe-v2 infer requests, over
HTTP and over gRPC, the gateway's answer is Triton's own answer (status, body metadata, body:
results and error messages alike; gRPC: status, details, trailing metadata, the response
message), except what ``differences`` lists.

Valid means valid for the protocol: shapes, datatypes and values that agree with each other,
JSON or the binary tensor extension, request parameters and requested outputs; not
necessarily what the model takes (a wrong datatype or input name is a request Triton answers
with its own error, which the gateway must pass on unchanged). ``FUZZ_EXAMPLES`` sets the
number of examples (25 by default, derandomised so CI replays the same ones; ``make fuzz``
runs 5,000 with fresh ones).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from tests.compat.http_compare import assert_same, both
from tests.compat.test_grpc import SERVICE, unary
from tests.support import GatewayThread

pytestmark = [pytest.mark.triton, pytest.mark.property]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))

# datatype -> (struct code for the binary form, JSON values)
DATATYPES: dict[str, tuple[str, st.SearchStrategy[Any]]] = {
    "FP32": ("f", st.floats(width=32, allow_nan=False, allow_infinity=False)),
    "FP64": ("d", st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)),
    "INT32": ("i", st.integers(-(2**31), 2**31 - 1)),
    "INT64": ("q", st.integers(-(2**63), 2**63 - 1)),
    "UINT8": ("B", st.integers(0, 255)),
    "INT8": ("b", st.integers(-128, 127)),
    "BOOL": ("?", st.booleans()),
    "BYTES": ("", st.text(max_size=8)),
}


@st.composite
def tensors(draw: st.DrawFn) -> tuple[dict[str, Any], bytes | None]:
    """One input tensor: its JSON description, and its bytes when sent in binary form."""
    datatype = draw(st.sampled_from(sorted(DATATYPES)) if draw(st.booleans()) else st.just("FP32"))
    name = draw(st.sampled_from(["INPUT0", "INPUT0", "INPUT0", "INPUT1", "input"]))
    shape = draw(st.one_of(st.just([1, 4]), st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    count = math.prod(shape)
    code, values = DATATYPES[datatype]
    data = draw(st.lists(values, min_size=count, max_size=count))
    tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if draw(st.booleans()):  # the binary tensor extension
        raw = b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in data) if datatype == "BYTES" \
            else struct.pack(f"<{count}{code}", *data)
        tensor["parameters"] = {"binary_data_size": len(raw)}
        return tensor, raw
    tensor["data"] = data
    return tensor, None


@st.composite
def infer_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    version = draw(st.sampled_from(["", "", "1", "2", "3"]))
    path = f"/v2/models/qc/versions/{version}/infer" if version else "/v2/models/qc/infer"
    inputs = draw(st.lists(tensors(), min_size=1, max_size=2))
    header: dict[str, Any] = {"inputs": [tensor for tensor, _ in inputs]}
    if draw(st.booleans()):
        header["id"] = draw(st.text(max_size=12))
    if draw(st.booleans()):
        header["parameters"] = draw(st.dictionaries(
            st.sampled_from(["binary_data_output", "priority", "custom", "x"]),
            st.one_of(st.booleans(), st.integers(0, 3), st.text(max_size=6)), max_size=2))
    if draw(st.booleans()):
        header["outputs"] = [{"name": draw(st.sampled_from(["OUTPUT0", "OUTPUT1"])),
                              "parameters": {"binary_data": draw(st.booleans())}}]
    text = json.dumps(header).encode()
    binary = b"".join(raw for _, raw in inputs if raw is not None)
    headers = {"Content-Type": "application/json"}
    if binary:
        headers = {"Inference-Header-Content-Length": str(len(text)), "Content-Type": "application/octet-stream"}
    return path, text + binary, headers


@settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=infer_requests())
def test_generated_infer_requests_get_tritons_own_answer(triton: LocalTriton, gateway: GatewayThread,
                                                         request: tuple[str, bytes, dict[str, str]]) -> None:
    path, data, headers = request
    direct, through = both(triton.http_url, gateway.url, "POST", path, data, headers)
    assert_same(direct, through, f"{path} {data[:300]!r}")


# datatype -> the typed contents field of an InferTensorContents that carries it
CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT32": "int_contents", "INT8": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "BOOL": "bool_contents", "BYTES": "bytes_contents"}


@st.composite
def grpc_infer_requests(draw: st.DrawFn) -> bytes:
    """A ModelInferRequest made of the same tensors, each as typed contents or in
    ``raw_input_contents`` (mixing the two is a request Triton refuses itself)."""
    request = service_pb2.ModelInferRequest(model_name="qc", model_version=draw(st.sampled_from(["", "1", "2", "3"])))
    for tensor, raw in draw(st.lists(tensors(), min_size=1, max_size=2)):
        added = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if raw is not None:
            request.raw_input_contents.append(raw)
            continue
        values = tensor["data"]
        if tensor["datatype"] == "BYTES":
            values = [value.encode() for value in values]
        getattr(added.contents, CONTENTS[tensor["datatype"]]).extend(values)
    if draw(st.booleans()):
        request.id = draw(st.text(max_size=12))
    for key in draw(st.lists(st.sampled_from(["priority", "custom", "x"]), max_size=2, unique=True)):
        value = draw(st.one_of(st.booleans(), st.integers(0, 3), st.text(max_size=6)))
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = value
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["OUTPUT0", "OUTPUT1"])))
    serialized: bytes = request.SerializeToString()
    return serialized


@settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=grpc_infer_requests())
def test_generated_grpc_infer_requests_get_tritons_own_answer(triton: LocalTriton, gateway: GatewayThread,
                                                              raw: bytes) -> None:
    direct = unary(triton.grpc_url, SERVICE + "ModelInfer", raw)
    through = unary(f"127.0.0.1:{gateway.settings.grpc_port}", SERVICE + "ModelInfer", raw)
    what = repr(service_pb2.ModelInferRequest.FromString(raw))[:300]
    assert through[:2] == direct[:2] and through[3] == direct[3], what
    assert service_pb2.ModelInferResponse.FromString(through[2]) == service_pb2.ModelInferResponse.FromString(
        direct[2]), what
