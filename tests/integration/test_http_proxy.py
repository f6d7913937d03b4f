"""The HTTP data path against the real Triton: tritonclient unchanged, splits, pins, streams."""

from __future__ import annotations

import gzip
import json
import struct
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from gateway.devtools.local_triton import LocalTriton
from tests.support import INFER_BODY, GatewayThread, drive, gateway_settings, get_json

pytestmark = pytest.mark.triton

POLICIES = {
    "qc": {"weights": {"2": 80, "3": 20}, "sticky_header": "x-user-id",
           "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]},
    "tok": {"weights": {"1": 100}},
}


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with GatewayThread(gateway_settings(triton.http_url, policies=POLICIES)) as running:
        yield running


@pytest.fixture
def client(gateway: GatewayThread) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(url=gateway.hostport)
    yield c
    c.close()


def infer(client: httpclient.InferenceServerClient, binary: bool, **kwargs: object) -> httpclient.InferResult:
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    return client.infer("qc", [inp], outputs=[out], **kwargs)


def test_tritonclient_metadata_calls_work_unchanged(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("qc")
    assert client.get_model_metadata("qc")["versions"] == ["1", "2", "3"]
    assert client.get_model_config("qc")["max_batch_size"] == 8
    assert client.get_server_metadata()["name"] == "triton"
    assert any(m["name"] == "qc" for m in client.get_model_repository_index())
    assert client.get_inference_statistics("qc")["model_stats"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_infer_output_identifies_the_routed_version(client: httpclient.InferenceServerClient,
                                                                 binary: bool) -> None:
    seen = set()
    for _ in range(40):
        result = infer(client, binary)
        version = result.get_response()["model_version"]
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.array([[1, 2, 3, 4]]) * int(version))
        seen.add(version)
    assert seen <= {"2", "3"} and "2" in seen


def test_split_80_20_over_10000_anonymous_requests(gateway: GatewayThread) -> None:
    import asyncio

    result = asyncio.run(drive(gateway.url, 10_000, concurrency=16))
    assert result.statuses == {200: 10_000}, result.failures[:3]
    assert abs(result.share("2") - 0.80) <= 0.02 and abs(result.share("3") - 0.20) <= 0.02


def test_half_percent_canary_gets_half_percent_of_10000(triton: LocalTriton) -> None:
    import asyncio

    settings = gateway_settings(triton.http_url, policies={"qc": {"weights": {"2": 99.5, "3": 0.5}}})
    with GatewayThread(settings) as gw:
        result = asyncio.run(drive(gw.url, 10_000, concurrency=16))
    assert result.statuses == {200: 10_000}
    assert 0.003 <= result.share("3") <= 0.007


def test_sticky_users_keep_their_version(gateway: GatewayThread) -> None:
    import asyncio

    result = asyncio.run(drive(gateway.url, 400, concurrency=8, headers_for=lambda i: {"x-user-id": "user-17"}))
    assert len(result.versions) == 1 and result.total == 400


def test_header_rule_and_response_headers(gateway: GatewayThread) -> None:
    request = urllib.request.Request(f"{gateway.url}/v2/models/qc/infer", data=INFER_BODY,
                                     headers={"x-canary": "always"})
    with urllib.request.urlopen(request) as response:
        assert response.headers["x-gateway-model-version"] == "3"
        assert response.headers["x-gateway-route"] == "rule"
        assert json.loads(response.read())["model_version"] == "3"


@pytest.mark.parametrize("version", ["1", "2", "3"])
def test_pinned_requests_are_never_rerouted(client: httpclient.InferenceServerClient, version: str) -> None:
    for _ in range(20):
        result = infer(client, True, model_version=version, headers={"x-canary": "always"})
        assert result.get_response()["model_version"] == version


def test_binary_body_with_gzip_passes_through_untouched(gateway: GatewayThread) -> None:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    body = gzip.compress(header + struct.pack("<4f", 1, 2, 3, 4))
    request = urllib.request.Request(f"{gateway.url}/v2/models/qc/versions/2/infer", data=body, headers={
        "Inference-Header-Content-Length": str(len(header)), "Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request) as response:
        raw = response.read()
        assert response.headers["Content-Encoding"] == "gzip"
        ihcl = int(response.headers["Inference-Header-Content-Length"])
    plain = gzip.decompress(raw)
    assert json.loads(plain[:ihcl])["model_version"] == "2"
    assert struct.unpack("<4f", plain[ihcl:]) == (2.0, 4.0, 6.0, 8.0)


def test_chunked_request_body_is_streamed_upstream(gateway: GatewayThread) -> None:
    def chunks() -> Iterator[bytes]:
        yield INFER_BODY[:20]
        yield INFER_BODY[20:]

    request = urllib.request.Request(f"{gateway.url}/v2/models/qc/infer", data=chunks(),
                                     headers={"Transfer-Encoding": "chunked"})
    with urllib.request.urlopen(request) as response:
        assert json.loads(response.read())["model_version"] in {"2", "3"}


def test_generate_stream_relays_each_event_as_it_is_produced(gateway: GatewayThread) -> None:
    body = json.dumps({"text_input": "hi", "max_tokens": 4, "delay_ms": 400}).encode()
    request = urllib.request.Request(f"{gateway.url}/v2/models/tok/generate_stream", data=body)
    started = time.monotonic()
    events: list[tuple[float, dict[str, str]]] = []
    with urllib.request.urlopen(request) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["x-gateway-model-version"] == "1"
        for line in response:
            if line.startswith(b"data:"):
                events.append((time.monotonic() - started, json.loads(line[5:])))
    assert [e["text_output"] for _, e in events] == ["v1:0", "v1:1", "v1:2", "v1:3"]
    # the model sends token 3 after three 400 ms pauses: a relay that held the events back would
    # deliver token 0 no sooner than 1.2 s; any earlier shows it was relayed before (not 0.8 s:
    # a bound on how fast a loaded machine answers, beyond what the property asks)
    assert events[0][0] < 1.2, "the first token reached the client before the model produced the last"
    assert events[-1][0] >= 1.1


def test_generate_is_routed_like_infer(gateway: GatewayThread) -> None:
    body = json.dumps({"text_input": "hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{gateway.url}/v2/models/tok/generate", data=body)
    with urllib.request.urlopen(request) as response:
        assert json.loads(response.read())["text_output"] == "v1:0"


def test_unknown_model_gets_tritons_answer(gateway: GatewayThread) -> None:
    status, body = get_json(f"{gateway.url}/v2/models/nope")
    assert status == 404 and "unknown model" in body["error"]
    request = urllib.request.Request(f"{gateway.url}/v2/models/nope/infer", data=INFER_BODY)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request)
    assert caught.value.code == 404 and "nope" in json.loads(caught.value.read())["error"]


def test_tritons_own_4xx_passes_through_unchanged(gateway: GatewayThread, triton: LocalTriton) -> None:
    bad = json.dumps({"inputs": [{"name": "WRONG", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    answers = []
    for base in (gateway.url, triton.http_url):
        request = urllib.request.Request(f"{base}/v2/models/qc/versions/2/infer", data=bad.encode())
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        answers.append((caught.value.code, caught.value.read()))
    assert answers[0] == answers[1] and answers[0][0] == 400


def test_health_endpoints(gateway: GatewayThread) -> None:
    assert get_json(f"{gateway.url}/healthz") == (200, {"status": "alive"})
    status, body = get_json(f"{gateway.url}/readyz")
    assert status == 200 and body["policies"] == ["qc", "tok"]


def test_pinned_and_default_routes_are_announced(triton: LocalTriton) -> None:
    """The same routing headers as the gRPC test of the same name: a pinned version, and
    Triton's default version for a model without a policy (the version its body names)."""
    with GatewayThread(gateway_settings(triton.http_url)) as gw:
        for path, route in (("/v2/models/qc/versions/2/infer", "pinned"), ("/v2/models/qc/infer", "default")):
            with urllib.request.urlopen(urllib.request.Request(gw.url + path, data=INFER_BODY)) as response:
                answered = json.loads(response.read())["model_version"]
                assert response.headers["x-gateway-route"] == route
                assert response.headers["x-gateway-model-version"] == answered
        assert answered == "3", "Triton's default is its newest version"
