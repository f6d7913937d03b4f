"""What a rollback judges and where it goes: 4xx count against a canary, overload never does;
the stable cannot be unloaded from under a rollout; Triton restarts neither roll back nor lose
the versions the gateway loaded. Real Triton (the sample model's faults answer 400 and
Triton's queue-full 503)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import (
    TOKEN,
    BackgroundLoad,
    GatewayThread,
    admin_call,
    gateway_settings,
    rollout_gateway,
    rollout_status,
    wait_for,
)

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        yield running


def begin(url: str, **spec: Any) -> None:
    status, doc = admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", **spec})
    assert status == 200, doc


def ended(url: str) -> dict[str, Any] | None:
    doc = rollout_status(url)
    return doc if doc["state"] not in ("progressing", "paused") else None


@pytest.mark.parametrize(("judge", "metric"), [("statistical", "client_error_rate"),
                                               ("thresholds", "client_error_rate_increase")])
def test_a_canary_answering_400_to_30_percent_is_rolled_back(gateway: GatewayThread, faults: Faults, judge: str,
                                                             metric: str) -> None:
    faults.set("qc", "3", client_error_rate=0.3)
    with BackgroundLoad(gateway.url, concurrency=4) as load:
        # canary at 50% first: the rate read below rests on ~90 answers an interval, not ~37 (ci-23: one
        # interval at 20% read 4 of 37, 10.8%, against the injected 30%: a 0.6% draw, under this floor)
        begin(gateway.url, steps=[50, 100], interval_s=1.5, min_requests=20, failure_limit=2, judge=judge)
        doc = wait_for(lambda: ended(gateway.url), 20, what="the rollout to end")
    assert (doc["state"], doc["applied"]) == ("rolled_back", True), doc["reason"]
    unhealthy = [v for v in doc["verdicts"] if v["outcome"] == "unhealthy"]
    last = unhealthy[-1]
    assert last["metric"] == metric, last
    if judge == "thresholds":  # the rate the rollback rested on: its failure_limit (2) intervals' answers together
        errors = sum(v["canary_client_errors"] for v in unhealthy[-2:])
        answered = sum(v["canary_client_errors"] + v["canary_requests"] for v in unhealthy[-2:])
        assert errors / answered > 0.15, [(v["canary_client_errors"], v["canary_requests"]) for v in unhealthy]
    else:
        (evidence,) = [m for m in last["metrics"] if m["name"] == "client_error_rate"]
        assert evidence["verdict"] == "fail" and evidence["effect"] > 0.15, evidence
    assert load.result.statuses[400] > 0 and doc["weights"] == {"2": 100, "3": 0}


def test_overload_on_both_versions_rolls_nothing_back(gateway: GatewayThread, faults: Faults) -> None:
    faults.set("qc", "2", overload_rate=0.3)
    faults.set("qc", "3", overload_rate=0.3)
    with BackgroundLoad(gateway.url, concurrency=4) as load:
        # failure_limit 1: a single interval holding overload against the canary would roll it back.
        # Latency is not what this test is about (on 2 shared cores a p99 ratio can wobble past 1.5x).
        # The thresholds judge decides each interval on its own, so overload held against the canary
        # would show at once; the statistical judge reads the same windows (tests/unit: overloads unjudged).
        begin(gateway.url, steps=[20, 50, 100], interval_s=1, min_requests=10, failure_limit=1, max_p99_ratio=None,
              judge="thresholds")
        doc = wait_for(lambda: ended(gateway.url), 20, what="the rollout to end")
    assert doc["state"] == "promoted", doc["reason"]
    assert load.result.statuses[503] > 50, "Triton's queue-full answers reached the clients as Triton sent them"
    judged = [v for v in doc["verdicts"] if v["outcome"] == "healthy"]
    # a full queue is the version's capacity (rejected, issue 34): both versions' alike, so nobody's. Each
    # verdict counts no error; the rejections are counted across them: one interval of ~14 canary requests
    # at a 30% overload rate has none 0.7% of the time (ci-17, at load 13: one verdict of several had none)
    numbers = [(v["canary_requests"], v["canary_rejected"], v["canary_error_rate"]) for v in judged]
    assert judged and all(error_rate == 0 for _, _, error_rate in numbers), numbers
    assert sum(rejected for _, rejected, _ in numbers) > 0, numbers
    assert gateway.app.recorder.window("qc", "3", 30).rejected > 0


def ready_versions(triton: LocalTriton) -> set[str]:
    request = urllib.request.Request(f"{triton.http_url}/v2/repository/index", data=b"{}", method="POST")
    try:
        index = json.loads(urllib.request.urlopen(request, timeout=2).read())
    except OSError:
        return set()
    return {e["version"] for e in index if e["name"] == "qc" and e.get("state") == "READY"}


def test_the_stable_is_protected_and_triton_restarts_neither_roll_back_nor_lose_loaded_versions(
        faults_path: Path) -> None:
    """Over 30 s: a Triton of its own is restarted twice (each a full start with its models) under a running
    rollout."""
    own = LocalTriton.on_free_ports(models=("qc",), faults_file=faults_path).start()
    try:
        settings = gateway_settings(own.http_url, admin_token=TOKEN, controller_tick_s=0.2,
                                    policies={"qc": {"weights": {"2": 100}}})
        with GatewayThread(settings) as gw:
            status, body = admin_call(gw.url, "POST", "/admin/models/qc/versions/1/unload")
            assert status == 200, body
            assert ready_versions(own) == {"2", "3"}
            with BackgroundLoad(gw.url, concurrency=2):
                # thresholds: a verdict each interval, so the restart's interval is judged within the test's time;
                # on errors only: a restarted Triton's first p99 of 2 s measures its warm-up and the machine
                # (an identical canary was rolled back at 1.85x under CPU load), not what this test is about
                begin(gw.url, steps=[50, 100], interval_s=2, min_requests=10, failure_limit=1, judge="thresholds",
                      max_p99_ratio=None)
                for version, role in (("2", "stable"), ("3", "canary")):
                    status, body = admin_call(gw.url, "POST", f"/admin/models/qc/versions/{version}/unload")
                    assert status == 409 and role in body["error"] and "rollout" in body["error"], body
                own.stop()  # Triton restarts mid-rollout, under judged traffic: it comes back with
                own.start()  # config.pbtxt's versions 1, 2, 3
                wait_for(lambda: ready_versions(own) == {"2", "3"}, 30, interval=0.2,
                         what="the gateway's loaded versions restored")
                doc = wait_for(lambda: ended(gw.url), 20, what="the rollout to go on to its end")
            assert doc["state"] == "promoted", doc["reason"]
            assert any("could not serve" in v["reason"] for v in doc["verdicts"]), "the restart was judged"
            events = admin_call(gw.url, "GET", "/admin/events?model=qc")[1]["events"]
            assert any(e["action"] == "versions_restored" for e in events)

            # Back to 2 by a second rollout, restarting Triton during its 100% step.
            status, body = admin_call(gw.url, "POST", "/admin/models/qc/rollout",
                                      {"canary": "2", "stable": "3", "steps": [50, 100], "interval_s": 3600})
            assert status == 200, body
            assert admin_call(gw.url, "POST", "/admin/models/qc/rollout/promote")[0] == 200  # the 100% step
            assert rollout_status(gw.url)["weights"] == {"2": 100, "3": 0}
            with BackgroundLoad(gw.url, concurrency=2):
                own.stop()
                own.start()
                wait_for(lambda: ready_versions(own) == {"2", "3"}, 30, interval=0.2, what="restored again")
                time.sleep(1.0)
            doc = rollout_status(gw.url)
            assert (doc["state"], doc["step"]) == ("progressing", 1), doc["reason"]
            assert admin_call(gw.url, "POST", "/admin/models/qc/rollout/promote")[0] == 200
            assert rollout_status(gw.url)["state"] == "promoted", "the rollout goes on"
    finally:
        own.stop()
