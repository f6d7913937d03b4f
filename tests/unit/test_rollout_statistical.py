"""The controller with the statistical judge: windows and latency samples in, evidence kept."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from gateway.errors import Conflict
from gateway.policy import PolicySpec
from gateway.rollout.spec import RolloutSpec
from gateway.store.base import EventDraft
from gateway.telemetry.recorder import LATENCY_BOUNDS, Outcome, Window
from tests.unit.test_rollout_controller import Harness

SPEC = RolloutSpec(canary="3", steps=[5, 20, 50, 100], interval_s=10)  # judge: statistical, the default


class WindowSource:
    """Windows as the test sets them: (requests, errors, client errors, overloads) per version."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int, int, int]] = {}

    async def window(self, model: str, version: str, seconds: float) -> Window:
        requests, errors, client_errors, overloads = self.counts.get(version, (0, 0, 0, 0))
        hist = [0] * (len(LATENCY_BOUNDS) + 1)
        hist[2] = requests
        return Window(model, version, seconds, requests, errors, client_errors, tuple(hist), overloads)


async def statistical_harness() -> Harness:
    """The controller harness with windows as the test sets them, and qc all on version 2."""
    harness = Harness()
    harness.controller.source = harness.source = WindowSource()  # type: ignore[assignment]
    await harness.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    return harness


@pytest.fixture
async def h() -> Harness:
    return await statistical_harness()


async def interval(h: Harness, canary: tuple[int, int, int, int], stable: tuple[int, int, int, int],
                   rng: random.Random, canary_latency_s: float = 0.0006) -> None:
    """One interval: the windows, and the successes' latencies through the real recorder."""
    h.source.counts = {"3": canary, "2": stable}  # type: ignore[attr-defined]
    for version, counts, median in (("3", canary, canary_latency_s), ("2", stable, 0.0006)):
        for _ in range(min(counts[0] - counts[1], 300)):
            h.recorder.record("qc", version, Outcome.SUCCESS, rng.lognormvariate(0, 0.3) * median)
    h.clock.now += 10
    await h.controller.tick()


async def test_a_canary_answering_400_to_30_percent_is_rolled_back(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    assert set(h.recorder.watched()) == {("qc", "3"), ("qc", "2")}
    rng = random.Random(1)
    for _ in range(2):
        await interval(h, canary=(70, 0, 30, 0), stable=(1900, 0, 0, 0), rng=rng)
    state = await h.state()
    assert state["state"] == "rolled_back" and await h.weights() == {"2": 100}
    assert "4xx rate worse" in state["reason"]
    metrics = {m["name"]: m for m in state["verdicts"][-1]["metrics"]}
    assert metrics["client_error_rate"]["verdict"] == "fail" and metrics["client_error_rate"]["effect"] > 0.2
    assert h.recorder.watched() == [], "no latency sampling once the rollout is over"


async def test_overload_on_both_versions_rolls_nothing_back_and_a_good_canary_is_promoted(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    rng = random.Random(2)
    for _ in range(12):
        if (await h.state())["state"] != "progressing":
            break
        await interval(h, canary=(400, 0, 0, 200), stable=(4000, 0, 0, 2000), rng=rng)
    state = await h.state()
    assert state["state"] == "promoted", state["reason"]
    assert any("overload answers (not judged)" in v["reason"] for v in state["verdicts"])
    assert state["evidence"]["canary_overloads"] > 0 and state["evidence"]["errors"]["canary_n"] >= 400


async def test_a_slower_canary_is_rolled_back_on_its_latency_sample_after_the_warm_up(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    rng = random.Random(3)
    for _ in range(3):  # 30 s of warm-up at 10 s intervals: latency not judged yet
        await interval(h, canary=(300, 0, 0, 0), stable=(3000, 0, 0, 0), rng=rng, canary_latency_s=0.0009)
    state = await h.state()
    assert state["state"] == "progressing" and "not judged" in state["verdicts"][-1]["reason"]
    for _ in range(2):
        await interval(h, canary=(300, 0, 0, 0), stable=(3000, 0, 0, 0), rng=rng, canary_latency_s=0.0009)
    state = await h.state()
    assert state["state"] == "rolled_back" and "latency worse" in state["reason"]


async def test_a_rolled_back_canary_needs_retry_to_be_rolled_out_again(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.controller.command("qc", "abort", "alice")
    await h.controller.begin("qc", SPEC, "alice")  # aborted, not rolled back: no retry needed
    rng = random.Random(4)
    for _ in range(2):
        await interval(h, canary=(70, 0, 30, 0), stable=(1900, 0, 0, 0), rng=rng)
    assert (await h.state())["state"] == "rolled_back"
    with pytest.raises(Conflict, match='"retry": true'):
        await h.controller.begin("qc", SPEC, "alice")
    retried = await h.controller.begin("qc", SPEC.model_copy(update={"retry": True}), "alice")
    assert retried.phase.value == "progressing" and retried.evidence == {}


@pytest.mark.parametrize("bad", [
    {"judge": "vibes"}, {"max_latency_increase": 0}, {"max_error_rate_increase": -0.1},
    {"max_client_error_rate_increase": 2}, {"false_rollback_rate": 0.5}, {"inconclusive_limit": 0},
])
def test_bad_statistical_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RolloutSpec.model_validate({"canary": "3", **bad})
