"""The gRPC data path against the real Triton: tritonclient.grpc unchanged."""

from __future__ import annotations

import asyncio
import queue
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.devtools.local_triton import LocalTriton, free_port
from gateway.grpc.upstream import GrpcUpstream
from tests.conftest import Faults
from tests.support import TOKEN, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton
X = np.array([[1, 2, 3, 4]], dtype=np.float32)


@pytest.fixture(scope="module", params=["lean", "grpcio"])
def gateway(triton: LocalTriton, request: pytest.FixtureRequest) -> Iterator[GatewayThread]:
    """Every test below runs against both gRPC servers: ours (the default) and grpcio's."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                grpc_server=request.param,
                                policies={"qc": {"weights": {"2": 80, "3": 20},
                                                 "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]},
                                          "tok": {"weights": {"1": 100}}})
    with GatewayThread(settings) as running:
        yield running


def grpc_url(gw: GatewayThread) -> str:
    return f"127.0.0.1:{gw.settings.grpc_port}"


@pytest.fixture
def client(gateway: GatewayThread) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(url=grpc_url(gateway))
    yield c
    c.close()


def inputs(sequence: dict[str, Any] | None = None) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    return [inp]


def version_of(result: grpcclient.InferResult) -> str:
    version = str(result.get_response().model_version)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X * int(version))
    return version


def test_metadata_calls_pass_through(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("qc") and not client.is_model_ready("nope")
    assert list(client.get_model_metadata("qc").versions) == ["1", "2", "3"]
    assert client.get_model_config("qc").config.max_batch_size == 8
    assert client.get_model_repository_index().models
    assert client.get_inference_statistics("qc").model_stats


def test_infer_is_routed_by_the_policy(client: grpcclient.InferenceServerClient) -> None:
    seen = Counter(version_of(client.infer("qc", inputs())) for _ in range(200))
    assert set(seen) == {"2", "3"} and abs(seen["3"] - 40) <= 2


def test_split_sticky_rules_and_pins(client: grpcclient.InferenceServerClient) -> None:
    assert {version_of(client.infer("qc", inputs(), headers={"x-user-id": "alice"})) for _ in range(30)} \
        .__len__() == 1
    assert all(version_of(client.infer("qc", inputs(), headers={"x-canary": "always"})) == "3" for _ in range(10))
    assert all(version_of(client.infer("qc", inputs(), model_version="1")) == "1" for _ in range(10))


def test_split_over_5000_async_requests(gateway: GatewayThread) -> None:
    async def run() -> Counter[str]:
        client = grpcaio.InferenceServerClient(url=grpc_url(gateway))
        seen: Counter[str] = Counter()

        async def worker() -> None:
            for _ in range(5000 // 16):
                result = await client.infer("qc", inputs())
                seen[str(result.get_response().model_version)] += 1

        await asyncio.gather(*(worker() for _ in range(16)))
        await client.close()
        return seen

    seen = asyncio.run(run())
    total = sum(seen.values())
    assert abs(seen["3"] / total - 0.20) <= 0.02


def test_async_infer_callback(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client.async_infer("qc", inputs(), callback=lambda result, error: results.put((result, error)))
    result, error = results.get(timeout=10)
    assert error is None and version_of(result) in {"2", "3"}


def test_stream_infer(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for _ in range(10):
        client.async_stream_infer("qc", inputs())
    versions = []
    for _ in range(10):
        result, error = results.get(timeout=10)
        assert error is None
        versions.append(version_of(result))
    client.stop_stream()
    assert set(versions) <= {"2", "3"}


def test_decoupled_stream_of_tokens(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    count = grpcclient.InferInput("max_tokens", [1], "INT32")
    count.set_data_from_numpy(np.array([3], dtype=np.int32))
    client.async_stream_infer("tok", [text, count])
    tokens = [results.get(timeout=10)[0].as_numpy("text_output")[0] for _ in range(3)]
    client.stop_stream()
    assert tokens == [b"v1:0", b"v1:1", b"v1:2"]


def test_sequences_stay_on_their_version_while_weights_move(gateway: GatewayThread,
                                                            client: grpcclient.InferenceServerClient) -> None:
    # forced on: qc has no sequence batcher, so "auto" (the default) would leave it off
    policy = {"weights": {"2": 100}, "sequence_affinity": True}
    assert admin_call(gateway.url, "PUT", "/admin/models/qc/policy", policy)[0] == 200
    try:
        first = version_of(client.infer("qc", inputs(), sequence_id=4242, sequence_start=True))
        assert first == "2"
        admin_call(gateway.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}})
        middle = version_of(client.infer("qc", inputs(), sequence_id=4242))
        last = version_of(client.infer("qc", inputs(), sequence_id=4242, sequence_end=True))
        assert (middle, last) == ("2", "2"), "the sequence finished where it started"
        assert version_of(client.infer("qc", inputs(), sequence_id=5151, sequence_start=True)) == "3"
        assert version_of(client.infer("qc", inputs())) == "3", "new traffic follows the new weights"
    finally:
        admin_call(gateway.url, "PUT", "/admin/models/qc/policy",
                   {"weights": {"2": 80, "3": 20}, "rules": [{"header": "x-canary", "equals": "always",
                                                              "version": "3"}]})


def test_response_metadata_names_version_and_route(gateway: GatewayThread) -> None:
    channel = grpc.insecure_channel(grpc_url(gateway))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="qc")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    assert tensor is not None
    request.raw_input_contents.append(X.tobytes())
    response, call = stub.ModelInfer.with_call(request, metadata=(("x-canary", "always"),))
    metadata = dict(call.initial_metadata())
    assert metadata["x-gateway-model-version"] == "3" == response.model_version
    assert metadata["x-gateway-route"] == "rule"
    channel.close()


def test_errors_pass_through_and_are_classified(gateway: GatewayThread, client: grpcclient.InferenceServerClient,
                                                faults: Faults) -> None:
    with pytest.raises(InferenceServerException) as missing:
        client.infer("nope", inputs())
    assert "StatusCode.NOT_FOUND" in str(missing.value.status())
    bad = grpcclient.InferInput("WRONG", [1, 4], "FP32")
    bad.set_data_from_numpy(X)
    # routed by the policy, so judged (a version the client names is counted, never judged)
    assert admin_call(gateway.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})[0] == 200
    with pytest.raises(InferenceServerException) as invalid:
        client.infer("qc", [bad])
    assert "INVALID_ARGUMENT" in str(invalid.value.status())
    faults.set("qc", "3", error_rate=1.0)
    assert admin_call(gateway.url, "PUT", "/admin/models/qc/policy", {"weights": {"3": 100}})[0] == 200
    with pytest.raises(InferenceServerException, match="injected fault"):
        client.infer("qc", inputs())
    recorder = gateway.app.recorder
    codes = {(label[1], label[3], label[4]) for label in recorder.totals if label[3] == "grpc"}
    assert ("2", "grpc", "INVALID_ARGUMENT") in codes
    stable, canary = recorder.window("qc", "2", 60), recorder.window("qc", "3", 60)
    assert (stable.errors, stable.client_errors) == (0, 1), "client mistakes never count as a version's errors"
    assert canary.errors == 1
    with pytest.raises(InferenceServerException, match="injected fault"):
        client.infer("qc", inputs(), model_version="3")
    assert recorder.window("qc", "3", 60).errors == 1, "the client named the version: not judged"
    assert recorder.totals[("qc", "3", "pinned", "grpc", "INTERNAL")].count == 1


def test_deadline_propagates(client: grpcclient.InferenceServerClient, faults: Faults) -> None:
    faults.set("qc", "3", delay_ms=1500)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("qc", inputs(), model_version="3", client_timeout=0.3)
    assert "DEADLINE_EXCEEDED" in str(caught.value.status())
    assert time.monotonic() - started < 1.0


def test_a_cancelled_call_is_left_to_finish_upstream_never_reset(gateway: GatewayThread, faults: Faults,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's cancel is counted at once, and its call is left to finish on Triton, its answer
    dropped: Triton 2.51 crashes on resets of its gRPC calls (grpc.upstream; the gateway passed
    its clients' resets on, and 335-2,100 unary calls or 26-2,760 streams cancelled through it
    killed the Triton behind it)."""
    faults.set("qc", "3", delay_ms=1500)
    channel = grpc.insecure_channel(grpc_url(gateway))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="qc", model_version="3")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(X.tobytes())
    label = ("qc", "3", "pinned", "grpc", "CANCELLED")
    before = gateway.app.recorder.totals[label].count if label in gateway.app.recorder.totals else 0
    future = stub.ModelInfer.future(request)
    time.sleep(0.3)
    assert gateway.app.grpc_router is not None
    server = gateway.app.fleets.default.single  # the one Triton server of the default fleet
    assert server is not None
    assert isinstance(server.grpc, GrpcUpstream)  # the app's grpc_connect makes them
    connection = server.grpc._connection
    assert connection is not None and len(connection.streams) == 1, "the call should be in flight upstream"
    assert gateway.app.recorder.inflight[("qc", "3")] == 1, "an unload's drain has to see gRPC calls too"
    resets: list[int] = []
    monkeypatch.setattr(connection, "reset", lambda stream, code=0: resets.append(stream.id))
    future.cancel()
    cancelled = time.monotonic()
    wait_for(lambda: gateway.app.recorder.totals.get(label) is not None
             and gateway.app.recorder.totals[label].count == before + 1, 1.0, interval=0.02,
             what="the cancel to be counted, well before Triton's 1.5 s answer")
    assert gateway.app.recorder.inflight[("qc", "3")] == 0
    assert len(connection.streams) == 1 and time.monotonic() - cancelled < 1.0, "the call is left running upstream"
    assert server.inflight == 1, "its admission slot stays taken while Triton works on it"
    wait_for(lambda: not connection.streams, 10, interval=0.02, what="Triton's answer to end the call upstream")
    assert resets == [], "no reset reached Triton"
    assert server.inflight == 0, "its admission slot came back as Triton answered"
    channel.close()


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_triton_down_gives_unavailable_then_recovers(server: str) -> None:
    triton = LocalTriton.on_free_ports(models=("qc",)).start()
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=server,
                                policies={"qc": {"weights": {"2": 100}}})
    try:
        with GatewayThread(settings) as gw:
            client = grpcclient.InferenceServerClient(url=grpc_url(gw))
            assert version_of(client.infer("qc", inputs())) == "2"
            first_prefix = triton.shm_prefix
            triton.stop()
            started = time.monotonic()
            with pytest.raises(InferenceServerException) as caught:
                client.infer("qc", inputs(), client_timeout=10)
            assert "UNAVAILABLE" in str(caught.value.status())
            message = str(caught.value.message())
            assert message.startswith("gateway: ") and "127.0.0.1" not in message, message
            assert time.monotonic() - started < 5
            triton.start()
            # its Python-backend regions are named anew: a restart on the same ports never meets the old ones
            assert triton.shm_prefix != first_prefix and not list(Path("/dev/shm").glob(f"{first_prefix}*"))
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert version_of(client.infer("qc", inputs(), client_timeout=5)) == "2"
                    break
                except InferenceServerException:
                    assert time.monotonic() < deadline, "gRPC did not recover without a gateway restart"
                    time.sleep(0.3)
            client.close()
    finally:
        triton.stop()


