"""What a command does beyond what it names, said before it is done (the console's confirmation)
and in its answer (the API's ``warnings``, printed by ``gateway ctl``).

Each is read from the records as they are when the command arrives; the functions that decide
are pure (``*_effects``), the ``of_*`` ones read the store for them:

- a policy change (PUT, PATCH of the weights) during a rollout pauses it (a person's weights are
  never overwritten), ends a gradual rollback where it is, or is undone by a later resume or
  promote of a paused one; a PUT that leaves out a header rule, the sticky header or the shadow
  drops it;
- a rollout's start moves traffic: the canary goes to its first step even when it had more (a
  30% canary cut to 5%), and versions the rollout does not name lose theirs;
- ``promote`` or ``resume`` of a paused rollout puts the rollout's weights back over the ones a
  person set while it was paused.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from gateway.policy import PolicySpec, heaviest, target_order, with_weights
from gateway.rollout import steps
from gateway.rollout.phases import Phase, TransitionError
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.steps import Rollout
from gateway.store.base import StateStore


def _percent(value: Decimal | float | int) -> str:
    number = Decimal(str(value))
    return f"{int(number) if number == number.to_integral_value() else float(number)}%"


def _weights(weights: Mapping[str, Decimal | float | int]) -> str:
    shown = sorted(((v, w) for v, w in weights.items() if w), key=lambda item: target_order(item[0]))
    return ", ".join(f"{v}: {_percent(w)}" for v, w in shown) or "none"


def _rule(rule: Mapping[str, Any]) -> str:
    return f"{rule['header']}: {rule['equals']} -> version {rule['version']}"


def policy_effects(model: str, rollout: Mapping[str, Any] | None, before: PolicySpec | None,
                   after: PolicySpec | None) -> list[str]:
    """A policy write (``after`` None: a delete) against the model's rollout record and the policy it replaces."""
    found = []
    state = rollout.get("state") if rollout is not None else None
    if state == Phase.PROGRESSING.value and rollout is not None:
        found.append(f"the rollout of {model} (progressing, step {int(rollout['step']) + 1} of "
                     f"{len(rollout['steps'])}) pauses: it leaves weights a person set alone "
                     f"until `gateway ctl rollout resume {model}` (or promote, abort)")
    elif state == Phase.ROLLING_BACK.value:
        found.append(f"the gradual rollback of {model} ends at these weights (the canary stays rejected)")
    elif state == Phase.PAUSED.value:
        found.append(f"the rollout of {model} is paused: a resume or promote puts its own weights back "
                     "over these")
    if before is not None and after is not None:
        kept = {(r.header, r.equals, r.version) for r in after.rules}
        for rule in before.rules:
            if (rule.header, rule.equals, rule.version) not in kept:
                found.append(f"the header rule {_rule(rule.model_dump())} is dropped (this policy does not have it)")
        if before.sticky_header and not after.sticky_header:
            found.append(f"the sticky header {before.sticky_header} is dropped: users are no longer kept on "
                         "one version by it")
        if before.shadow is not None and after.shadow is None:
            found.append(f"the shadow to version {before.shadow.version} is dropped")
    elif before is not None and before.rules:
        found.append(f"{len(before.rules)} header rule(s) go with the policy")
    return found


def start_effects(model: str, spec: RolloutSpec, policy: PolicySpec | None) -> list[str]:
    """A rollout's first weights against the policy it replaces."""
    if policy is None:
        return []
    stable = spec.stable or heaviest(policy.weights)
    first = steps.begin(model, spec, stable, 0.0).weights()
    current = {v: w for v, w in policy.weights.items() if w}
    found = []
    had = current.get(spec.canary, Decimal(0))
    if had > first[spec.canary]:
        found.append(f"canary {spec.canary} takes {_percent(had)} now: the rollout starts it at "
                     f"{_percent(first[spec.canary])} (step 1), so {_percent(had - first[spec.canary])} of "
                     f"{model}'s traffic moves back to {stable}")
    dropped = {v: w for v, w in current.items() if v not in first}
    if dropped:
        found.append(f"{_weights(dropped)} of {model}'s traffic goes to the rollout's versions "
                     f"(weights now {_weights(current)}, then {_weights(first)})")
    return found


def command_effects(model: str, command: str, rollout: Mapping[str, Any], policy: PolicySpec | None) -> list[str]:
    """``promote`` / ``resume`` of a paused rollout whose weights a person changed."""
    if command not in ("promote", "resume") or rollout.get("state") != Phase.PAUSED.value:
        return []
    current = Rollout.from_document(dict(rollout))
    try:
        after = steps.on_command(current, command, time.time(), "preview").weights()
    except (TransitionError, ValueError):
        return []
    theirs = {v: w for v, w in (policy.weights if policy is not None else {}).items() if w}
    if theirs == {v: w for v, w in after.items() if w}:
        return []
    what = "resumes the paused rollout a step further" if command == "promote" else "resumes the paused rollout"
    return [f"{command} {what}, over the weights set while it was paused: {_weights(theirs)} become "
            f"{_weights(after)}"]


async def of_policy_change(store: StateStore, model: str, before: PolicySpec | None,
                           after: PolicySpec | None) -> list[str]:
    """``before``: the policy as this replica holds it (its book: no store read for it)."""
    rollout = await store.get_rollout(model)
    return policy_effects(model, rollout.document if rollout is not None else None, before, after)


async def of_weights(store: StateStore, model: str, before: PolicySpec | None,
                     weights: Mapping[str, object]) -> list[str]:
    try:
        after = with_weights(before, weights)
    except ValueError:
        return []  # refused by the change itself, with its own message
    return await of_policy_change(store, model, before, after)


async def of_start(store: StateStore, model: str, spec: RolloutSpec) -> list[str]:
    policy = await store.get_policy(model)
    return start_effects(model, spec, policy.spec if policy is not None else None)


async def of_command(store: StateStore, model: str, command: str) -> list[str]:
    rollout = await store.get_rollout(model)
    if rollout is None:
        return []
    policy = await store.get_policy(model)
    return command_effects(model, command, rollout.document, policy.spec if policy is not None else None)
