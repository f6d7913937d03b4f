"""A same-size baseline (``baseline`` in the rollout spec, Kayenta's design): a copy of the stable
loaded as a version of its own takes the canary's weight, and the judge compares the canary with
it. The fault it survives: a version's latency depends on its traffic share (Triton's Python
backend, measured with bench/canary_share.py), so a canary at 5% compared with a stable at 95% is
"slower" even when it is the same code."""

from __future__ import annotations

import argparse
import random
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.ctl.rollout import _rollout_start, add_rollout_parser
from gateway.ctl.views import rollout_view
from gateway.errors import Conflict
from gateway.policy import PolicySpec
from gateway.rollout import steps
from gateway.rollout.phases import Phase
from gateway.rollout.spec import RolloutSpec
from gateway.routing import Policy, bucket, compile_policy
from gateway.store.base import EventDraft
from gateway.telemetry.recorder import Outcome
from tests.unit.test_rollout_controller import Harness
from tests.unit.test_rollout_pure import healthy, unhealthy
from tests.unit.test_rollout_statistical import statistical_harness

SPEC = RolloutSpec(canary="3", baseline="1", steps=[5, 20, 50, 100], interval_s=10)


def numbers(weights: dict[str, Decimal]) -> dict[str, int]:
    return {version: int(weight) for version, weight in weights.items()}


def test_the_baseline_takes_the_canarys_weight_out_of_the_stables_share() -> None:
    rollout = steps.begin("qc", SPEC, "2", now=0)
    assert "judged against baseline 1" in rollout.reason and rollout.reference == "1"
    seen = [numbers(rollout.weights())]
    for i in range(3):
        rollout = steps.on_verdict(rollout, healthy(), now=10.0 * (i + 1))
        seen.append(numbers(rollout.weights()))
    assert seen == [{"2": 90, "1": 5, "3": 5}, {"2": 60, "1": 20, "3": 20}, {"2": 0, "1": 50, "3": 50},
                    {"2": 0, "1": 0, "3": 100}]
    rollout = steps.on_verdict(rollout, healthy(), now=40)
    assert rollout.phase is Phase.PROMOTED and numbers(rollout.weights()) == {"2": 0, "1": 0, "3": 100}
    assert rollout.document()["baseline"] == "1"


def test_past_50_percent_the_baseline_takes_what_the_canary_leaves_and_a_rollback_gives_all_to_the_stable() -> None:
    spec = SPEC.model_copy(update={"steps": [Decimal(30), Decimal(70), Decimal(100)]})
    rollout = steps.on_verdict(steps.begin("qc", spec, "2", now=0), healthy(), now=10)
    assert numbers(rollout.weights()) == {"2": 0, "1": 30, "3": 70}
    rolled = steps.on_verdict(steps.on_verdict(rollout, unhealthy(), 20), unhealthy(), 30)
    assert rolled.phase is Phase.ROLLED_BACK and numbers(rolled.weights()) == {"2": 100, "1": 0, "3": 0}
    assert sum(rolled.weights().values()) == 100


def test_a_stored_rollout_without_a_baseline_still_loads_and_judges_against_the_stable() -> None:
    rollout = steps.begin("qc", RolloutSpec(canary="3"), "2", now=0)
    doc = rollout.document()
    del doc["baseline"], doc["spec"]["baseline"]  # a record written before the field existed
    loaded = steps.Rollout.from_document(doc)
    assert loaded.reference == "2" and numbers(loaded.weights()) == {"2": 95, "3": 5}


@pytest.mark.parametrize(("stable", "baseline"), [("2", "1"), ("1", "2"), ("blue:2", "blue:1")])
def test_sticky_users_never_leave_the_canary_as_it_grows(stable: str, baseline: str) -> None:
    """The canary is the newest of the three (the spec and begin() see to it), so its bucket
    range comes first: raising its weight only moves users into it (the routing promise)."""
    users = [f"user-{i}" for i in range(4000)]
    canary = "blue:3" if ":" in stable else "3"
    spec = RolloutSpec(canary=canary, stable=stable, baseline=baseline, steps=[5, 20, 50, 100])
    rollout = steps.begin("qc", spec, stable, now=0)
    before: set[str] | None = None
    for i in range(4):
        policy = compile_policy("qc", PolicySpec.model_validate({"weights": numbers(rollout.weights())}))
        in_canary = {u for u in users if _version_of(policy, u) == canary}
        if before is not None:
            assert before <= in_canary, f"users left the canary at step {i + 1}"
        before = in_canary
        rollout = steps.on_verdict(rollout, healthy(), now=10.0 * (i + 1))
    assert before == set(users)


