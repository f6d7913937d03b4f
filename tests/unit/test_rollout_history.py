"""Issue 33 (friction 6): a new rollout no longer erases the previous one's evidence."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.policy import PolicySpec
from gateway.rollout.history import finished_rollouts
from gateway.rollout.spec import RolloutSpec
from gateway.store.base import EventDraft
from tests.unit.test_rollout_controller import SPEC, Harness

STATISTICAL = RolloutSpec.model_validate({
    "canary": "3", "steps": [5, 50, 100], "interval_s": 10, "failure_limit": 1, "latency_warmup_s": 0,
    "webhooks": [{"url": "http://127.0.0.1:9/hook", "secret": "s3cret-signing-key"}]})



def without_words(verdicts: list[dict[str, Any]]) -> Any:
    """The status adds each metric's words (gateway.rollout.evidence_words); the record keeps the numbers."""
    return as_json([{**v, "metrics": [{k: x for k, x in m.items() if k != "words"} for m in v["metrics"]]}
                    for v in verdicts])


def as_json(value: Any) -> Any:
    """As a store that keeps JSON gives it back (the memory store keeps tuples as tuples)."""
    return json.loads(json.dumps(value))


@pytest.fixture
async def h() -> Harness:
    harness = Harness()
    await harness.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    return harness


async def test_a_rolled_back_rollout_keeps_its_verdicts_and_evidence_after_the_next_one_starts(h: Harness) -> None:
    await h.controller.begin("qc", STATISTICAL, "alice")
    for _ in range(10):
        await h.interval(canary=(1000, 400, 0.004))
        if (await h.state())["state"] == "rolled_back":
            break
    first = await h.state()
    assert first["state"] == "rolled_back" and first["verdicts"] and first["evidence"]
    await h.controller.begin("qc", RolloutSpec.model_validate({**STATISTICAL.document(), "retry": True}), "bob")
    await h.interval(canary=(1000, 0, 0.004))
    listed = await finished_rollouts(h.store, "qc", 10)
    assert [d["state"] for d in listed] == ["rolled_back"]  # the running one is not finished
    kept = listed[0]
    assert kept["started_at"] == first["started_at"] and kept["reason"] == first["reason"]
    assert as_json(kept["verdicts"]) == without_words(first["verdicts"]) and kept["evidence"] == first["evidence"]
    assert kept["spec"]["webhooks"][0]["secret"] == "***"  # nothing a reader could sign with
    await h.controller.command("qc", "abort", "bob")
    listed = await finished_rollouts(h.store, "qc", 10)
    assert [d["state"] for d in listed] == ["aborted", "rolled_back"]
    assert [d["state"] for d in await finished_rollouts(h.store, "qc", 1)] == ["aborted"]
    await h.controller.stop()


async def test_history_is_bounded_per_model_oldest_dropped(h: Harness) -> None:
    h.controller.history_per_model = 2
    started = []
    for _ in range(4):
        await h.controller.begin("qc", SPEC, "alice")
        started.append((await h.state())["started_at"])
        await h.controller.command("qc", "abort", "alice")
        h.clock.now += 1
    # its record (the newest) and the two archived: the record is the newest archived one too
    assert [d["started_at"] for d in await finished_rollouts(h.store, "qc", 10)] == started[:1:-1]
    await h.controller.stop()
