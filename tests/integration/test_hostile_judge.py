"""A hostile client against the judge, on the real Triton: it cannot roll a healthy canary back by
aiming bad requests at it. Requests on which the client chose the version (a version in the URL,
a header rule of the policy) are counted in /metrics but not judged: they are not a sample of the
policy's split. Without that, malformed requests pinned to the canary (Triton answers 400) made
its 4xx rate ~90% against the stable's 0%, and the judge rolled it back within two intervals."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.upstream import HttpUpstream
from tests.support import (
    BackgroundLoad,
    GatewayThread,
    LoadThread,
    admin_call,
    rollout_gateway,
    rollout_status,
    wait_for,
)

pytestmark = pytest.mark.triton

MALFORMED = b'{"inputs": []}'  # Triton: 400, no INPUT0


class HostileClient(LoadThread):
    """Malformed requests aimed at version 3, pinned in the URL and through the header rule, as
    fast as two connections go, from a thread."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.statuses: Counter[int] = Counter()

    async def _run(self) -> None:
        client = HttpUpstream(self.url, max_connections=2, request_timeout_s=10)

        async def aim(path: bytes, headers: list[tuple[bytes, bytes]]) -> None:
            while not self._stop.is_set():
                response = await client.request(b"POST", path, headers, MALFORMED)
                await response.read()
                self.statuses[response.status] += 1

        await asyncio.gather(aim(b"/v2/models/qc/versions/3/infer", []),
                             aim(b"/v2/models/qc/infer", [(b"x-canary", b"always")]))
        await client.aclose()


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        status, doc = admin_call(running.url, "PUT", "/admin/models/qc/policy", {
            "weights": {"2": 100}, "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]})
        assert status == 200, doc
        yield running


def finished(url: str) -> dict[str, Any] | None:
    doc = rollout_status(url)
    return doc if doc["state"] != "progressing" else None


def test_bad_requests_aimed_at_the_canary_do_not_roll_it_back(gateway: GatewayThread) -> None:
    with BackgroundLoad(gateway.url, concurrency=4) as load, HostileClient(gateway.url) as hostile:
        # the latency floor as in test_rollout_statistical.py: unthrottled load on 2 shared cores
        status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {
            "canary": "3", "steps": [10, 50, 100], "interval_s": 2, "max_latency_increase": 1.0,
            "latency_warmup_s": 4})
        assert status == 200, doc
        doc = wait_for(lambda: finished(gateway.url), 90, what="the rollout to end")
    assert doc["state"] == "promoted", doc["reason"]
    assert set(load.result.statuses) == {200}, load.result.statuses
    assert hostile.statuses[400] > 200 and set(hostile.statuses) == {400}, hostile.statuses
    totals = gateway.app.recorder.totals
    for route in ("pinned", "rule"):  # counted where dashboards look, by route
        assert totals[("qc", "3", route, "http", "400")].count > 100
    metrics = {m["name"]: m for v in doc["verdicts"] for m in v.get("metrics", [])}
    assert metrics["client_error_rate"]["verdict"] == "pass", metrics["client_error_rate"]
    assert doc["evidence"]["client_errors"]["canary_events"] == 0, "the judge saw none of them"
