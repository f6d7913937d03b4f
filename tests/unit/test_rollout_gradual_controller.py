"""Gentle rollback through the controller, tick by tick (fake clock, metrics and Triton; the
in-memory store): the descent's weights, restarts, humans, critical failures, hooks, counters."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import Conflict
from gateway.policy import PolicySpec
from gateway.rollout.spec import RolloutSpec
from gateway.store.base import EventDraft
from tests.support import HookReceiver
from tests.unit.test_rollout_controller import SPEC, Harness

GRADUAL = RolloutSpec.model_validate({**SPEC.model_dump(), "rollback": {"mode": "gradual", "steps": [50, 20, 0]}})
HEALTHY = (100, 0, 0.004)
FAILING = (100, 30, 0.004)  # 30% errors: unhealthy, but not surely past the critical 50%
BROKEN = (100, 100, 0.004)  # every request fails: critical


@pytest.fixture
async def h() -> Harness:
    harness = Harness()
    await harness.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    return harness


async def failed_at_100(h: Harness, spec: RolloutSpec = GRADUAL) -> None:
    """Healthy up to the 100% step, then failure_limit (2) unhealthy intervals."""
    await h.controller.begin("qc", spec, "alice")
    for _ in range(3):
        await h.interval(canary=HEALTHY)
    assert await h.weights() == {"3": 100}
    for _ in range(2):
        await h.interval(canary=FAILING, stable=(0, 0, 0.004))


async def test_a_gradual_rollback_walks_the_weights_down_one_interval_at_a_time(h: Harness) -> None:
    with HookReceiver() as receiver:
        hooked = GRADUAL.model_copy(update={"webhooks": RolloutSpec.model_validate(
            {"canary": "3", "webhooks": [{"url": receiver.url("/hook")}]}).webhooks})
        await failed_at_100(h, hooked)
        state = await h.state()
        assert (state["state"], await h.weights()) == ("rolling_back", {"2": 50, "3": 50})
        assert state["descent"] == [50, 20, 0] and "rolling back gradually" in state["reason"]
        assert h.recorder.rollout_states["qc"][0] == "rolling_back"
        assert "rolling_back" in h.recorder.rollout_states["qc"][1], "the state gauge exports the new phase"
        await h.interval(canary=HEALTHY, seconds=5)  # half an interval: no step down yet
        assert await h.weights() == {"2": 50, "3": 50}
        await h.interval(canary=HEALTHY, seconds=5)
        assert (await h.state())["state"] == "rolling_back" and await h.weights() == {"2": 80, "3": 20}
        await h.interval(canary=HEALTHY)
        state = await h.state()
        assert (state["state"], state["applied"], await h.weights()) == ("rolled_back", True, {"2": 100})
        assert "error rate" in state["reason"] and "gradual rollback through 50% -> 20% -> 0% done" in state["reason"]
        for _ in range(3):
            await h.interval(canary=HEALTHY)
        assert (await h.state())["state"] == "rolled_back" and await h.weights() == {"2": 100}
        await h.stop_after_webhooks(5)
    events = [(b["event"], b["state"], b["weights"]["3"]) for b in receiver.bodies("/hook")]
    assert events == [("started", "progressing", 5), ("step", "progressing", 20), ("step", "progressing", 50),
                      ("step", "progressing", 100), ("rolled_back", "rolling_back", 50)]
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}, "counted once, when the descent started"
    actions = [e.action for e in await h.store.events("qc") if e.action.startswith("rollout_")]
    assert actions.count("rollout_rolling_back") == 1 and actions.count("rollout_rolled_back") == 1
    with pytest.raises(Conflict, match='"retry": true'):
        await h.controller.begin("qc", GRADUAL, "alice")


async def test_a_restarted_controller_carries_on_down_from_where_the_store_says(h: Harness) -> None:
    await failed_at_100(h)
    await h.interval(canary=HEALTHY)
    assert await h.weights() == {"2": 80, "3": 20}
    h.controller = h.new_controller()  # a new process: nothing in memory
    await h.interval(canary=HEALTHY, seconds=5)
    assert (await h.state())["state"] == "rolling_back" and await h.weights() == {"2": 80, "3": 20}
    await h.interval(canary=HEALTHY, seconds=5)
    assert (await h.state())["state"] == "rolled_back" and await h.weights() == {"2": 100}
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}


async def test_promote_and_resume_are_refused_and_abort_goes_to_zero_at_once(h: Harness) -> None:
    await failed_at_100(h)
    for command in ("promote", "resume", "pause"):
        with pytest.raises(Conflict, match=f"rolling back gradually.*cannot be {command}d"):
            await h.controller.command("qc", command, "bob")
    assert (await h.state())["state"] == "rolling_back" and await h.weights() == {"2": 50, "3": 50}
    await h.controller.command("qc", "abort", "bob")
    assert (await h.state())["state"] == "aborted" and await h.weights() == {"2": 100}
    await h.interval(canary=HEALTHY)
    assert (await h.state())["state"] == "aborted" and await h.weights() == {"2": 100}
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}
    with pytest.raises(Conflict, match='"retry": true'):  # the abort hurried the descent; the verdict stands
        await h.controller.begin("qc", GRADUAL, "alice")
    await h.controller.begin("qc", GRADUAL.model_copy(update={"retry": True}), "alice")
    assert (await h.state())["state"] == "progressing"


async def test_an_abort_before_any_verdict_needs_no_retry(h: Harness) -> None:
    await h.controller.begin("qc", GRADUAL, "alice")
    await h.controller.command("qc", "abort", "alice")
    await h.controller.begin("qc", GRADUAL, "alice")
    assert (await h.state())["state"] == "progressing"


async def test_a_critical_error_rate_during_the_descent_goes_straight_to_zero(h: Harness) -> None:
    await failed_at_100(h)
    await h.interval(canary=BROKEN, stable=(1000, 0, 0.004))
    state = await h.state()
    assert (state["state"], await h.weights()) == ("rolled_back", {"2": 100})
    assert "critical: canary error rate 100.00%" in state["reason"] and "at 50%" in state["reason"]
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}, "still the one rollback, for its first reason"


async def test_the_canary_not_ready_during_the_descent_goes_to_zero_on_the_next_tick(h: Harness) -> None:
    await failed_at_100(h)
    h.triton.ready["3"] = False
    await h.interval(canary=HEALTHY, seconds=0.5)
    state = await h.state()
    assert (state["state"], await h.weights()) == ("rolled_back", {"2": 100}) and "not READY" in state["reason"]


async def test_a_critical_error_rate_rolls_back_at_once_even_in_gradual_mode(h: Harness) -> None:
    await h.controller.begin("qc", GRADUAL, "alice")
    for _ in range(3):
        await h.interval(canary=HEALTHY)
    await h.interval(canary=BROKEN, stable=(0, 0, 0.004))  # one interval, failure_limit 2
    state = await h.state()
    assert (state["state"], await h.weights()) == ("rolled_back", {"2": 100})
    assert state["verdicts"][-1]["metric"] == "critical_error_rate"
    assert h.recorder.rollbacks == {("qc", "critical_error_rate"): 1}


async def test_the_statistical_judge_rolls_back_gradually_too(h: Harness) -> None:
    spec = RolloutSpec.model_validate({"canary": "3", "steps": [60, 100], "interval_s": 10,
                                       "rollback": {"mode": "gradual", "steps": [50, 20, 0]}})
    await h.controller.begin("qc", spec, "alice")
    for _ in range(2):
        await h.interval(canary=(1000, 300, 0.004), stable=(1000, 0, 0.004))
    state = await h.state()
    assert (state["state"], await h.weights()) == ("rolling_back", {"2": 50, "3": 50}), state["reason"]
    assert "error rate worse" in state["reason"] and state["descent"] == [50, 20, 0]
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}


async def test_a_human_weight_change_ends_the_descent_and_is_left_as_set(h: Harness) -> None:
    await failed_at_100(h)
    await h.policies.set_weights("qc", {"2": 90, "3": 10}, None, EventDraft("bob", "set_weights"))
    await h.interval(canary=HEALTHY, seconds=1)
    state = await h.state()
    assert state["state"] == "rolled_back" and "bob" in state["reason"] and "error rate" in state["reason"]
    assert await h.weights() == {"2": 90, "3": 10}, "the SRE's weights stand"
    for _ in range(3):
        await h.interval(canary=HEALTHY)
    assert await h.weights() == {"2": 90, "3": 10} and (await h.state())["state"] == "rolled_back"


async def test_unloading_a_version_of_a_rollout_rolling_back_is_refused(h: Harness) -> None:
    from gateway.services.lifecycle import ModelLifecycle

    await failed_at_100(h)
    lifecycle: Any = ModelLifecycle.__new__(ModelLifecycle)
    lifecycle.store = h.store
    with pytest.raises(Conflict, match="stable of its rolling_back rollout"):
        await lifecycle._refuse_if_referenced("qc", "2")
