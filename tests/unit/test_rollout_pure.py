"""Pure rollout logic: the phase table, the analysis, and the step function."""

from __future__ import annotations

import itertools

import pytest

from gateway.rollout import steps
from gateway.rollout.analysis import Outcome, Verdict, judge
from gateway.rollout.phases import ALLOWED, Phase, TransitionError, check
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import LATENCY_BOUNDS, Window

SPEC = RolloutSpec(canary="3", stable="2", steps=[5, 20, 50, 100], interval_s=10, min_requests=50,
                   failure_limit=2, max_error_rate=0.01, max_p99_ratio=1.5, judge="thresholds")


def window(version: str, requests: int, errors: int = 0, latency_s: float = 0.004) -> Window:
    hist = [0] * (len(LATENCY_BOUNDS) + 1)
    index = next(i for i, bound in enumerate(LATENCY_BOUNDS) if latency_s <= bound)
    hist[index] = requests
    return Window("qc", version, 10, requests, errors, 0, tuple(hist))


@pytest.mark.parametrize(("source", "target"), [
    (s, t) for s, t in itertools.product(Phase, Phase) if t not in ALLOWED[s]])
def test_every_forbidden_edge_is_refused(source: Phase, target: Phase) -> None:
    with pytest.raises(TransitionError):
        check(source, target)


def test_final_phases_have_no_way_out() -> None:
    for final in (Phase.PROMOTED, Phase.ROLLED_BACK, Phase.ABORTED):
        assert ALLOWED[final] == frozenset() and not final.active


@pytest.mark.parametrize(("canary", "stable", "outcome", "metric"), [
    (None, None, Outcome.ERROR, None),
    (window("3", 10), window("2", 500), Outcome.INCONCLUSIVE, None),
    (window("3", 0), window("2", 0), Outcome.INCONCLUSIVE, None),
    (window("3", 100, errors=30), window("2", 1000), Outcome.UNHEALTHY, "error_rate"),
    (window("3", 100, latency_s=0.25), window("2", 1000, latency_s=0.004), Outcome.UNHEALTHY, "p99_ratio"),
    (window("3", 100, latency_s=0.005), window("2", 1000, latency_s=0.004), Outcome.HEALTHY, None),
    (window("3", 100, latency_s=0.25), window("2", 10, latency_s=0.004), Outcome.HEALTHY, None),
    (window("3", 100, errors=1), window("2", 1000), Outcome.HEALTHY, None),
])
def test_judge(canary: Window | None, stable: Window | None, outcome: Outcome, metric: str | None) -> None:
    verdict = judge(SPEC, canary, stable)
    assert verdict.outcome is outcome and verdict.metric == metric
    if outcome is Outcome.UNHEALTHY:
        assert verdict.observed is not None and verdict.threshold is not None
        assert verdict.observed > verdict.threshold


def test_absolute_p99_limit() -> None:
    spec = SPEC.model_copy(update={"max_p99_ms": 50.0, "max_p99_ratio": None})
    verdict = judge(spec, window("3", 100, latency_s=0.2), window("2", 100, latency_s=0.2))
    assert verdict.metric == "p99_ms" and verdict.observed is not None and verdict.observed > 50


def healthy() -> Verdict:
    return judge(SPEC, window("3", 100), window("2", 1000))


def unhealthy() -> Verdict:
    return judge(SPEC, window("3", 100, errors=50), window("2", 1000))


def inconclusive() -> Verdict:
    return judge(SPEC, window("3", 1), window("2", 1000))


def test_healthy_verdicts_walk_every_step_then_promote() -> None:
    rollout = steps.begin("qc", SPEC, "2", now=0)
    seen = [rollout.weights()]
    for i in range(4):
        rollout = steps.on_verdict(rollout, healthy(), now=10.0 * (i + 1))
        seen.append(rollout.weights())
    assert rollout.phase is Phase.PROMOTED
    assert [w["3"] for w in seen] == [5, 20, 50, 100, 100]
    assert rollout.weights() == {"2": 0, "3": 100}
    assert [h["to"] for h in rollout.history] == ["progressing"] * 4 + ["promoted"]


