"""A canary of a composing model inside an ensemble, against the real Triton: ``pipe`` = pre ->
qc (v2 pinned) -> post, canary qc v3 (deploy/model_repository). The post-processor answers
QC_VERSION, the qc version the request's own stages ran, so each answer proves which arm it
went through, whole."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import (
    TOKEN,
    BackgroundLoad,
    GatewayProcess,
    GatewayThread,
    admin_call,
    gateway_settings,
    pipe_as_in_the_repository,
    rollout_status,
    wait_for,
)

pytestmark = pytest.mark.triton
PIPE_BODY = json.dumps({"inputs": [{"name": "RAW", "datatype": "FP32", "shape": [1, 4],
                                     "data": [1, 2, 3, 4]}]}).encode()
VARIANT = "pipe__qc_3"


def triton_get(triton: LocalTriton, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(triton.http_url + path, timeout=10) as response:
            body = response.read()
            return response.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def qc_pin(triton: LocalTriton) -> int:
    config = triton_get(triton, "/v2/models/pipe/config")[1]
    return int(next(step["model_version"] for step in config["ensemble_scheduling"]["step"]
                    if step["model_name"] == "qc"))


@pytest.fixture
def pipe(target_models: LocalTriton) -> Iterator[LocalTriton]:
    """The session Triton's pipe as the repository has it, before and after each test (a
    promotion pins qc 3 in it; a failed test may leave the variant loaded)."""
    triton = target_models
    pipe_as_in_the_repository(triton)
    yield triton
    pipe_as_in_the_repository(triton)
    assert qc_pin(triton) == 2


@pytest.fixture
def gateway(pipe: LocalTriton) -> Iterator[GatewayThread]:
    with GatewayThread(gateway_settings(pipe.http_url, admin_token=TOKEN, controller_tick_s=0.2)) as running:
        yield running


def call_pipe(url: str) -> tuple[str, int, str]:
    """(the target that answered, the qc version the answer's stages ran, the answer's model name)."""
    request = urllib.request.Request(url + "/v2/models/pipe/infer", data=PIPE_BODY)
    with urllib.request.urlopen(request, timeout=10) as response:
        answer = json.loads(response.read())
        target = response.headers["x-gateway-model-version"]
    qc_version = next(o["data"][0] for o in answer["outputs"] if o["name"] == "QC_VERSION")
    return target, qc_version, answer["model_name"]


def variant_state(url: str) -> str:
    return str(rollout_status(url, "pipe").get("variant", {}).get("state"))


def test_at_20_percent_every_request_runs_one_arms_stages_only(gateway: GatewayThread, pipe: LocalTriton) -> None:
    status, doc = admin_call(gateway.url, "POST", "/admin/models/pipe/rollout", {
        "composing": "qc@3", "steps": [20, 100], "manual_gates": True, "interval_s": 600})
    assert status == 200 and doc["canary"] == VARIANT and doc["stable"] == "1", doc
    assert doc["variant"]["config"]["ensemble_scheduling"]["step"][1]["model_version"] == 3
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: call_pipe(gateway.url), range(1000)))
    arms = Counter((target, qc_version) for target, qc_version, _ in answers)
    assert set(arms) == {("1", 2), (VARIANT, 3)}, arms  # never the stable's stages with the canary's qc
    assert abs(arms[(VARIANT, 3)] - 200) <= 5, arms
    assert {name for _, _, name in answers} == {"pipe"}
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] == 200
    status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/versions/3/unload")
    assert status == 409 and "runs inside 'pipe__qc_3'" in doc["error"], doc  # the variant needs it

    status, doc = admin_call(gateway.url, "POST", "/admin/models/pipe/rollout/abort")
    assert status == 200 and doc["state"] == "aborted", doc
    wait_for(lambda: variant_state(gateway.url) == "unloaded", 20, what="the variant to be unloaded")
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] != 200
    assert {call_pipe(gateway.url)[:2] for _ in range(20)} == {("1", 2)}
    events = admin_call(gateway.url, "GET", "/admin/events?model=pipe")[1]["events"]
    assert any(e["action"] == "variant_unloaded" for e in events)


def test_bad_ensemble_canaries_are_refused_and_change_nothing(gateway: GatewayThread, pipe: LocalTriton) -> None:
    for spec, status, words in (
            ({"composing": "qc@2"}, 409, "runs qc version 2 already"),
            ({"composing": "tok@1"}, 409, "no step of ensemble 'pipe' runs 'tok'"),
            ({"composing": "qc@4"}, 409, "version 4 of model 'qc'"),
            ({"composing": "qc"}, 422, "model@version"),
            ({"composing": "qc@3", "baseline": "1"}, 422, "no baseline"),
            ({}, 422, "canary")):
        answer = admin_call(gateway.url, "POST", "/admin/models/pipe/rollout", spec)
        assert answer[0] == status and words in json.dumps(answer[1]), (spec, answer)
    answer = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {"composing": "qc@3"})
    assert answer[0] == 409 and "is not an ensemble" in answer[1]["error"], answer
    assert admin_call(gateway.url, "GET", "/admin/models/pipe/rollout")[0] == 404
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] != 200


def test_a_failing_canary_inside_the_ensemble_is_rolled_back_and_its_variant_unloaded(
        gateway: GatewayThread, pipe: LocalTriton, faults: Faults) -> None:
    """Up to ~30 s: two unhealthy 2 s intervals after the variant loaded, then the drain."""
    faults.set("qc", "3", raise_rate=0.5)  # qc v3 fails; Triton counts its failures per version
    with BackgroundLoad(gateway.url, model="pipe", body=PIPE_BODY, by_target=True) as load:
        time.sleep(0.5)
        status, doc = admin_call(gateway.url, "POST", "/admin/models/pipe/rollout", {
            "composing": "qc@3", "judge": "thresholds", "steps": [20, 50, 100], "interval_s": 2,
            "min_requests": 20, "failure_limit": 2})
        assert status == 200, doc
        doc = wait_for(lambda: (d := rollout_status(gateway.url, "pipe"))["state"] != "progressing" and d, 60,
                       what="the rollout to end")
    assert doc["state"] == "rolled_back" and doc["weights"] == {"1": 100, VARIANT: 0}, doc
    assert load.result.versions[VARIANT] > 0 and load.result.versions["1"] > 0
    judged = [v for v in doc["verdicts"] if v["outcome"] == "unhealthy"]
    assert judged and judged[-1]["metric"] == "error_rate"
    assert any("qc v3 inside the variant" in v.get("composing", "") and "Triton failed" in v["composing"]
               for v in doc["verdicts"]), doc["verdicts"]
    wait_for(lambda: variant_state(gateway.url) == "unloaded", 20, what="the variant to be unloaded")
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] != 200
    assert qc_pin(pipe) == 2
    attribution = rollout_status(gateway.url, "pipe")["variant"]["attribution"]
    assert attribution["canary"]["failures"] > 0 and attribution["reference"]["failures"] == 0, attribution


def test_a_healthy_canary_is_promoted_into_the_ensemble_itself(gateway: GatewayThread, pipe: LocalTriton) -> None:
    with BackgroundLoad(gateway.url, model="pipe", body=PIPE_BODY, by_target=True) as load:
        time.sleep(0.5)
        status, doc = admin_call(gateway.url, "POST", "/admin/models/pipe/rollout", {
            "composing": "qc@3", "judge": "thresholds", "steps": [50, 100], "interval_s": 1.5,
            "min_requests": 20, "max_p99_ratio": 3, "min_p99_delta_ms": 50})
        assert status == 200, doc
        wait_for(lambda: variant_state(gateway.url) == "unloaded", 60, what="promotion and the variant unloaded")
    doc = rollout_status(gateway.url, "pipe")
    assert doc["state"] == "promoted" and doc["weights"] == {"1": 100, VARIANT: 0}, doc
    assert not load.result.failures, load.result.failures[:3]
    assert qc_pin(pipe) == 3  # the ensemble itself runs the canary's version now
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] != 200
    assert {call_pipe(gateway.url) for _ in range(10)} == {("1", 3, "pipe")}
    actions = [e["action"] for e in admin_call(gateway.url, "GET", "/admin/events?model=pipe")[1]["events"]]
    assert "ensemble_pinned" in actions and "variant_unloaded" in actions


def test_a_gateway_killed_mid_rollout_resumes_and_settles_the_variant(pipe: LocalTriton, tmp_path: Path) -> None:
    """~35 s: two gateway processes start, the second waits out the first one's lease (4 s),
    and the rollout walks three steps of 1.5 s, is promoted, pins qc 3 in pipe and unloads the
    variant, each of which the test waits for."""
    env = {"GATEWAY_TRITON_URL": pipe.http_url, "GATEWAY_STORE_URL": f"sqlite:///{tmp_path}/state.db",
           "GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_CONTROLLER_TICK_S": "0.2",
           "GATEWAY_CONTROLLER_LEASE_TTL_S": "4", "GATEWAY_CONTROLLER_CALL_TIMEOUT_S": "0.5"}
    first = GatewayProcess(env).start()
    try:
        with BackgroundLoad(first.url, concurrency=4, model="pipe", body=PIPE_BODY):
            status, doc = admin_call(first.url, "POST", "/admin/models/pipe/rollout", {
                "composing": "qc@3", "judge": "thresholds", "steps": [20, 50, 100], "interval_s": 1.5,
                "min_requests": 10, "max_p99_ratio": 3, "min_p99_delta_ms": 50})
            assert status == 200, doc
            wait_for(lambda: rollout_status(first.url, "pipe")["step"] >= 1, 20, what="step 2")
            killed_at = rollout_status(first.url, "pipe")
            first.kill()
    finally:
        first.kill()
    assert killed_at["state"] == "progressing"
    assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] == 200  # Triton keeps the variant meanwhile
    second = GatewayProcess(env, port=first.port).start()
    try:
        doc = rollout_status(second.url, "pipe")
        assert doc["state"] == "progressing" and doc["step"] == killed_at["step"], doc
        with BackgroundLoad(second.url, concurrency=4, model="pipe", body=PIPE_BODY):
            wait_for(lambda: variant_state(second.url) == "unloaded", 60, what="promotion and the variant unloaded")
        doc = rollout_status(second.url, "pipe")
        assert doc["state"] == "promoted" and qc_pin(pipe) == 3, doc
        assert triton_get(pipe, f"/v2/models/{VARIANT}/ready")[0] != 200  # unloaded in Triton, not only in the record
        assert call_pipe(second.url)[:2] == ("1", 3)
    finally:
        second.stop()
