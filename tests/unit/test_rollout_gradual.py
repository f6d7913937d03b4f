"""Gentle rollback, pure: the rollback spec, the critical error rate, and the descent step by step."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.rollout import steps
from gateway.rollout.phases import ALLOWED, Phase, TransitionError
from gateway.rollout.rollback import CRITICAL, critical_verdict
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import Window
from tests.unit.test_rollout_pure import SPEC, healthy, unhealthy, window

GRADUAL = SPEC.model_copy(update={"rollback": RolloutSpec.model_validate(
    {"canary": "3", "rollback": {"mode": "gradual", "steps": [50, 20, 0]}}).rollback})


def at_step(spec: RolloutSpec, step: int) -> steps.Rollout:
    """A rollout that reached ``spec.steps[step]`` through healthy intervals (10 s apart)."""
    rollout = steps.begin("qc", spec, "2", now=0)
    for i in range(step):
        rollout = steps.on_verdict(rollout, healthy(), now=10.0 * (i + 1))
    assert rollout.step == step
    return rollout


def fail(rollout: steps.Rollout, now: float) -> steps.Rollout:
    """failure_limit (2) unhealthy intervals."""
    return steps.on_verdict(steps.on_verdict(rollout, unhealthy(), now), unhealthy(), now + 10)


def test_gradual_rollback_goes_down_one_rollback_step_per_interval() -> None:
    rollout = fail(at_step(GRADUAL, 3), 40)  # the canary failed at 100%
    assert rollout.phase is Phase.ROLLING_BACK and rollout.phase.active
    assert rollout.weights() == {"2": 50, "3": 50} and rollout.step == 3
    assert "rolling back gradually" in rollout.reason and "error rate" in rollout.reason
    assert "step 1 of 3 down 50% -> 20% -> 0%" in rollout.reason
    doc = rollout.document()
    assert doc["state"] == "rolling_back" and doc["descent"] == [50, 20, 0]
    assert not rollout.due(55) and rollout.due(60), "the next step down after one interval"
    rollout = steps.descend(rollout, 60)
    assert rollout.phase is Phase.ROLLING_BACK and rollout.weights() == {"2": 80, "3": 20}
    assert "step 2 of 3" in rollout.reason and "error rate" in rollout.reason, "the reason stays with the descent"
    rollout = steps.descend(rollout, 70)
    assert rollout.phase is Phase.ROLLED_BACK and rollout.weights() == {"2": 100, "3": 0}
    assert "gradual rollback through 50% -> 20% -> 0% done" in rollout.reason and "error rate" in rollout.reason
    assert [h["to"] for h in rollout.history][-3:] == ["rolling_back", "rolling_back", "rolled_back"]
    assert not rollout.due(10_000) and not rollout.phase.active


def test_only_rollback_steps_below_the_canarys_weight_are_used() -> None:
    at_50 = fail(at_step(GRADUAL, 2), 30)
    assert at_50.phase is Phase.ROLLING_BACK and at_50.weights()["3"] == 20, "50% is not below 50%"
    assert at_50.document()["descent"] == [20, 0] and "step 1 of 2" in at_50.reason
    at_20 = fail(at_step(GRADUAL, 1), 20)
    assert at_20.phase is Phase.ROLLED_BACK and at_20.weights()["3"] == 0
    assert "no rollback step below the canary's 20%" in at_20.reason


def test_immediate_is_the_default() -> None:
    assert RolloutSpec(canary="3").rollback.mode == "immediate"
    rollout = fail(at_step(SPEC, 3), 40)
    assert rollout.phase is Phase.ROLLED_BACK and rollout.weights()["3"] == 0


def test_a_critical_verdict_rolls_back_at_once_whatever_the_mode_and_failure_limit() -> None:
    spec = GRADUAL.model_copy(update={"failure_limit": 5})
    critical = critical_verdict(spec, window("3", 40, errors=40), window("2", 1000))
    assert critical is not None and critical.metric == CRITICAL
    rollout = steps.on_verdict(at_step(spec, 3), critical, 40)
    assert rollout.phase is Phase.ROLLED_BACK and rollout.weights()["3"] == 0
    assert rollout.reason.startswith("rolled back to 2: critical: canary error rate 100.00% (40 of 40)")


def test_a_critical_failure_during_the_descent_goes_straight_to_zero() -> None:
    rollout = fail(at_step(GRADUAL, 3), 40)
    rollout = steps.descend(rollout, 60, "Triton reports version 3 UNAVAILABLE, not READY")
    assert rollout.phase is Phase.ROLLED_BACK and rollout.weights()["3"] == 0
    assert "not READY (during the gradual rollback, at 50%)" in rollout.reason


def errors(requests: int, failed: int) -> Window:
    return window("3", requests, errors=failed)


@pytest.mark.parametrize(("canary", "stable", "limit", "critical"), [
    (errors(10, 10), window("2", 1000), 0.5, True),  # lower bound 0.501
    (errors(100, 70), window("2", 1000), 0.5, True),
    (errors(9, 9), window("2", 1000), 0.5, False),  # 0.46: too few requests to be sure
    (errors(3, 2), window("2", 1000), 0.5, False),
    (errors(100, 60), window("2", 1000), 0.5, False),  # past 0.5, but not surely: the judge's to weigh
    (errors(100, 70), window("2", 1000, errors=600), 0.5, False),  # the stable fails as much: not the canary's
    (errors(100, 70), window("2", 0), 0.5, True),  # the 100% step: no stable traffic to compare with
    (errors(100, 70), None, 0.5, True),
    (errors(100, 70), window("2", 1000), 0.8, False),
    (errors(100, 100), window("2", 1000), None, False),  # switched off
    (errors(0, 0), window("2", 1000), 0.5, False),
    (None, None, 0.5, False),  # unreadable metrics are never critical
])
def test_critical_error_rate(canary: Window | None, stable: Window | None, limit: float | None,
                             critical: bool) -> None:
    spec = SPEC.model_copy(update={"critical_error_rate": limit})
    verdict = critical_verdict(spec, canary, stable)
    assert (verdict is not None) is critical
    if verdict is not None:
        assert verdict.metric == CRITICAL and verdict.threshold == limit and verdict.observed is not None


def test_promote_pause_and_resume_are_refused_during_the_descent_and_abort_goes_to_zero() -> None:
    rollout = fail(at_step(GRADUAL, 3), 40)
    for command in ("promote", "pause", "resume"):
        with pytest.raises(TransitionError, match=f"rolling back gradually .* cannot be {command}d: abort it"):
            steps.on_command(rollout, command, 45, "bob")
    aborted = steps.on_command(rollout, "abort", 45, "bob")
    assert aborted.phase is Phase.ABORTED and aborted.weights() == {"2": 100, "3": 0}


def test_the_phase_table_allows_the_descent_and_nothing_back() -> None:
    assert ALLOWED[Phase.ROLLING_BACK] == {Phase.ROLLING_BACK, Phase.ROLLED_BACK, Phase.ABORTED}
    assert Phase.ROLLING_BACK in ALLOWED[Phase.PROGRESSING]
    assert Phase.ROLLING_BACK not in ALLOWED[Phase.PAUSED]


def test_a_descent_survives_the_store_and_an_old_record_loads() -> None:
    rollout = steps.descend(fail(at_step(GRADUAL, 3), 40), 60)
    again = steps.Rollout.from_document(rollout.document())
    assert again == rollout and again.weights() == {"2": 80, "3": 20}
    old: dict[str, Any] = steps.begin("qc", SPEC, "2", 0).document()
    for key in ("rollback_step", "rollback_reason", "descent"):
        del old[key]
    for key in ("rollback", "critical_error_rate"):
        del old["spec"][key]
    loaded = steps.Rollout.from_document(old)
    assert loaded.rollback_step == 0 and loaded.spec.rollback.mode == "immediate"
    assert loaded.spec.critical_error_rate == 0.5


def test_the_spec_document_keeps_rollback_steps_as_numbers() -> None:
    doc = GRADUAL.model_copy(update={"rollback": RolloutSpec.model_validate(
        {"canary": "3", "rollback": {"mode": "gradual", "steps": [60, 12.5, 0]}}).rollback}).document()
    assert doc["rollback"] == {"mode": "gradual", "steps": [60, 12.5, 0]}


@pytest.mark.parametrize(("rollback", "message"), [
    ({"mode": "gradual", "steps": [20, 50, 0]}, "strictly descending"),
    ({"mode": "gradual", "steps": [50, 50, 0]}, "strictly descending"),
    ({"mode": "gradual", "steps": [50, 20]}, "end at 0"),
    ({"mode": "gradual", "steps": [150, 20, 0]}, "less than or equal to 100"),
    ({"mode": "gradual", "steps": [50, -5, 0]}, "greater than or equal to 0"),
    ({"mode": "gradual", "steps": []}, "at least 1"),
    ({"mode": "slowly"}, "'immediate' or 'gradual'"),
    ({"mode": "gradual", "step": [50, 0]}, "Extra"),
])
def test_invalid_rollback_specs(rollback: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RolloutSpec.model_validate({"canary": "3", "rollback": rollback})


@pytest.mark.parametrize("rate", [0, 1, 1.5, -0.1])
def test_invalid_critical_error_rates(rate: float) -> None:
    with pytest.raises(ValidationError, match="critical_error_rate"):
        RolloutSpec.model_validate({"canary": "3", "critical_error_rate": rate})


def test_valid_rollback_specs() -> None:
    spec = RolloutSpec.model_validate({"canary": "3", "rollback": {"mode": "gradual", "steps": [0]},
                                       "critical_error_rate": None})
    assert spec.rollback.steps == [Decimal(0)] and spec.critical_error_rate is None


def test_ctl_status_shows_where_the_descent_is() -> None:
    from rich.console import Console

    from gateway.ctl.views import rollout_view

    rollout = steps.descend(fail(at_step(GRADUAL, 3), 40), 60)
    console = Console(record=True, width=240)
    console.print(rollout_view(rollout.document()))
    shown = " ".join(console.export_text().split())
    assert "rollout of qc: rolling_back" in shown
    assert "rolling back gradually: 50% -> 20% -> 0%, one step per 10 s interval" in shown
    assert "canary at 20% (step 2 of 3 down 50% -> 20% -> 0%" in shown and "error rate" in shown
    console = Console(record=True, width=240)
    console.print(rollout_view(steps.begin("qc", GRADUAL, "2", 0).document()))
    assert "rolling back" not in console.export_text()


def test_ctl_rollout_start_sends_the_rollback_fields() -> None:
    import argparse

    from gateway.ctl.rollout import _rollout_start, add_rollout_parser

    parser = argparse.ArgumentParser()
    add_rollout_parser(parser.add_subparsers())

    class Api:
        body: Any = None

        def call(self, method: str, path: str, body: Any = None) -> Any:
            Api.body = body
            return {}

    for argv, expected in (
        ([], None),
        (["--rollback", "gradual"], {"mode": "gradual"}),
        (["--rollback-steps", "60,12.5,0"], {"mode": "gradual", "steps": [60.0, 12.5, 0.0]}),
        (["--rollback", "immediate"], {"mode": "immediate"}),
    ):
        args = parser.parse_args(["rollout", "start", "qc", "--canary", "3", "--critical-error-rate", "0.4", *argv])
        args.json = True
        _rollout_start(args, Api())  # type: ignore[arg-type]
        assert Api.body.get("rollback") == expected and Api.body["critical_error_rate"] == 0.4
