"""What a command does beyond what it names (gateway/rollout/effects.py), case by case."""

from __future__ import annotations

from gateway.policy import PolicySpec
from gateway.rollout import steps
from gateway.rollout.effects import command_effects, policy_effects, start_effects
from gateway.rollout.spec import RolloutSpec


def spec(doc: dict[str, object]) -> PolicySpec:
    return PolicySpec.model_validate(doc)


def test_a_policy_change_names_each_part_it_drops_and_a_delete_its_rules() -> None:
    before = spec({"weights": {"2": 90, "3": 10}, "sticky_header": "x-user", "shadow": {"version": "3", "percent": 5},
                   "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]})
    assert policy_effects("qc", None, before, spec({"weights": {"2": 100}})) == [
        "the header rule x-canary: always -> version 3 is dropped (this policy does not have it)",
        "the sticky header x-user is dropped: users are no longer kept on one version by it",
        "the shadow to version 3 is dropped"]
    assert policy_effects("qc", None, before, before) == []
    assert policy_effects("qc", None, before, None) == ["1 header rule(s) go with the policy"]


def test_a_policy_change_during_a_gradual_rollback_ends_it_where_it_is() -> None:
    rollout = {"state": "rolling_back", "step": 1, "steps": [5, 50]}
    assert policy_effects("qc", rollout, None, spec({"weights": {"2": 100}})) == [
        "the gradual rollback of qc ends at these weights (the canary stays rejected)"]
    assert policy_effects("qc", {"state": "promoted"}, None, spec({"weights": {"2": 100}})) == []


def test_a_start_over_a_smaller_canary_moves_nothing_unsaid_and_a_resume_over_equal_weights_says_nothing() -> None:
    rollout = RolloutSpec(canary="3", steps=[5, 100])
    assert start_effects("qc", rollout, spec({"weights": {"2": 97, "3": 3}})) == []
    assert start_effects("qc", rollout, None) == []
    paused = steps.on_command(steps.begin("qc", rollout, "2", 0.0), "pause", 1.0, "alice")
    assert command_effects("qc", "resume", paused.document(), spec({"weights": {"2": 95, "3": 5}})) == []
    assert command_effects("qc", "resume", paused.document(), spec({"weights": {"2": 100}})) == [
        "resume resumes the paused rollout, over the weights set while it was paused: 2: 100% become 2: 95%, 3: 5%"]
    assert command_effects("qc", "abort", paused.document(), spec({"weights": {"2": 100}})) == []
