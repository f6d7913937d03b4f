"""Verdicts that say why (issue 34), against the real Triton: a canary slower in compute is
rolled back naming compute, one slower by queueing (a target on a second Triton whose config
batches with a queue delay) pauses naming the queue and the config difference is in the record,
a canary whose failures are REJECTED by its queue (a target on a second Triton whose queue holds
two requests) is classed as capacity, one raising in ``execute`` as BACKEND.

Triton keeps one config per model, so a canary that differs in config is a version on another
fleet (``b:3``): the second Triton loads qc with the config each test needs."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import TOKEN, BackgroundLoad, GatewayThread, admin_call, gateway_settings, rollout_status, wait_for

pytestmark = pytest.mark.triton
QUEUE_DELAY_US = 30_000  # fleet b's qc waits up to 30 ms for a batch of 8: its requests queue, its compute is qc's


def load_with(server: LocalTriton, model: str, **changes: Any) -> None:
    """Load ``model`` on ``server`` with its current config changed (Triton keeps one config per model)."""
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/config", timeout=10) as response:
        config = json.loads(response.read())
    config.update(changes)
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/repository/models/{model}/load", data=body, method="POST")
    urllib.request.urlopen(request, timeout=120).close()


@pytest.fixture(scope="module")
def fleet_b(faults_path: Path) -> Iterator[LocalTriton]:
    """A second Triton serving qc; each test loads it with the config it needs."""
    with LocalTriton.on_free_ports(models=("qc",), faults_file=faults_path) as server:
        yield server


def gateway(triton: LocalTriton, fleet_b: LocalTriton, policies: dict[str, Any]) -> GatewayThread:
    fleets = {"default": {"servers": [{"http": triton.http_url, "grpc": triton.grpc_url}]},
              "b": {"servers": [{"http": fleet_b.http_url, "grpc": fleet_b.grpc_url}]}}
    return GatewayThread(gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                          controller_tick_s=0.2, fleets=fleets, policies=policies))


def run(gw: GatewayThread, model: str, concurrency: int, **spec: Any) -> dict[str, Any]:
    """A rollout under load until it leaves progressing; its status."""
    with BackgroundLoad(gw.url, concurrency=concurrency, model=model):
        status, doc = admin_call(gw.url, "POST", f"/admin/models/{model}/rollout",
                                 {"interval_s": 1.5, "latency_warmup_s": 0, "failure_limit": 2, **spec})
        assert status == 200, doc
        done: dict[str, Any] = wait_for(lambda: (lambda d: d if d["state"] != "progressing" else None)(
            rollout_status(gw.url, model)), 60, what=f"the rollout of {model} to end")
        return done


def unhealthy(doc: dict[str, Any]) -> dict[str, Any]:
    return [v for v in doc["verdicts"] if v["outcome"] == "unhealthy"][-1]  # type: ignore[no-any-return]


def test_a_canary_slower_in_compute_is_rolled_back_naming_compute(triton: LocalTriton, fleet_b: LocalTriton,
                                                                 faults: Faults) -> None:
    faults.set("qc", "3", delay_ms=6)
    with gateway(triton, fleet_b, {"qc": {"weights": {"2": 100}}}) as gw:
        doc = run(gw, "qc", 4, canary="3", steps=[20, 50, 100])
    assert doc["state"] == "rolled_back", doc["reason"]
    verdict = unhealthy(doc)
    assert (verdict["metric"], verdict["failure_class"]) == ("latency", "backend")
    assert verdict["attribution"]["cause"] == "compute" and verdict["attribution"]["compute_ms"] > 4
    assert "(the difference is in the compute)" in doc["reason"], doc["reason"]
    assert doc["likeness"]["words"] == "configs alike"


def test_a_canary_slower_by_queueing_pauses_naming_the_queue_and_its_config(triton: LocalTriton,
                                                                            fleet_b: LocalTriton) -> None:
    load_with(fleet_b, "qc", dynamic_batching={"preferred_batch_size": [8],
                                               "max_queue_delay_microseconds": QUEUE_DELAY_US})
    with gateway(triton, fleet_b, {"qc": {"weights": {"2": 100}}}) as gw:
        doc = run(gw, "qc", 4, canary="b:3", stable="2", steps=[20, 50, 100],
                  failure_classes={"capacity": "pause"})
    assert doc["state"] == "paused", doc["reason"]
    assert doc["reason"].startswith("paused: canary under-provisioned: queue ("), doc["reason"]
    assert "(the difference is in the queue)" in doc["reason"]
    verdict = unhealthy(doc)
    assert (verdict["metric"], verdict["failure_class"]) == ("latency", "capacity")
    queue_ms, compute_ms = verdict["attribution"]["queue_ms"], verdict["attribution"]["compute_ms"]
    # most of the difference is in the queue (relative: a loaded machine slows the batched compute too)
    assert queue_ms > 10 and queue_ms > 2 * abs(compute_ms), verdict["attribution"]
    # the config difference is in the rollout's record, its start and its verdicts
    (difference,) = doc["likeness"]["differences"]
    assert difference["field"] == "dynamic_batching" and difference["stable"] == "off"
    assert difference["canary"].startswith(f"on: preferred [8], max queue delay {QUEUE_DELAY_US} us")
    assert "configs differ: dynamic_batching: canary on" in doc["history"][0]["reason"]
    assert "configs differ: dynamic_batching" in verdict["reason"]
    assert doc["weights"] == {"2": 80, "b:3": 20}  # paused: the weights stay for the operator


def test_rejected_failures_are_capacity_and_raising_in_execute_is_backend(triton: LocalTriton, fleet_b: LocalTriton,
                                                                         faults: Faults) -> None:
    # fleet b's qc: the same model and compute, one instance behind a queue of two; the stable's
    # queue on the default fleet is unbounded: only the canary's requests are REJECTED
    load_with(fleet_b, "qc", dynamic_batching={"max_queue_delay_microseconds": 0, "default_queue_policy": {
        "timeout_action": "REJECT", "default_timeout_microseconds": 0, "max_queue_size": 2}})
    with gateway(triton, fleet_b, {"qc": {"weights": {"2": 100}}}) as gw:
        rejected = run(gw, "qc", 16, canary="b:3", stable="2", steps=[50, 100])
        faults.set("qc", "3", raise_rate=0.2)
        backend = run(gw, "qc", 4, canary="3", stable="2", steps=[20, 50, 100])
    assert rejected["state"] == "rolled_back", rejected["reason"]
    verdict = unhealthy(rejected)
    assert (verdict["metric"], verdict["failure_class"]) == ("capacity_error_rate", "capacity"), verdict["reason"]
    # the statistical judge weighs the intervals together: the verdict that decided may come from an
    # interval with no REJECTED of its own (seen once under load): the rollout's canary had them
    assert sum(v.get("canary_rejected", 0) for v in rejected["verdicts"]) > 0, rejected["verdicts"]
    assert verdict["canary_errors"] == 0, verdict
    assert "canary errors are REJECTED (its queue full or timed out: capacity), not BACKEND" in rejected["reason"]
    assert backend["state"] == "rolled_back", backend["reason"]
    verdict = unhealthy(backend)
    assert verdict["failure_class"] == "backend" and verdict["canary_rejected"] == 0, verdict["reason"]
    assert "canary errors are BACKEND (the model failed), not REJECTED" in backend["reason"], backend["reason"]