def _version_of(policy: Policy, user: str) -> str | None:
    point = bucket("qc", user)
    return next(entry[1].version for entry in policy.ranges if point < entry[0])


@pytest.mark.parametrize(("fields", "message"), [
    ({"baseline": "3"}, "neither the stable nor the canary"),
    ({"baseline": "2", "stable": "2"}, "neither the stable nor the canary"),
    ({"baseline": "4"}, "older version than the canary"),
    ({"baseline": "0"}, "a version is 1 to 19 digits without a leading 0"),
    ({"baseline": "x:1:2"}, "neither a version nor a model name"),
    ({"baseline": "1", "judge": "thresholds"}, "a baseline is for the statistical judge"),
    ({"canary": "2", "stable": "3", "baseline": "1"}, "must be newer than the stable"),
    ({"canary": "blue:3", "stable": "green:3", "baseline": "blue:2"}, "must be newer than the stable"),
])
def test_invalid_baselines_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RolloutSpec.model_validate({"canary": "3", **fields})


@pytest.fixture
async def h() -> Harness:
    return await statistical_harness()


async def interval(h: Harness, latency_s: dict[str, float], rng: random.Random) -> None:
    """One 10 s interval at the current weights' shares of 2000 requests, no errors; each
    version's successes at its own median latency, through the real recorder."""
    weights = await h.weights()
    counts = {version: 2000 * weights.get(version, 0) // 100 for version in ("1", "2", "3")}
    h.source.counts = {version: (n, 0, 0, 0) for version, n in counts.items()}  # type: ignore[attr-defined]
    for version, n in counts.items():
        for _ in range(min(n, 300)):
            h.recorder.record("qc", version, Outcome.SUCCESS, rng.lognormvariate(0, 0.3) * latency_s[version])
    h.clock.now += 10
    await h.controller.tick()


async def run(h: Harness, spec: RolloutSpec, latency_s: dict[str, float], seed: int) -> dict[str, Any]:
    await h.controller.begin("qc", spec, "alice")
    rng = random.Random(seed)
    for _ in range(30):
        if (await h.state())["state"] != "progressing":
            break
        await interval(h, latency_s, rng)
    return await h.state()


SHARE_PENALTY = {"1": 0.0008, "2": 0.0006, "3": 0.0008}  # the small-share versions run 33% colder


async def test_a_canary_slower_only_by_its_share_is_promoted_against_a_baseline(h: Harness) -> None:
    state = await run(h, SPEC, SHARE_PENALTY, seed=5)
    assert state["state"] == "promoted", state["reason"]
    assert state["baseline"] == "1" and await h.weights() == {"3": 100}
    latency = next(m for m in state["verdicts"][-1]["metrics"] if m["name"] == "latency")
    assert latency["verdict"] == "pass" and "vs baseline" in latency["summary"]
    assert h.recorder.watched() == []


async def test_the_same_canary_without_a_baseline_is_rolled_back(h: Harness) -> None:
    """The control: the judge is right that the canary is slower than the stable."""
    state = await run(h, SPEC.model_copy(update={"baseline": None}), SHARE_PENALTY, seed=5)
    assert state["state"] == "rolled_back" and "latency worse" in state["reason"]


async def test_a_canary_slower_than_its_baseline_is_rolled_back(h: Harness) -> None:
    state = await run(h, SPEC, {"1": 0.0008, "2": 0.0006, "3": 0.0011}, seed=6)
    assert state["state"] == "rolled_back" and "latency worse" in state["reason"]
    assert "vs baseline" in state["reason"] and await h.weights() == {"2": 100}


async def test_the_judge_samples_the_canary_and_the_baseline(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    assert set(h.recorder.watched()) == {("qc", "3"), ("qc", "1")}
    assert await h.weights() == {"2": 90, "1": 5, "3": 5}


async def test_a_baseline_that_is_the_stable_or_not_ready_is_refused_and_changes_nothing(h: Harness) -> None:
    await h.policies.put("qc", PolicySpec.model_validate({"weights": {"1": 100}}), 1, EventDraft("sre", "put"))
    with pytest.raises(Conflict, match="it is the stable version"):
        await h.controller.begin("qc", SPEC, "alice")  # no stable named: the heaviest, 1, is the baseline
    h.triton.ready["1"] = False
    with pytest.raises(Conflict, match="not READY"):
        await h.controller.begin("qc", SPEC.model_copy(update={"stable": "2"}), "alice")
    assert await h.store.get_rollout("qc") is None and await h.weights() == {"1": 100}
    assert h.recorder.watched() == []


def test_ctl_sends_the_baseline_and_shows_its_row() -> None:
    parser = argparse.ArgumentParser()
    add_rollout_parser(parser.add_subparsers())
    sent: list[Any] = []

    class Api:
        def call(self, method: str, path: str, body: Any = None) -> Any:
            sent.append(body)
            return {}

    for argv in (["--baseline", "1"], []):
        args = parser.parse_args(["rollout", "start", "qc", "--canary", "3", *argv])
        args.json = True
        _rollout_start(args, Api())  # type: ignore[arg-type]
    assert sent[0]["baseline"] == "1" and "baseline" not in sent[1]
    doc = steps.begin("qc", SPEC, "2", now=0).document()
    table = rollout_view(doc)
    roles = list(table.columns[1].cells)
    assert roles[:3] == ["stable", "baseline", "canary"]
    assert list(table.columns[2].cells)[:3] == ["90", "5", "5"]


def test_webhooks_name_the_baseline_only_when_there_is_one() -> None:
    import json

    from gateway.rollout.hooks import payload

    with_baseline = json.loads(payload(steps.begin("qc", SPEC, "2", now=0), "started", 0))
    assert with_baseline["baseline"] == "1" and with_baseline["weights"] == {"2": 90, "1": 5, "3": 5}
    without = json.loads(payload(steps.begin("qc", RolloutSpec(canary="3"), "2", now=0), "started", 0))
    assert "baseline" not in without



async def test_a_canary_older_than_the_stable_is_refused_with_a_baseline(h: Harness) -> None:
    """Redeploying an older version (stable 3, canary 2): the stable's range would sit before the
    canary's, and sticky users would move out of the canary at every step."""
    await h.policies.put("qc", PolicySpec.model_validate({"weights": {"3": 100}}), 1, EventDraft("sre", "put"))
    with pytest.raises(Conflict, match="must be newer than the stable"):
        await h.controller.begin("qc", RolloutSpec(canary="2", baseline="1"), "alice")
    assert await h.store.get_rollout("qc") is None and await h.weights() == {"3": 100}
    started = await h.controller.begin("qc", RolloutSpec(canary="2"), "alice")  # without one: fine
    assert numbers(started.weights()) == {"3": 95, "2": 5}


async def at_50_percent(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    rng = random.Random(7)
    while (await h.weights()).get("3") != 50:
        await interval(h, {"1": 0.0006, "2": 0.0006, "3": 0.0006}, rng)
    assert await h.weights() == {"1": 50, "3": 50}, "the stable takes nothing at 50%"


async def test_failures_the_canary_shares_with_the_baseline_are_not_its_own(h: Harness) -> None:
    """From 50% on the stable takes no traffic: "version unavailable" answers from the canary
    and the baseline alike (Triton reloading the model) must not roll the canary back at once."""
    await at_50_percent(h)
    for version in ("3", "1"):
        for _ in range(5):
            h.recorder.upstream_error("qc", version, "VersionUnavailable")
    h.clock.now += 0.5
    await h.controller.tick()
    assert (await h.state())["state"] == "progressing"
    for _ in range(5):
        h.recorder.upstream_error("qc", "3", "VersionUnavailable")
    h.clock.now += 0.5
    await h.controller.tick()
    state = await h.state()
    assert state["state"] == "rolled_back" and "failed with VersionUnavailable" in state["reason"]


async def test_a_baseline_that_stops_serving_pauses_the_rollout_where_it_is(h: Harness) -> None:
    """At 50% its requests would fall back to the canary, which would serve everything while the
    rollout claims 50%; below, every step would wait on it. Nothing to judge against: pause."""
    await at_50_percent(h)
    h.triton.ready["1"] = False
    h.clock.now += 0.5
    await h.controller.tick()
    state = await h.state()
    assert state["state"] == "paused" and "baseline version 1 is UNAVAILABLE" in state["reason"], state["reason"]
    assert await h.weights() == {"1": 50, "3": 50}, "a pause leaves the weights to the humans"
    h.triton.ready["1"] = True
    await h.controller.command("qc", "resume", "alice")
    h.clock.now += 0.5
    await h.controller.tick()
    assert (await h.state())["state"] == "progressing"


async def test_the_baseline_of_an_active_rollout_cannot_be_unloaded(h: Harness) -> None:
    from gateway.services.lifecycle import ModelLifecycle

    await h.controller.begin("qc", SPEC, "alice")
    lifecycle: Any = ModelLifecycle.__new__(ModelLifecycle)
    lifecycle.store = h.store
    with pytest.raises(Conflict, match="baseline of its progressing rollout"):
        await lifecycle._refuse_if_referenced("qc", "1")
