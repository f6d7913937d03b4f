"""A policy that splits between model names, against the real Triton: ``qc -> {qc: 80, qc_2026_12: 20}``.

Every answer says the name the client called (HTTP and gRPC, unary and streaming, answers and
errors), the ``x-gateway-model-version`` header says which target answered, and the outputs
prove it independently: qc's default version (3) multiplies by 3, qc_2026_12's versions by 11
and 12 (deploy/model_repository). Sticky keys, sequences, pins, shadows and named fleets hold
across the names.
"""

from __future__ import annotations

import gzip
import json
import queue
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gateway.devtools.local_triton import LocalTriton
from gateway.routing import bucket
from tests.support import TOKEN, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton
X = np.array([[1, 2, 3, 4]], dtype=np.float32)
# The factor each target multiplies by: which model and version answered, read off the outputs.
FACTORS = {3.0: "qc", 12.0: "qc_2026_12", 11.0: "qc_2026_12@1"}
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode()
BAD_SHAPE = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3],
                                     "data": [1, 2, 3]}]}).encode()


@pytest.fixture(scope="module", params=["lean", "grpcio"])
def gateway(target_models: LocalTriton, request: pytest.FixtureRequest) -> Iterator[GatewayThread]:
    triton = target_models
    green = {"servers": [{"http": triton.http_url, "grpc": triton.grpc_url}]}  # the same Triton as a named fleet
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                grpc_server=request.param, fleets={"green": green}, policies={
        "qc": {"weights": {"qc": 80, "qc_2026_12": 20}, "sequence_affinity": True,
               "rules": [{"header": "x-target", "equals": "new", "version": "qc_2026_12"},
                         {"header": "x-target", "equals": "green", "version": "green:qc_2026_12@1"}],
               "shadow": {"version": "qc_2026_12@1", "percent": 100}},
        "alias": {"weights": {"qc_2026_12@2": 100}},  # a name Triton does not have: its stable target answers
        "chat": {"weights": {"tok": 100}},  # generate_stream, renamed
        "counter": {"weights": {"seq@1": 50, "seq@2": 50}},  # seq batches sequences: auto affinity is on
    })
    with GatewayThread(settings) as running:
        yield running


