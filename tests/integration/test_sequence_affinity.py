"""Sequences are safe by default: ``sequence_affinity`` auto follows Triton's own config of the
model (the sample ``seq`` model has a sequence batcher), on both protocols, and a pin made on
one replica is honoured by another on the next request (two gateways on one Redis store).

Against the real Triton: a sequence whose requests reach two versions of ``seq`` fails there
with "must specify the START flag", which is what each test would see without affinity.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings

TOKEN = "seq-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def step(url: str, sequence_id: int, value: int, start: bool = False, end: bool = False) -> tuple[int, Any]:
    """One request of a sequence to the seq model over HTTP."""
    parameters: dict[str, Any] = {"sequence_id": sequence_id}
    if start:
        parameters["sequence_start"] = True
    if end:
        parameters["sequence_end"] = True
    return post(f"{url}/v2/models/seq/infer", {"parameters": parameters, "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [value]}]})


def set_weights(url: str, weights: dict[str, int], affinity: Any = None) -> None:
    body: dict[str, Any] = {"weights": weights}
    if affinity is not None:
        body["sequence_affinity"] = affinity
    status, answer = post(f"{url}/admin/models/seq/policy", body, ADMIN, method="PUT")
    assert status == 200, answer


def affinity(gw: GatewayThread, model: str) -> bool:
    policy = gw.app.book.get(model)
    assert policy is not None
    return policy.sequence_affinity


def seq_weight(gw: GatewayThread, version: str) -> object:
    policy = gw.app.book.get("seq")
    return None if policy is None else policy.spec.weights.get(version)


def wait_until(check: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with GatewayThread(gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN)) as gw:
        wait_until(lambda: "seq" in gw.app.book.sequence_models())
        yield gw


def test_auto_affinity_keeps_every_http_sequence_on_its_version_under_a_50_50_policy(gateway: GatewayThread) -> None:
    """The tried failure: 50/50 on a sequence-batched model, 2 of 4 HTTP sequences failed with
    "must specify the START flag" (affinity was off unless the policy said true)."""
    set_weights(gateway.url, {"1": 50, "2": 50})
    failures, versions = [], []
    for sequence in range(1, 9):
        sid = 7000 + sequence
        for index, value in enumerate((1, 2, 3, 4)):
            status, answer = step(gateway.url, sid, value, start=index == 0, end=index == 3)
            if status != 200:
                failures.append((sid, index, answer))
                break
        else:
            total = answer["outputs"][0]["data"][0]
            versions.append(answer["model_version"])
            assert total == 10 * int(answer["model_version"]), "the whole sum, in one version"
    assert not failures, failures
    assert set(versions) == {"1", "2"}, "both versions took sequences: the split still holds"
    assert affinity(gateway, "seq"), "auto: on, as Triton's config has a sequence batcher"


def test_auto_affinity_holds_on_grpc_and_false_turns_it_off(gateway: GatewayThread) -> None:
    set_weights(gateway.url, {"1": 50, "2": 50})
    inputs = grpcclient.InferInput("INPUT0", [1, 1], "INT32")
    import numpy as np

    inputs.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.settings.grpc_port}")
    try:
        for sid in range(7100, 7106):
            client.infer("seq", [inputs], sequence_id=sid, sequence_start=True)
            client.infer("seq", [inputs], sequence_id=sid)
            client.infer("seq", [inputs], sequence_id=sid, sequence_end=True)  # raises on "START flag"
        set_weights(gateway.url, {"1": 50, "2": 50}, affinity=False)
        assert not affinity(gateway, "seq"), "false forces it off whatever Triton says"
        errors = 0
        for sid in range(7200, 7210):
            try:
                client.infer("seq", [inputs], sequence_id=sid, sequence_start=True)
                client.infer("seq", [inputs], sequence_id=sid, sequence_end=True)
            except grpcclient.InferenceServerException as exc:
                assert "START flag" in str(exc)
                errors += 1
        assert errors, "with affinity forced off the weighted split breaks sequences (what auto prevents)"
    finally:
        client.close()
        set_weights(gateway.url, {"1": 50, "2": 50}, affinity="auto")


def test_a_model_without_a_sequence_batcher_keeps_affinity_off(gateway: GatewayThread) -> None:
    status, answer = post(f"{gateway.url}/admin/models/qc/policy", {"weights": {"1": 50, "2": 50}}, ADMIN,
                          method="PUT")
    assert status == 200 and answer["sequence_affinity"] == "auto"
    assert not affinity(gateway, "qc"), "qc's config has no sequence batcher"


def test_a_pin_is_made_only_by_the_sequences_start(gateway: GatewayThread) -> None:
    """Issue 23 item 2: a request that is not a start pins nothing (it cannot choose a version
    for a sequence it did not start)."""
    set_weights(gateway.url, {"1": 50, "2": 50}, affinity=True)
    try:
        before = len(gateway.app.pins)
        for sid in range(7300, 7310):
            status, answer = step(gateway.url, sid, 1)
            assert status == 400 and "START flag" in answer["error"], "Triton's own answer to an unknown sequence"
        assert len(gateway.app.pins) == before, "no pin from requests that did not start their sequence"
    finally:
        set_weights(gateway.url, {"1": 50, "2": 50}, affinity="auto")


def test_a_sequence_that_reconnects_to_another_replica_stays_on_its_version(triton: LocalTriton,
                                                                            redis_url: str) -> None:
    """Two gateways on one Redis store: each sequence starts on A while the weights send new
    sequences to version 1, the weights then move to version 2, and the rest of every
    sequence goes to B (as after a keep-alive timeout): B must find A's pin at once."""
    settings = {"admin_token": TOKEN, "store_url": redis_url, "triton_grpc_url": triton.grpc_url}
    with GatewayThread(gateway_settings(triton.http_url, **settings)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **settings)) as b:
        for gw in (a, b):
            wait_until(lambda gw=gw: "seq" in gw.app.book.sequence_models())
        set_weights(a.url, {"1": 100, "2": 0})
        for sid in range(7400, 7404):
            status, answer = step(a.url, sid, 5, start=True)
            assert status == 200 and answer["model_version"] == "1"
        set_weights(a.url, {"1": 0, "2": 100})
        wait_until(lambda: seq_weight(b, "2") == 100)
        for sid in range(7400, 7404):
            status, answer = step(b.url, sid, 1)
            assert status == 200, f"the second request of sequence {sid}, on another replica: {answer}"
            assert answer["model_version"] == "1" and answer["outputs"][0]["data"][0] == 6
            status, answer = step(b.url, sid, 1, end=True)
            assert status == 200 and answer["outputs"][0]["data"][0] == 7
        status, answer = step(b.url, 7499, 1, start=True)
        assert status == 200 and answer["model_version"] == "2", "new sequences follow the new weights"
        step(b.url, 7499, 1, end=True)


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_sequences_on_a_grpc_stream_stay_on_their_version(triton: LocalTriton, server: str) -> None:
    """ModelStreamInfer: many sequences interleaved on one stream, each message routed by its
    sequence's pin (the lean server keeps the stream's order while a pin is settled)."""
    import queue

    import numpy as np

    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                grpc_server=server)
    with GatewayThread(settings) as gw:
        wait_until(lambda: "seq" in gw.app.book.sequence_models())
        set_weights(gw.url, {"1": 50, "2": 50})
        replies: queue.Queue[Any] = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{settings.grpc_port}")
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            sequences = range(7500, 7508)
            for index in range(3):
                for sid in sequences:
                    value = grpcclient.InferInput("INPUT0", [1, 1], "INT32")
                    value.set_data_from_numpy(np.array([[1]], dtype=np.int32))
                    client.async_stream_infer("seq", [value], request_id=f"{sid}-{index}", sequence_id=sid,
                                              sequence_start=index == 0, sequence_end=index == 2)
            answers = [replies.get(timeout=20) for _ in range(3 * len(sequences))]
        finally:
            client.stop_stream()
            client.close()
        errors = [str(error) for _, error in answers if error is not None]
        assert not errors, errors
        last = {result.get_response().id: result for result, _ in answers}
        versions = set()
        for sid in sequences:
            response = last[f"{sid}-2"].get_response()
            versions.add(response.model_version)
            assert last[f"{sid}-2"].as_numpy("OUTPUT0")[0][0] == 3 * int(response.model_version)
        assert versions == {"1", "2"}
