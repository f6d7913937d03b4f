"""One judge over every replica without Prometheus (issue 32, item 2): two replicas on Redis with
``metrics_source: recorder``; each answers half of the traffic, and the lease holder's verdict
counts all of it and names both replicas (it counted its own half only)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import TOKEN, GatewayThread, admin_call, drive, gateway_settings, wait_for

pytestmark = pytest.mark.triton


def test_the_holder_judges_every_replicas_traffic(triton: LocalTriton, redis_url: str) -> None:
    """~15 s: a rollout's first 10 s interval is waited out."""
    def settings() -> Any:
        return gateway_settings(triton.http_url, admin_token=TOKEN, store_url=redis_url, controller_tick_s=0.2,
                                policies={"qc": {"weights": {"2": 100}}})

    with GatewayThread(settings()) as one, GatewayThread(settings()) as two:
        holder = wait_for(lambda: one if one.app.rollouts.fence else two if two.app.rollouts.fence else None, 10,
                          what="a lease holder")
        status, doc = admin_call(one.url, "POST", "/admin/models/qc/rollout", {
            "canary": "3", "judge": "thresholds", "steps": [50, 100], "interval_s": 10, "min_requests": 10})
        assert status == 200, doc
        time.sleep(1.5)  # past the window's first second: every request below falls in the first interval

        async def both() -> tuple[Any, Any]:
            return await asyncio.gather(drive(one.url, 200, concurrency=4), drive(two.url, 200, concurrency=4))

        first, second = asyncio.run(both())
        assert first.statuses == second.statuses == {200: 200}
        canary = first.versions["3"] + second.versions["3"]
        assert first.versions["3"] > 20 and second.versions["3"] > 20  # both replicas served the canary

        def verdict() -> dict[str, Any] | None:
            verdicts = admin_call(holder.url, "GET", "/admin/models/qc/rollout")[1]["verdicts"]
            return verdicts[0] if verdicts else None

        judged = wait_for(verdict, 20, what="the first verdict")
    assert judged["canary_requests"] == canary, (judged, first.versions, second.versions)
    assert judged["stable_requests"] == first.versions["2"] + second.versions["2"]
    assert judged["replicas"]["reported"] == 2, judged["replicas"]
    assert sorted(judged["replicas"]["names"]) == sorted([one.app.replicas.replica, two.app.replicas.replica])