def http_post(gw: GatewayThread, path: str, body: bytes, headers: dict[str, str] | None = None
              ) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(gw.url + path, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def answered_by(outputs: list[float]) -> str:
    return FACTORS[outputs[0] / float(X[0][0])]


def grpc_client(gw: GatewayThread) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{gw.settings.grpc_port}")


def grpc_inputs(shape: tuple[int, int] = (1, 4)) -> list[grpcclient.InferInput]:
    given = grpcclient.InferInput("INPUT0", list(shape), "FP32")
    given.set_data_from_numpy(np.ones(shape, dtype=np.float32) * X[0][:shape[1]])
    return [given]


def test_every_http_answer_says_qc_and_the_header_says_which_name_answered(gateway: GatewayThread) -> None:
    seen: Counter[str] = Counter()
    for _ in range(100):
        status, headers, body = http_post(gateway, "/v2/models/qc/infer", BODY)
        answer = json.loads(body)
        assert status == 200 and answer["model_name"] == "qc", body
        assert headers["x-gateway-model-version"] == answered_by(answer["outputs"][0]["data"])
        seen[headers["x-gateway-model-version"]] += 1
    assert abs(seen["qc_2026_12"] - 20) <= 2 and seen["qc"] + seen["qc_2026_12"] == 100, seen


def test_every_grpc_answer_says_qc(gateway: GatewayThread) -> None:
    client = grpc_client(gateway)
    seen: Counter[str] = Counter()
    try:
        for _ in range(50):
            result = client.infer("qc", grpc_inputs())
            assert result.get_response().model_name == "qc"
            seen[answered_by(list(result.as_numpy("OUTPUT0")[0]))] += 1
    finally:
        client.close()
    assert abs(seen["qc_2026_12"] - 10) <= 2 and seen["qc"] + seen["qc_2026_12"] == 50, seen


def test_errors_name_the_called_model_on_both_protocols(gateway: GatewayThread) -> None:
    status, _, body = http_post(gateway, "/v2/models/qc/infer", BAD_SHAPE, {"x-target": "new"})
    error = json.loads(body)["error"]
    assert status == 400 and "for model 'qc'." in error and "qc_2026_12" not in error, error
    client = grpc_client(gateway)
    try:
        with pytest.raises(InferenceServerException) as raised:
            client.infer("qc", grpc_inputs((1, 3)), headers={"x-target": "new"})
    finally:
        client.close()
    assert "for model 'qc'." in raised.value.message() and "qc_2026_12" not in raised.value.message()


def test_binary_and_compressed_answers_keep_their_framing(gateway: GatewayThread) -> None:
    """The renamed JSON header changes length: tritonclient reads the binary tensor after it by
    Inference-Header-Content-Length, and inflates a gzip answer, so both must be right."""
    client = httpclient.InferenceServerClient(gateway.hostport)
    given = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    given.set_data_from_numpy(X, binary_data=True)
    result = client.infer("qc", [given], headers={"x-target": "new"},
                          outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    assert result.get_response()["model_name"] == "qc"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X * 12)
    status, headers, body = http_post(gateway, "/v2/models/qc/infer", gzip.compress(BODY),
                                      {"x-target": "new", "Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(body))["model_name"] == "qc"


def test_metadata_config_and_ready_answer_for_the_stable_target(gateway: GatewayThread) -> None:
    """``alias`` exists only as a policy: its stable target, qc_2026_12@2, answers as ``alias``."""
    with urllib.request.urlopen(gateway.url + "/v2/models/alias", timeout=10) as response:
        metadata = json.loads(response.read())
    assert metadata["name"] == "alias" and metadata["versions"] == ["2"] and metadata["platform"] == "python"
    with urllib.request.urlopen(gateway.url + "/v2/models/alias/config", timeout=10) as response:
        config = json.loads(response.read())
    assert config["name"] == "alias" and config["parameters"]["factor_offset"] == {"string_value": "10"}
    with urllib.request.urlopen(gateway.url + "/v2/models/alias/ready", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(gateway.url + "/v2/models/qc", timeout=10) as response:
        assert json.loads(response.read())["versions"] == ["1", "2", "3"]  # qc's stable is qc itself: as sent
    client = grpc_client(gateway)
    try:
        assert client.get_model_metadata("alias").name == "alias"
        assert client.get_model_config("alias").config.name == "alias"
        assert client.is_model_ready("alias")
        with pytest.raises(InferenceServerException, match="'alias'"):  # a version the client names: as sent
            client.get_model_metadata("alias", model_version="1")
    finally:
        client.close()


def test_grpc_streams_answer_as_qc_requests_and_errors_alike(gateway: GatewayThread) -> None:
    client = grpc_client(gateway)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)), headers={"x-target": "new"})
    try:
        client.async_stream_infer("qc", grpc_inputs())
        client.async_stream_infer("qc", grpc_inputs((1, 3)))
        client.async_stream_infer("chat", text_input())
        # Triton answers each model's requests in order, but the two models' replies interleave
        answers = [replies.get(timeout=10) for _ in range(3)]
        errors = [error.message() for result, error in answers if error is not None]
        names = sorted(result.get_response().model_name for result, error in answers if error is None)
        assert names == ["chat", "qc"], names  # a decoupled model's replies renamed too
        assert len(errors) == 1 and "for model 'qc'." in errors[0] and "qc_2026_12" not in errors[0], errors
        qc = next(result for result, error in answers if error is None and result.get_response().model_name == "qc")
        assert answered_by(list(qc.as_numpy("OUTPUT0")[0])) == "qc_2026_12"
    finally:
        client.stop_stream()
        client.close()


def grpc_requests_total(gw: GatewayThread) -> Counter[str]:
    """gateway_requests_total of qc's successful gRPC requests, per target."""
    with urllib.request.urlopen(gw.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{") and 'model="qc"' in line and 'protocol="grpc"' in line \
                and 'code="OK"' in line:
            found[line.split('version="')[1].split('"')[0]] += int(float(line.rsplit(" ", 1)[1]))
    return found


def test_one_grpc_stream_split_between_the_names_answers_as_qc_and_counts_each_target(gateway: GatewayThread) -> None:
    """Each request of a stream is routed on its own (80/20 here, no rule): both names answer on
    the one stream, each reply says qc and carries its request's id, and the gateway's count per
    target (what the judge reads for a rollout between the names) matches what the outputs show
    answered. (Triton answers a stream's requests of non-decoupled models in the order sent, even
    across models: replies overtaking each other is tested with a decoupled model above.)"""
    client = grpc_client(gateway)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    before = grpc_requests_total(gateway)
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    try:
        for i in range(1, 41):
            given = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            given.set_data_from_numpy(np.full((1, 4), i, dtype=np.float32))
            client.async_stream_infer("qc", [given], request_id=f"r{i}")
        answers = [replies.get(timeout=10) for _ in range(40)]
    finally:
        client.stop_stream()
        client.close()
    seen: Counter[str] = Counter()
    for result, error in answers:
        assert error is None, error
        response = result.get_response()
        assert response.model_name == "qc", response
        given_value = int(response.id.removeprefix("r"))
        seen[FACTORS[float(result.as_numpy("OUTPUT0")[0][0]) / given_value]] += 1
    assert [result.get_response().id for result, _ in answers] == [f"r{i}" for i in range(1, 41)]
    assert seen["qc_2026_12"] and seen["qc"] and seen["qc"] + seen["qc_2026_12"] == 40, seen
    counted = grpc_requests_total(gateway) - before
    assert counted == seen, (counted, seen)


def text_input() -> list[grpcclient.InferInput]:
    """tok's inputs for one token (one reply)."""
    given = grpcclient.InferInput("text_input", [1], "BYTES")
    given.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([1], dtype=np.int32))
    return [given, tokens]


def test_generate_stream_events_say_the_called_name(gateway: GatewayThread) -> None:
    status, headers, body = http_post(gateway, "/v2/models/chat/generate_stream",
                                      json.dumps({"text_input": "hi", "max_tokens": 5}).encode())
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and headers["x-gateway-model-version"] == "tok"
    assert [event["model_name"] for event in events] == ["chat"] * 5
    assert [event["text_output"] for event in events] == [f"v2:{i}" for i in range(5)]


def test_sticky_users_keep_their_name(gateway: GatewayThread) -> None:
    for user in (f"user-{i}" for i in range(40)):
        answers = {http_post(gateway, "/v2/models/qc/infer", BODY, {"x-user-id": user})[1]["x-gateway-model-version"]
                   for _ in range(3)}
        assert answers == {"qc_2026_12" if bucket("qc", user) < 2000 else "qc"}, user


def test_sticky_users_keep_their_name_on_both_protocols_through_a_step(gateway: GatewayThread) -> None:
    """A user's name is the same over HTTP and gRPC (one hash for both), and a rollout's step between
    the names (qc_2026_12 20% -> 50%) only moves users into qc_2026_12: none of its users goes back."""
    users = [f"grow-{i}" for i in range(60)]
    client = grpc_client(gateway)

    def where(user: str) -> str:
        over_http = http_post(gateway, "/v2/models/qc/infer", BODY, {"x-user-id": user})[1]
        over_grpc = client.infer("qc", grpc_inputs(), headers={"x-user-id": user})
        assert over_http["x-gateway-model-version"] == answered_by(list(over_grpc.as_numpy("OUTPUT0")[0])), user
        return over_http["x-gateway-model-version"]

    def weights(new: int) -> None:
        status, doc = admin_call(gateway.url, "PATCH", "/admin/models/qc/policy/weights",
                                 {"weights": {"qc": 100 - new, "qc_2026_12": new}})
        assert status == 200, doc
        mover = next(user for user in users if 2000 <= bucket("qc", user) < 5000)  # on qc at 20%, not at 50%
        wait_for(lambda: where(mover) == ("qc_2026_12" if new == 50 else "qc"), 10, what=f"{new}% applied")

    try:
        before = {user: where(user) for user in users}
        weights(50)
        after = {user: where(user) for user in users}
    finally:
        weights(20)
        client.close()
    assert before == {u: "qc_2026_12" if bucket("qc", u) < 2000 else "qc" for u in users}
    assert after == {u: "qc_2026_12" if bucket("qc", u) < 5000 else "qc" for u in users}
    moved = {user for user in users if before[user] != after[user]}
    assert moved and all(after[user] == "qc_2026_12" for user in moved), moved
    assert "qc_2026_12" in before.values() and "qc" in after.values(), (before, after)


def test_sequences_keep_their_target_across_names(gateway: GatewayThread) -> None:
    """qc (sequence_affinity forced on): every request of a sequence goes where its start went.
    ``counter``: Triton's own sequence batcher keeps the running sum, so a sequence split between
    seq@1 and seq@2 would fail ("must specify the START flag") or sum wrong."""
    for sequence in range(1, 21):
        answered = set()
        for step in range(3):
            parameters = {"sequence_id": 7000 + sequence, "sequence_start": step == 0, "sequence_end": step == 2}
            status, headers, body = http_post(gateway, "/v2/models/qc/infer", json.dumps(
                {**json.loads(BODY), "parameters": parameters}).encode())
            assert status == 200, body
            answered.add((headers["x-gateway-model-version"], answered_by(json.loads(body)["outputs"][0]["data"])))
        assert len(answered) == 1, answered
    factors: Counter[int] = Counter()
    for sequence in range(1, 21):
        for step, value in enumerate((1, 2, 3)):
            parameters = {"sequence_id": 8000 + sequence, "sequence_start": step == 0, "sequence_end": step == 2}
            status, headers, body = http_post(gateway, "/v2/models/counter/infer", json.dumps(
                {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [value]}],
                 "parameters": parameters}).encode())
            answer = json.loads(body)
            assert status == 200 and answer["model_name"] == "counter", body
            version = int(headers["x-gateway-model-version"].removeprefix("seq@"))
            assert answer["outputs"][0]["data"] == [sum((1, 2, 3)[:step + 1]) * version]
        factors[version] += 1
    assert factors[1] and factors[2], factors


