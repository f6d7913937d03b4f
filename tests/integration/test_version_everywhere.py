"""The same version everywhere (issue 34): before a version takes more weight, every server of
its fleet serves it with the same configuration; a server that differs holds the rollout at its
step naming the server and the field, and ``/admin/models`` shows the drift. Two real Tritons
as one fleet; one of them loads qc again with another instance count."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools.local_triton import SAMPLE_REPOSITORY, LocalTriton
from tests.fleet_support import fleet_settings
from tests.support import BackgroundLoad, GatewayThread, admin_call, rollout_status, wait_for

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def pair(faults_path: Path) -> Iterator[tuple[LocalTriton, LocalTriton]]:
    """Two Tritons of the module's own (qc only): one of them gets another config of qc."""
    with LocalTriton.on_free_ports(models=("qc",), faults_file=faults_path) as first:
        with LocalTriton.on_free_ports(models=("qc",), faults_file=faults_path) as second:
            yield first, second


def config(server: LocalTriton) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.http_url}/v2/models/qc/config", timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def load(server: LocalTriton, qc: dict[str, Any]) -> None:
    body = json.dumps({"parameters": {"config": json.dumps(qc)}}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/repository/models/qc/load", data=body, method="POST")
    urllib.request.urlopen(request, timeout=120).close()


@pytest.fixture
def drifted(pair: tuple[LocalTriton, LocalTriton]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """A way to load the second server's qc with two instances, put back afterwards."""
    original = config(pair[1])
    changed = json.loads(json.dumps(original))
    changed["instance_group"][0]["count"] = 2
    yield original, changed
    load(pair[1], original)


def test_a_server_serving_another_config_holds_the_rollout_naming_it(
        pair: tuple[LocalTriton, LocalTriton], drifted: tuple[dict[str, Any], dict[str, Any]]) -> None:
    first, second = pair
    settings = fleet_settings(first, second, controller_tick_s=0.2, model_repository=SAMPLE_REPOSITORY,
                              policies={"qc": {"weights": {"2": 100}}})
    spec = {"canary": "3", "steps": [10, 50, 100], "interval_s": 1, "latency_warmup_s": 0, "min_requests": 5,
            "judge": "thresholds", "max_p99_ratio": None, "inconclusive_limit": 1000}
    odd = second.http_url.removeprefix("http://")
    with GatewayThread(settings) as gw, BackgroundLoad(gw.url, concurrency=4) as traffic:

        def reload(qc: dict[str, Any]) -> None:
            """The second server's qc loaded with no inference in flight: Triton 2.51's Python backend
            aborted now and then (boost::interprocess::lock_exception: 2 of 6 full runs in one
            session) while a reload's new instances started. The likeliest trigger left is the old
            instances executing requests beside them (one traced abort was in ModelInstanceExecute):
            neither one version at a time nor the server at nice -10 kept it from happening."""
            with traffic.paused():
                load(second, qc)

        reload(drifted[1])
        status, body = admin_call(gw.url, "POST", "/admin/models/qc/rollout", spec)
        assert status == 409 and f"server {odd} reports instance_group 2 instances (KIND_CPU)" in body["error"], body
        reload(drifted[0])
        status, doc = admin_call(gw.url, "POST", "/admin/models/qc/rollout", spec)
        assert status == 200, doc
        assert doc["files"] and "model.py" in " ".join(doc["files"]), "the canary's files, by hash, at the start"
        # A server reloaded with another config mid-rollout, paused around the reload: Triton takes
        # seconds to load it, and while its config cannot be read it holds nothing, so a rollout of
        # 1 s intervals could end before the reload did (it never held once, in a full run).
        assert admin_call(gw.url, "POST", "/admin/models/qc/rollout/pause")[0] == 200
        reload(drifted[1])
        assert admin_call(gw.url, "POST", "/admin/models/qc/rollout/resume")[0] == 200
        held = wait_for(lambda: (lambda d: d if "held:" in d["reason"] else None)(rollout_status(gw.url)), 30,
                        what="the rollout to hold")
        step = held["step"]  # the step it was at when the reload landed (the reload takes seconds: 0 or 1)
        assert held["state"] == "progressing" and step < 2, held["reason"]
        assert f"server {odd} reports instance_group 2 instances (KIND_CPU) for 'qc'" in held["reason"]
        assert held["drift"][0]["server"] == odd and held["drift"][0]["field"] == "instance_group"
        models = {m["name"]: m for m in admin_call(gw.url, "GET", "/admin/models")[1]["models"]}
        assert models["qc"]["drift"][0]["server"] == odd, models["qc"]
        verdicts = len(held["verdicts"])
        still = wait_for(lambda: (lambda d: d if len(d["verdicts"]) >= verdicts + 2 else None)(rollout_status(gw.url)),
                         30, what="two more intervals")
        assert (still["step"], still["weights"]) == (step, held["weights"]), "held: no more weight while it differs"
        reload(drifted[0])  # put back: the next healthy interval moves on
        doc = wait_for(lambda: (lambda d: d if d["step"] > step else None)(rollout_status(gw.url)), 30,
                       what="the rollout to move on")
        assert doc["drift"] == [] and doc["state"] == "progressing"
        assert [v for v in doc["verdicts"] if v.get("held")], "the held verdict is in the record"
