"""Whose fault an error is, judged on what the real Triton answers (issue 23, item 1).

The malformed requests below are the ones found by sending them to Triton itself: some come
back as HTTP 500 / gRPC INTERNAL (a body Triton could not parse), and in a ModelStreamInfer
reply only Triton's words are left. Every one of them is the client's error; the sample
model's injected fault stays the version's. A request that runs out of the deadline the
client set (grpc-timeout) is neither: it is recorded as ``client_deadline`` with its elapsed
time; the gateway's own deadline (``request_timeout_s``) stays the version's error.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from gateway.telemetry.recorder import Outcome
from tests.conftest import Faults
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
X = np.array([[1, 2, 3, 4]], dtype=np.float32).tobytes()
GOOD = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
# (body, the status the real Triton answers it with)
MALFORMED_HTTP = [
    (b"{not json", 500),  # failed to parse the request JSON buffer
    (json.dumps(GOOD).encode()[:-5], 500),  # truncated JSON
    (b"[]", 500),  # Unable to parse 'inputs'
    (json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3]}]}).encode(),
     500),  # Unable to parse 'data': shape does not match
    (json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4], "data": [1, 2, 3, 4]}]}).encode(),
     500),  # Unable to parse 'shape'
    (json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode(), 400),
    (json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [9, 4], "data": [1] * 36}]}).encode(),
     400),
]


@pytest.fixture(scope="module", params=["lean", "grpcio"])
def gateway(triton: LocalTriton, request: pytest.FixtureRequest) -> Iterator[GatewayThread]:
    """Both gRPC servers: ours (the default) and grpcio's."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, request_timeout_s=1.0,
                                grpc_server=request.param, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def counts(gw: GatewayThread, version: str = "2") -> dict[Outcome, int]:
    return {outcome: n for outcome, n in gw.app.recorder.outcome_totals().get(("qc", version), {}).items() if n}


def _since(before: dict[Outcome, int], after: dict[Outcome, int]) -> str:
    """The outcomes counted between two reads, by name (pytest cuts a long dict's repr)."""
    return ", ".join(f"{o.value} +{after.get(o, 0) - before.get(o, 0)}" for o in Outcome
                     if after.get(o, 0) != before.get(o, 0)) or "none"


def post(gw: GatewayThread, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{gw.url}/v2/models/qc/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def infer_request(name: str = "INPUT0", shape: tuple[int, ...] = (1, 4), raw: bytes = X) -> Any:
    request = service_pb2.ModelInferRequest(model_name="qc")
    request.inputs.add(name=name, datatype="FP32", shape=list(shape))
    request.raw_input_contents.append(raw)
    return request


def test_malformed_http_bodies_are_the_clients_errors_even_when_triton_answers_500(gateway: GatewayThread) -> None:
    before = counts(gateway)
    for body, status in MALFORMED_HTTP:
        answered, text = post(gateway, body)
        assert answered == status, (body[:40], answered, text)
    after = counts(gateway)
    assert after.get(Outcome.CLIENT_ERROR, 0) - before.get(Outcome.CLIENT_ERROR, 0) == len(MALFORMED_HTTP)
    assert after.get(Outcome.UPSTREAM_ERROR, 0) == before.get(Outcome.UPSTREAM_ERROR, 0), after


def test_an_injected_fault_stays_the_versions_error_on_both_protocols(gateway: GatewayThread, faults: Faults) -> None:
    faults.set("qc", "2", error_rate=1.0)
    before = counts(gateway)
    assert post(gateway, json.dumps(GOOD).encode())[0] == 500
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as failed:
        stub.ModelInfer(infer_request(), timeout=10)
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    replies = list(stub.ModelStreamInfer(iter([infer_request()]), timeout=10))
    channel.close()
    assert replies[0].error_message.startswith("injected fault")
    assert counts(gateway).get(Outcome.UPSTREAM_ERROR, 0) - before.get(Outcome.UPSTREAM_ERROR, 0) == 3


def test_malformed_grpc_requests_in_and_out_of_a_stream_are_the_clients_errors(gateway: GatewayThread) -> None:
    bad = [infer_request(name="X"), infer_request(shape=(1, 5)), infer_request(raw=X[:8]),
           service_pb2.ModelInferRequest(model_name="qc")]
    before = counts(gateway)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    for request in bad:
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(request, timeout=10)
    replies = list(stub.ModelStreamInfer(iter([*bad, infer_request()]), timeout=10))
    channel.close()
    assert [bool(r.error_message) for r in replies] == [True] * len(bad) + [False], [r.error_message for r in replies]
    after = counts(gateway)
    assert after.get(Outcome.CLIENT_ERROR, 0) - before.get(Outcome.CLIENT_ERROR, 0) == 2 * len(bad)
    assert after.get(Outcome.UPSTREAM_ERROR, 0) == before.get(Outcome.UPSTREAM_ERROR, 0), after
    assert after.get(Outcome.SUCCESS, 0) - before.get(Outcome.SUCCESS, 0) == 1, "the good one, charged as such"


def test_the_clients_own_deadline_is_not_the_versions_error_but_the_gateways_is(gateway: GatewayThread,
                                                                               faults: Faults) -> None:
    """A client with a 200 ms grpc-timeout, unary and streamed, against a version that takes
    1 s: recorded as client_deadline (never an error), with its elapsed time. The same
    version over HTTP, past the gateway's own request_timeout_s (1 s here, 1.5 s delay): an
    upstream error, as ever."""
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    stub.ModelInfer(infer_request(), timeout=10)  # connected: the short deadlines below are the request's own
    faults.set("qc", "2", delay_ms=1000)
    before = counts(gateway)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as expired:
            stub.ModelInfer(infer_request(), timeout=0.2)
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    requests: queue.Queue[Any] = queue.Queue()
    requests.put(infer_request())

    def stream_requests() -> Iterator[Any]:
        yield requests.get()
        requests.get(timeout=5)  # the stream stays open until its deadline

    with pytest.raises(grpc.RpcError) as expired:
        list(stub.ModelStreamInfer(stream_requests(), timeout=0.2))
    requests.put(None)
    assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    channel.close()
    import time

    deadline = time.monotonic() + 5
    while counts(gateway).get(Outcome.CLIENT_DEADLINE, 0) - before.get(Outcome.CLIENT_DEADLINE, 0) < 4:
        assert time.monotonic() < deadline, f"outcomes since: {_since(before, counts(gateway))}"
        time.sleep(0.05)
    after = counts(gateway)
    assert after.get(Outcome.UPSTREAM_ERROR, 0) == before.get(Outcome.UPSTREAM_ERROR, 0), after
    faults.set("qc", "2", delay_ms=1500)
    assert post(gateway, json.dumps(GOOD).encode())[0] == 504
    assert counts(gateway).get(Outcome.UPSTREAM_ERROR, 0) - after.get(Outcome.UPSTREAM_ERROR, 0) == 1