def test_grpc_sequences_keep_their_target_across_names(gateway: GatewayThread) -> None:
    client = grpc_client(gateway)
    try:
        for sequence in range(1, 11):
            answered = {answered_by(list(client.infer(
                "qc", grpc_inputs(), sequence_id=9000 + sequence, sequence_start=step == 0,
                sequence_end=step == 2).as_numpy("OUTPUT0")[0])) for step in range(3)}
            assert len(answered) == 1, answered
    finally:
        client.close()


def test_a_pinned_version_of_the_called_model_is_not_renamed(gateway: GatewayThread) -> None:
    status, headers, body = http_post(gateway, "/v2/models/qc/versions/2/infer", BODY)
    assert status == 200 and headers["x-gateway-route"] == "pinned" and headers["x-gateway-model-version"] == "2"
    assert json.loads(body)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_a_renamed_target_on_a_named_fleet(gateway: GatewayThread) -> None:
    status, headers, body = http_post(gateway, "/v2/models/qc/infer", BODY, {"x-target": "green"})
    assert status == 200 and headers["x-gateway-model-version"] == "green:qc_2026_12@1"
    assert json.loads(body)["model_name"] == "qc" and answered_by(json.loads(body)["outputs"][0]["data"]) == \
        "qc_2026_12@1"
    client = grpc_client(gateway)
    try:
        result = client.infer("qc", grpc_inputs(), headers={"x-target": "green"})
    finally:
        client.close()
    assert result.get_response().model_name == "qc" and answered_by(list(result.as_numpy("OUTPUT0")[0])) == \
        "qc_2026_12@1"


