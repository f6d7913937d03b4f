"""Rollout webhooks and gates against the real Triton, with a local receiver recording the posts."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import (
    BackgroundLoad,
    GatewayThread,
    HookReceiver,
    admin_call,
    rollout_gateway,
    rollout_status,
    wait_for,
)

pytestmark = pytest.mark.triton
SECRET = "hook-secret"


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        yield running


@pytest.fixture
def receiver() -> Iterator[HookReceiver]:
    with HookReceiver() as running:
        yield running


status_of = rollout_status


def start(url: str, **spec: Any) -> tuple[int, Any]:
    """A rollout judged on errors only: hooks and gates are what these tests are about, and a
    p99 of 5-20 requests in 1 s measures the machine (an identical canary was rolled back at
    4.9x the stable's p99 under CPU load). Latency verdicts: tests/integration/test_rollout.py."""
    return admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", "judge": "thresholds",
                                                                  "interval_s": 1, "min_requests": 5,
                                                                  "max_p99_ratio": None, **spec})


def test_webhook_gets_started_each_step_and_promoted_signed(gateway: GatewayThread, receiver: HookReceiver) -> None:
    with BackgroundLoad(gateway.url, concurrency=4):
        status, doc = start(gateway.url, steps=[20, 50, 100],
                            webhooks=[{"url": receiver.url("/hook"), "secret": SECRET}])
        assert status == 200, doc
        assert doc["spec"]["webhooks"][0]["secret"] == "***", "the status never shows the secret"
        # the rollout's end first (60 s: intervals with too little traffic under CPU load add a
        # second each), and its reason if it was not promoted; then the webhook it sends
        ended = wait_for(lambda: (d := status_of(gateway.url))["state"] != "progressing" and d, 60,
                         what="the rollout to end")
        assert ended["state"] == "promoted", ended["reason"]
        wait_for(lambda: [b["event"] for b in receiver.bodies("/hook")][-1:] == ["promoted"], 10,
                 what="the promoted webhook")
    assert [b["event"] for b in receiver.bodies("/hook")] == ["started", "step", "step", "promoted"]
    for _, headers, body in receiver.posts:
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Gateway-Signature"], expected)
    started, second, third, promoted = receiver.bodies("/hook")
    assert (started["model"], started["stable"], started["canary"]) == ("qc", "2", "3")
    assert [(b["step"], b["weights"]) for b in (started, second, third)] == \
        [(1, {"2": 80, "3": 20}), (2, {"2": 50, "3": 50}), (3, {"2": 0, "3": 100})]
    assert second["verdict"]["outcome"] == "healthy" and second["verdict"]["canary_requests"] >= 5
    assert promoted["state"] == "promoted" and "promoted" in promoted["reason"]
    # counted once the answer is back, just after the receiver recorded the post
    hooks = wait_for(lambda: (d := status_of(gateway.url)["hooks"])["delivered"] >= 4 and d, 5, what="4 deliveries")
    assert (hooks["delivered"], hooks["failures"], hooks["last_error"]) == (4, 0, None)


def test_a_failing_pre_promotion_gate_holds_below_100_percent(gateway: GatewayThread, receiver: HookReceiver) -> None:
    receiver.answers["/gate"] = [500]
    with BackgroundLoad(gateway.url, concurrency=4):
        status, doc = start(gateway.url, steps=[20, 50], gates=[{"url": receiver.url("/gate"), "at": "pre_promotion"}])
        assert status == 200, doc
        held = wait_for(lambda: (d := status_of(gateway.url))["reason"].startswith("held") and d, 15, what="a hold")
        assert (held["state"], held["step"], held["weights"]) == ("progressing", 1, {"2": 50, "3": 50})
        assert "pre_promotion gate" in held["reason"] and "answered 500" in held["reason"]
        wait_for(lambda: len(receiver.bodies("/gate")) >= 2, 10, what="the gate asked again next interval")
        assert status_of(gateway.url)["state"] == "progressing"
        assert admin_call(gateway.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"2": 50, "3": 50}
        asked = receiver.bodies("/gate")[0]
        assert (asked["event"], asked["at"], asked["next_weights"]) == ("gate", "pre_promotion", {"2": 0, "3": 100})
        receiver.answers["/gate"] = [200]  # the gate opens: the next interval promotes
        done = wait_for(lambda: (d := status_of(gateway.url))["state"] != "progressing" and d, 10, what="promotion")
    assert done["state"] == "promoted"


def test_bad_hooks_are_4xx_and_a_refusing_pre_rollout_gate_starts_nothing(gateway: GatewayThread,
                                                                          receiver: HookReceiver) -> None:
    status, doc = start(gateway.url, webhooks=[{"url": "ftp://127.0.0.1/hook"}])
    assert status == 422 and "http(s) URL" in doc["error"]
    status, doc = start(gateway.url, webhooks=[{"url": receiver.url("/hook"), "on": ["exploded"]}])
    assert status == 422 and "webhooks.0.on.0" in doc["error"] and "'rolled_back'" in doc["error"]
    receiver.answers["/gate"] = [403]
    status, doc = start(gateway.url, gates=[{"url": receiver.url("/gate"), "at": "pre_rollout"}])
    assert status == 409 and "pre_rollout gate" in doc["error"] and "answered 403" in doc["error"]
    assert admin_call(gateway.url, "GET", "/admin/models/qc/rollout")[0] == 404
    assert admin_call(gateway.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"2": 100}
    assert receiver.posts and not receiver.bodies("/hook")