def test_failure_limit_consecutive_unhealthy_verdicts_roll_back() -> None:
    rollout = steps.on_verdict(steps.begin("qc", SPEC, "2", 0), unhealthy(), 10)
    assert rollout.phase is Phase.PROGRESSING and rollout.consecutive_failures == 1 and rollout.step == 0
    rollout = steps.on_verdict(rollout, unhealthy(), 20)
    assert rollout.phase is Phase.ROLLED_BACK and rollout.weights() == {"2": 100, "3": 0}
    assert "error rate" in rollout.reason and "2 unhealthy intervals" in rollout.reason
    assert rollout.canary_requests == 200


def test_a_healthy_verdict_resets_the_failure_count() -> None:
    rollout = steps.begin("qc", SPEC, "2", 0)
    for now, verdict in enumerate([unhealthy(), healthy(), unhealthy()], start=1):
        rollout = steps.on_verdict(rollout, verdict, now * 10.0)
    assert rollout.phase is Phase.PROGRESSING and rollout.consecutive_failures == 1 and rollout.step == 1


def test_no_data_holds_the_step_and_counts_nothing() -> None:
    rollout = steps.begin("qc", SPEC, "2", 0)
    rollout = steps.on_verdict(rollout, unhealthy(), 10)
    for i in range(20):
        rollout = steps.on_verdict(rollout, inconclusive(), 20.0 + 10 * i)
    assert rollout.phase is Phase.PROGRESSING and rollout.step == 0
    assert rollout.consecutive_failures == 1, "inconclusive is neither success nor failure"
    assert len(rollout.verdicts) == steps.KEEP_VERDICTS


def test_metric_errors_pause_after_the_error_limit_never_roll_back() -> None:
    rollout = steps.begin("qc", SPEC, "2", 0)
    error = judge(SPEC, None, None)
    for i in range(SPEC.error_limit):
        rollout = steps.on_verdict(rollout, error, 10.0 * (i + 1))
    assert rollout.phase is Phase.PAUSED and "metrics unreadable" in rollout.reason
    assert rollout.consecutive_failures == 0


def test_manual_gates_wait_for_promote() -> None:
    spec = SPEC.model_copy(update={"manual_gates": True})
    rollout = steps.on_verdict(steps.begin("qc", spec, "2", 0), healthy(), 10)
    assert rollout.awaiting_promote and rollout.step == 0 and not rollout.due(1000)
    rollout = steps.on_command(rollout, "promote", 11, "alice")
    assert rollout.step == 1 and not rollout.awaiting_promote and "alice" in rollout.reason


def test_commands() -> None:
    rollout = steps.begin("qc", SPEC, "2", 0)
    paused = steps.on_command(rollout, "pause", 1, "bob")
    assert paused.phase is Phase.PAUSED and not paused.due(100)
    resumed = steps.on_command(paused, "resume", 50, "bob")
    assert resumed.phase is Phase.PROGRESSING and resumed.step_started_at == 50
    with pytest.raises(TransitionError, match="not paused"):
        steps.on_command(resumed, "resume", 51, "bob")
    aborted = steps.on_command(resumed, "abort", 52, "bob")
    assert aborted.phase is Phase.ABORTED and aborted.weights() == {"2": 100, "3": 0}
    for command in ("promote", "pause", "resume", "abort"):
        with pytest.raises(TransitionError):
            steps.on_command(aborted, command, 53, "bob")


def test_rolled_back_stays_rolled_back() -> None:
    rollout = steps.roll_back(steps.begin("qc", SPEC, "2", 0), 5, "canary lost")
    with pytest.raises(TransitionError):
        steps.on_command(rollout, "resume", 6, "bob")
    assert not rollout.due(10_000)


def test_document_round_trip() -> None:
    rollout = steps.on_verdict(steps.begin("qc", SPEC, "2", 0), unhealthy(), 10)
    again = steps.Rollout.from_document(rollout.document())
    assert again == rollout
    doc = rollout.document()
    assert doc["state"] == "progressing" and doc["weights"] == {"2": 95, "3": 5} and doc["verdicts"][0]["metric"]


@pytest.mark.parametrize(("body", "message"), [
    ({"canary": "3", "steps": [20, 10]}, "ascending"),
    ({"canary": "3", "steps": [0, 10]}, "above 0"),
    ({"canary": "3", "stable": "3"}, "different"),
    ({"canary": "3", "interval_s": 0.5}, "greater than or equal to 1"),
    ({"canary": "3", "bogus": 1}, "Extra"),
    ({"stable": "2"}, "canary"),
])
def test_invalid_rollout_specs(body: dict[str, object], message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        RolloutSpec.model_validate(body)