def test_the_shadow_of_a_renamed_target_is_sent_and_counted_under_its_name(gateway: GatewayThread) -> None:
    """100% of qc's routed requests are mirrored to qc_2026_12@1: its answers (x11) never agree
    with the primary's (x3 or x12), which proves they came from qc_2026_12@1."""
    def shadow_counts() -> tuple[float, float, float]:
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        counts = {"agree": 0.0, "disagree": 0.0, "error": 0.0}
        for line in text.splitlines():
            if line.startswith("gateway_shadow_requests_total{") and 'version="qc_2026_12@1"' in line:
                for result in counts:
                    if f'result="{result}"' in line:
                        counts[result] = float(line.rsplit(" ", 1)[1])
        return counts["agree"], counts["disagree"], counts["error"]

    def settled() -> tuple[float, float, float] | None:  # copies of earlier tests' requests may still be in flight
        first = shadow_counts()
        time.sleep(0.3)
        return first if shadow_counts() == first else None

    before = wait_for(settled, 10, what="the shadow queue to be idle")
    for _ in range(10):
        http_post(gateway, "/v2/models/qc/infer", BODY)
    def compared() -> tuple[float, float, float] | None:
        now = shadow_counts()
        return now if now[1] >= before[1] + 10 else None

    after = wait_for(compared, 10, what="ten shadow answers")
    assert after[0] == before[0] and after[2] == before[2], (before, after)
