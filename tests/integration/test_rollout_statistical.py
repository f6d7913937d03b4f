"""The statistical judge (the default) against the real Triton with real traffic."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import BackgroundLoad, GatewayThread, admin_call, rollout_gateway, wait_for

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        yield running


def finished(url: str) -> dict[str, Any] | None:
    status, doc = admin_call(url, "GET", "/admin/models/qc/rollout")
    assert status == 200, doc
    return doc if doc["state"] != "progressing" else None


def start(url: str, **spec: Any) -> None:
    status, doc = admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", **spec})
    assert status == 200, doc


def test_a_canary_like_the_stable_is_promoted_with_evidence_per_metric(gateway: GatewayThread) -> None:
    """The latency floor is raised to +100%: under this unthrottled load on a shared 2-core host, the
    version taking 10% of the traffic measured 15-60% slower than the one taking 90% (the sample
    models run one Python process per version; see README, "The statistical judge")."""
    with BackgroundLoad(gateway.url):
        start(gateway.url, steps=[10, 50, 100], interval_s=2, max_latency_increase=1.0)
        doc = wait_for(lambda: finished(gateway.url), 90, what="the rollout to end")
    assert doc["state"] == "promoted", doc["reason"]
    healthy = [v for v in doc["verdicts"] if v["outcome"] == "healthy"]
    assert len(healthy) == 3
    metrics = {m["name"]: m for m in healthy[0]["metrics"]}
    # the three comparisons, and the absolute ceiling on the canary's own error rate (a guard that
    # only ever fails a canary: its pass says "not shown past the ceiling", not "fine")
    assert set(metrics) == {"error_rate", "capacity_error_rate", "client_error_rate", "latency", "error_ceiling"}
    ceiling = metrics.pop("error_ceiling")
    assert ceiling["verdict"] == "pass" and "not shown past the ceiling" in ceiling["summary"]
    assert all(m["verdict"] == "pass" and "fine" in m["summary"] for m in metrics.values())
    assert metrics["latency"]["p_value"] is not None and doc["evidence"]["latency"]["canary_n"] > 0


def test_a_canary_failing_30_percent_is_rolled_back_at_its_first_step(gateway: GatewayThread, faults: Faults) -> None:
    faults.set("qc", "3", error_rate=0.3)
    with BackgroundLoad(gateway.url):
        start(gateway.url, steps=[10, 50, 100], interval_s=2)
        doc = wait_for(lambda: finished(gateway.url), 30, what="the rollout to end")
    assert doc["state"] == "rolled_back" and doc["step"] == 0 and "error rate worse" in doc["reason"]
    failed = [m for m in doc["verdicts"][-1]["metrics"] if m["verdict"] == "fail"]
    assert failed and failed[0]["name"] == "error_rate" and failed[0]["e_value"] >= failed[0]["e_threshold"]
    status, again = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {"canary": "3"})
    assert status == 409 and '"retry": true' in again["error"]
