"""A rollout between model names, against the real Triton: ``qc`` version 2 -> ``qc_2026_12``,
judged on the gateway's own numbers per target and rolled back (or promoted) like a version rollout."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import BackgroundLoad, GatewayThread, admin_call, rollout_gateway, rollout_status, wait_for

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(target_models: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(target_models.http_url) as running:  # qc all on version 2
        yield running


def finished(url: str) -> dict[str, object] | None:
    doc = rollout_status(url)
    return doc if doc["state"] != "progressing" else None


def test_a_failing_model_name_is_rolled_back_and_bad_targets_change_nothing(gateway: GatewayThread,
                                                                            faults: Faults) -> None:
    for canary, status, words in (("qc_2026_12:2", 409, "written 'qc_2026_12@2'"),
                                  ("qc_2099_01", 409, "model 'qc_2099_01' has no READY version"),
                                  ("qc_2026_12@9", 409, "version 9 of model 'qc_2026_12' is not known"),
                                  ("qc_2026_12@x", 422, "after '@' comes a version number")):
        answer = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {"canary": canary})
        assert answer[0] == status and words in json.dumps(answer[1]), answer
    assert admin_call(gateway.url, "GET", "/admin/models/qc/rollout")[0] == 404  # nothing was started
    assert admin_call(gateway.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"2": 100}

    faults.set("qc_2026_12", "2", error_rate=0.3)  # qc_2026_12's default version fails; qc's versions do not
    with BackgroundLoad(gateway.url, by_target=True) as load:
        time.sleep(0.5)
        status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {
            "canary": "qc_2026_12", "judge": "thresholds", "steps": [10, 50, 100], "interval_s": 2,
            "min_requests": 20, "failure_limit": 2})
        assert status == 200 and doc["stable"] == "2" and doc["canary"] == "qc_2026_12", doc
        doc = wait_for(lambda: finished(gateway.url), 60, what="the rollout to end")
    assert doc["state"] == "rolled_back" and doc["weights"] == {"2": 100, "qc_2026_12": 0}, doc
    unhealthy = [v for v in doc["verdicts"] if v["outcome"] == "unhealthy"]
    assert unhealthy and unhealthy[-1]["metric"] == "error_rate", doc["verdicts"]
    assert load.result.versions["qc_2026_12"] > 0 and load.result.versions["2"] > 0, load.result.versions
    assert "injected fault in version 2" in " ".join(load.result.failures)
    assert doc["step"] == 0
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'gateway_requests_total{code="500",model="qc",protocol="http",route="weighted",version="qc_2026_12"}' \
        in metrics


def test_a_version_another_models_policy_sends_traffic_to_is_not_unloaded(gateway: GatewayThread) -> None:
    assert admin_call(gateway.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 90, "qc_2026_12@1": 10}})[0] \
        == 200
    status, doc = admin_call(gateway.url, "POST", "/admin/models/qc_2026_12/versions/1/unload")
    assert status == 409 and "takes 10% of the traffic of 'qc' (target qc_2026_12@1)" in doc["error"], doc
    with urllib.request.urlopen(gateway.url + "/v2/models/qc_2026_12/versions/1/ready", timeout=10) as response:
        assert response.status == 200


def test_a_healthy_model_name_is_promoted_and_still_answers_as_qc(gateway: GatewayThread) -> None:
    with BackgroundLoad(gateway.url, by_target=True) as load:
        time.sleep(0.5)
        status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {
            "canary": "qc_2026_12@1", "judge": "thresholds", "steps": [50, 100], "interval_s": 1.5,
            "min_requests": 20, "max_p99_ratio": 3, "min_p99_delta_ms": 50})
        assert status == 200, doc
        doc = wait_for(lambda: finished(gateway.url), 60, what="the rollout to end")
    assert doc["state"] == "promoted" and doc["weights"] == {"2": 0, "qc_2026_12@1": 100}, doc
    assert not load.result.failures and load.result.versions["qc_2026_12@1"] > 0
    request = urllib.request.Request(gateway.url + "/v2/models/qc/infer", data=json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["model_name"] == "qc" and answer["outputs"][0]["data"] == [11.0, 22.0, 33.0, 44.0]
    with urllib.request.urlopen(gateway.url + "/v2/models/qc", timeout=10) as response:
        assert json.loads(response.read()) == {"name": "qc", "versions": ["1"], "platform": "python",
                                               "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}],
                                               "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}]}