def test_gateway_grpc_port_is_configurable() -> None:
    port = free_port()
    settings = gateway_settings("http://127.0.0.1:1", grpc_port=port)
    assert settings.grpc_port == port and settings.triton_grpc_url == "127.0.0.1:8001"


def test_pinned_and_default_routes_are_announced(gateway: GatewayThread) -> None:
    """Issue 11: gRPC used to withhold the routing metadata of pinned and default routes; it now
    carries them exactly as HTTP does (see the HTTP test of the same name)."""
    channel = grpc.insecure_channel(grpc_url(gateway))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def announced(version: str) -> tuple[dict[str, str], str]:
        request = service_pb2.ModelInferRequest(model_name="qc", model_version=version)
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(X.tobytes())
        response, call = stub.ModelInfer.with_call(request)
        return dict(call.initial_metadata()), response.model_version

    metadata, answered = announced("2")
    assert (metadata["x-gateway-route"], metadata["x-gateway-model-version"], answered) == ("pinned", "2", "2")
    assert admin_call(gateway.url, "DELETE", "/admin/models/qc/policy")[0] == 200
    try:
        metadata, answered = announced("")
        assert (metadata["x-gateway-route"], metadata["x-gateway-model-version"]) == ("default", answered)
        assert answered == "3", "Triton's default is its newest version"
    finally:
        admin_call(gateway.url, "PUT", "/admin/models/qc/policy",
                   {"weights": {"2": 80, "3": 20}, "rules": [{"header": "x-canary", "equals": "always",
                                                              "version": "3"}]})
    channel.close()
