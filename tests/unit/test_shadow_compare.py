"""How the shadow decides that two answers agree: same outputs, values within tolerance."""

from __future__ import annotations

import json

import numpy as np
from tritonclient.grpc import service_pb2

from gateway.proxy.shadow import agree, agree_grpc


def http_answer(values: list[float], name: str = "OUTPUT0", datatype: str = "FP32") -> bytes:
    return json.dumps({"outputs": [{"name": name, "datatype": datatype, "shape": [1, len(values)],
                                    "data": values}]}).encode()


def grpc_answer(values: list[float], raw: bool = True, shape: tuple[int, ...] | None = None) -> bytes:
    response = service_pb2.ModelInferResponse(model_name="qc", model_version="2")
    output = response.outputs.add(name="OUTPUT0", datatype="FP32", shape=list(shape or (1, len(values))))
    if raw:
        response.raw_output_contents.append(np.array(values, dtype=np.float32).tobytes())
    else:
        output.contents.fp32_contents.extend(values)
    encoded: bytes = response.SerializeToString()
    return encoded


def test_http_answers() -> None:
    assert agree(http_answer([1.0, 2.0]), http_answer([1.0, 2.0000001]))
    assert not agree(http_answer([1.0, 2.0]), http_answer([1.0, 2.1]))
    assert not agree(http_answer([1.0, 2.0]), http_answer([1.0, 2.0], name="OTHER"))
    assert not agree(http_answer([1.0, 2.0]), http_answer([1.0, 2.0], datatype="FP64"))
    assert not agree(http_answer([1.0]), b"not json")


def test_grpc_answers_raw_and_typed() -> None:
    assert agree_grpc(grpc_answer([1.0, 2.0]), grpc_answer([1.0, 2.0000001]))
    assert agree_grpc(grpc_answer([1.0, 2.0], raw=False), grpc_answer([1.0, 2.0], raw=False))
    assert not agree_grpc(grpc_answer([1.0, 2.0]), grpc_answer([1.0, 3.0]))
    assert not agree_grpc(grpc_answer([1.0, 2.0], raw=False), grpc_answer([1.0, 3.0], raw=False))
    assert not agree_grpc(grpc_answer([1.0, 2.0]), grpc_answer([1.0, 2.0], shape=(2, 1)))
    assert not agree_grpc(grpc_answer([1.0, 2.0]), b"\xff\xff\xff")  # not a protobuf message
