"""Warm before weight: the stated steadiness test, the windows the controller takes, and the
rollout's moves out of its warm-up (rollout/warmup.py, rollout/steps.py), pure."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.policy import ShadowSpec
from gateway.rollout import steps
from gateway.rollout.phases import Phase
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.warmup import WarmupSpec, WarmupWindows, median_ms, steadiness
from gateway.telemetry.recorder import LATENCY_BOUNDS

WARMUP = WarmupSpec(window_s=2, windows=3, min_requests=10, tolerance=0.2, max_s=60)
SPEC = RolloutSpec(canary="3", stable="2", steps=[5, 50, 100], warmup=WARMUP)


def window(median_ms: float | None, requests: int = 50) -> dict[str, Any]:
    return {"at": 0.0, "seconds": 2.0, "requests": requests, "errors": 0, "median_ms": median_ms}


@pytest.mark.parametrize(("medians", "steady"), [
    ([40.0, 20.0, 10.0, 1.0, 1.1, 1.05], True),
    ([40.0, 1.0, 1.3], False),  # 30% apart: past the 20% tolerance
    ([1.0, 1.1], False),  # two windows of three
    ([], False),
])
def test_steady_when_the_last_windows_agree_within_the_tolerance(medians: list[float], steady: bool) -> None:
    found, words = steadiness(WARMUP, [window(m) for m in medians])
    assert found is steady, words


def test_a_window_with_too_few_answers_is_not_steady_and_says_so() -> None:
    found, words = steadiness(WARMUP, [window(1.0), window(1.0, requests=3), window(1.0)])
    assert not found and words.startswith("1 of the last 3 windows had fewer than 10 mirrored answers")
    found, words = steadiness(WARMUP, [window(1.0), window(1.1), window(1.05)])
    assert found and words == ("medians of the last 3 windows 1.00, 1.10, 1.05 ms: largest / smallest - 1 = 10%, "
                               "tolerance 20%")


def test_windows_are_taken_off_cumulative_counters() -> None:
    taken = WarmupWindows()
    hist = [0] * (len(LATENCY_BOUNDS) + 1)
    assert taken.close("qc", 10.0, 2.0, 0, 0, hist) is None  # opens the first window
    assert taken.close("qc", 11.0, 2.0, 50, 0, hist) is None  # not over yet
    busy = list(hist)
    busy[LATENCY_BOUNDS.index(0.05)] = 40  # 40 answers between 30 and 50 ms
    closed = taken.close("qc", 12.5, 2.0, 40, 2, busy)
    assert closed is not None and (closed["requests"], closed["errors"], closed["seconds"]) == (40, 2, 2.5)
    assert closed["median_ms"] == pytest.approx(40.0)
    assert median_ms(hist) is None


def test_a_warming_canary_takes_no_weight_and_its_mirror_is_the_policys_shadow() -> None:
    rollout = steps.begin("qc", SPEC, "2", 100.0)
    assert rollout.warming and rollout.canary_percent == 0 and rollout.weights() == {"2": 100, "3": 0}
    assert not rollout.due(1000.0), "no verdict while warming"
    assert rollout.shadow() == ShadowSpec(version="3", percent=Decimal(10))
    assert rollout.reason.startswith("started: warming up canary 3 on a mirrored 10% of live traffic")
    assert steps.Rollout.from_document(rollout.document()) == rollout


def test_a_steady_warm_up_starts_step_one_and_gives_the_shadow_back() -> None:
    rollout = steps.begin("qc", SPEC, "2", 100.0)
    rollout = steps.Rollout.from_document({**rollout.document(), "warmup": {**rollout.warmup, "shadow_before": {
        "version": "1", "percent": "5"}}})
    warm = steps.warmed(rollout, 130.0, [window(1.0)] * 3, True, "medians agree")
    assert (warm.phase, warm.step, warm.canary_percent, warm.step_started_at) == (
        Phase.PROGRESSING, 0, Decimal(5), 130.0)
    assert warm.warmup["state"] == "steady"
    assert warm.reason == "step 1 of 3: canary at 5% (warm after 30 s: medians agree)"
    assert warm.shadow() == ShadowSpec(version="1", percent=Decimal(5))


def test_past_its_time_limit_a_warm_up_pauses_or_proceeds_as_the_spec_says() -> None:
    rollout = steps.begin("qc", SPEC, "2", 100.0)
    paused = steps.warmed(rollout, 160.0, [], False, "0 of 3 windows")
    assert paused.phase is Phase.PAUSED and paused.warmup["state"] == "timed_out"
    assert paused.reason == ("paused: canary not steady after 60 s of warm-up (0 of 3 windows); resume to take step 1 "
                             "anyway, or abort")
    resumed = steps.on_command(paused, "resume", 200.0, "alice")
    assert not resumed.warming and resumed.canary_percent == 5 and resumed.shadow() is None
    onward = SPEC.model_copy(update={"warmup": WARMUP.model_copy(update={"on_timeout": "proceed"})})
    proceeded = steps.warmed(steps.begin("qc", onward, "2", 100.0), 160.0, [], False, "x")
    assert proceeded.phase is Phase.PROGRESSING and proceeded.canary_percent == 5
    assert "latency_warmup_s applies" in proceeded.reason


def test_a_rollout_without_warm_up_leaves_the_shadow_alone() -> None:
    rollout = steps.begin("qc", SPEC.model_copy(update={"warmup": None}), "2", 100.0)
    assert not rollout.warming and rollout.shadow() == steps.KEEP_SHADOW and rollout.warmup == {}


@pytest.mark.parametrize("bad", [{"percent": 0}, {"window_s": 0.1}, {"windows": 1}, {"on_timeout": "skip"},
                                 {"tolerance": 0}, {"max_s": 0}, {"extra": 1}])
def test_a_bad_warm_up_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RolloutSpec.model_validate({"canary": "3", "warmup": bad})
