"""Driving a model's policy toward a rollout's weights: level-triggered, and never over a human.

The rollout record holds the weights it wants (``Rollout.weights()``); :meth:`PolicyDriver.commit`
persists a rollout and brings the policy to those weights, and the controller calls it on every
tick until the policy shows them (``applied``), whatever the phase. Three writes, so that any
crash between two of them is recognised on the next tick:

1. the rollout, with ``pending_revision`` = the revision our policy write will produce;
2. the policy, compare-and-set on the revision read just before it (a human's PATCH that landed
   meanwhile makes it fail, and the next tick pauses the rollout instead of overwriting it);
3. the rollout again, ``applied`` with the revision written.

A crash after (2) leaves a policy at ``pending_revision`` with our weights: adopted as ours,
the rollout goes on at the same step. (1) is a compare-and-set on the policy's revision as
well, and (2) on the rollout record's (a store ``Guard``): an admin command served by any
replica and the lease holder's tick write through this same path, and whichever of the two
comes second is refused and reads both records again, so neither is lost.

A rollback moves traffic off the canary in this replica's policy book *before* the first
write, so it takes effect even when the store is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal
from typing import Any

from gateway.errors import UpstreamTimeout
from gateway.policy import PolicySpec, ShadowSpec, with_shadow, with_weights
from gateway.policy_book import PolicyBook
from gateway.rollout.fast_path import FastPath
from gateway.rollout.phases import Phase
from gateway.rollout.steps import KEEP_SHADOW, Rollout
from gateway.services.policies import PolicyService
from gateway.services.triton_control import TritonControl
from gateway.store.base import EventDraft, Fence, Guard, StateStore, StoredPolicy, StoredRollout


class PolicyMoved(Exception):
    """The policy changed between the tick's read and our write: a human got there first."""

    def __init__(self, policy: StoredPolicy | None) -> None:
        super().__init__("policy changed during the tick")
        self.policy = policy


class PolicyDriver:
    def __init__(self, store: StateStore, triton: TritonControl, policies: PolicyService, fast: FastPath) -> None:
        self.store = store
        self.triton = triton
        self.policies = policies
        self.book: PolicyBook = policies.book
        self.fast = fast
        self.overridden: set[str] = set()  # models whose book holds a rollback the store has not seen yet
        self.known: dict[str, StoredRollout] = {}  # the newest record per model: the controller's memory
        # model -> (a stored document, the Rollout read from it, whether that Rollout's document()
        # is the same document): a tick over rollouts with nothing new validates nothing and
        # serializes nothing (RolloutSpec's validation and dumps were most of an idle tick)
        self._read: dict[str, tuple[dict[str, Any], Rollout, bool]] = {}

    def read(self, stored: StoredRollout) -> Rollout:
        """The stored record as a Rollout: the one read before when its document is the same."""
        kept = self._read.get(stored.model)
        if kept is not None and (kept[0] is stored.document or kept[0] == stored.document):
            return kept[1]
        rollout = Rollout.from_document(stored.document)
        self._read[stored.model] = (stored.document, rollout, rollout.document() == stored.document)
        return rollout

    def keep_read(self, models: set[str] | dict[str, Any]) -> None:
        """Forget what was read of rollouts the store no longer lists."""
        for model in self._read.keys() - models:
            del self._read[model]

    async def save(self, base: StoredRollout, rollout: Rollout, fence: Fence | None,
                   guard: Guard | None = None) -> StoredRollout:
        kept = self._read.get(rollout.model)
        if guard is None and kept is not None and kept[1] is rollout and kept[2] \
                and (kept[0] is base.document or kept[0] == base.document):
            return base  # the record as it was read, unchanged: nothing to write
        document = rollout.document()
        if document == base.document:
            return base
        if fence is None:
            saved = await self.store.put_rollout(rollout.model, document, base.revision, guard)
        else:
            saved = await self.store.put_rollout_fenced(rollout.model, document, base.revision, fence, guard)
        self.known[rollout.model] = saved
        return saved

    async def commit(self, base: StoredRollout, rollout: Rollout, policy: StoredPolicy | None,
                     fence: Fence | None, actor: str) -> tuple[StoredRollout, Rollout]:
        """Persist ``rollout`` and drive the policy toward its weights; ``policy`` is what the
        caller decided on. PolicyMoved when the policy is no longer that revision."""
        weights = rollout.weights()
        if rollout.phase is Phase.PAUSED:  # a paused rollout leaves the weights to the humans,
            if not mirrors_paused_warmup(rollout, policy):  # but not a warm-up's copy of live traffic
                return await self.save(base, rollout, fence), rollout
            assert policy is not None and policy.spec is not None
            weights = dict(policy.spec.weights)  # only the mirror goes: shadow() is the one before the warm-up
        elif rollout.manual_revision and rollout.manual_revision == revision_of(policy):
            return await self.save(base, rollout, fence), rollout  # it yielded to this human's revision
        desired = nonzero(weights)
        shadow = rollout.shadow()  # a warm-up's mirror of the canary, or what the policy had before it
        if policy is not None and weights_of(policy.spec) == desired and shows_shadow(policy.spec, shadow):
            if rollout.applied and rollout.policy_revision == policy.revision:
                return await self.save(base, rollout, fence), rollout  # nothing new: no write
            done = _applied(rollout, policy.revision, f"policy revision {policy.revision} shows the weights")
            return await self.save(base, done, fence), done
        spec = with_weights(policy.spec if policy is not None else None, weights)
        if not isinstance(shadow, str):
            spec = with_shadow(spec, shadow)
        # moving traffic away from a rejected canary, to 0 or a step down, never waits on the store
        urgent = (rollout.canary_percent == 0 and not rollout.warming) or rollout.phase is Phase.ROLLING_BACK
        if urgent:
            if await self.fast.ready(rollout.model, rollout.stable) is False:
                held = dataclasses.replace(rollout, applied=False, apply_reason=(
                    f"stable version {rollout.stable} is not READY on Triton: traffic stays where it is served "
                    "until it is"))
                return await self.save(base, held, fence), held
            self.book.override(rollout.model, spec)  # at once, whether or not the store answers
            self.overridden.add(rollout.model)
        fresh = await self.store.get_policy(rollout.model)  # right before the write: nothing newer overwritten
        if revision_of(fresh) != revision_of(policy):
            raise PolicyMoved(fresh)
        expected = revision_of(fresh)
        intent = dataclasses.replace(rollout, applied=False, pending_revision=expected + 1,
                                     apply_reason=f"writing policy revision {expected + 1}")
        # Announced only while the policy is still at `expected`, and written only while the
        # announcement is the newest rollout record: an admin command on another replica and
        # this tick (or the other way round) cannot interleave so that one's record stands
        # beside the other's weights; the one that loses reads both again (StaleRevision).
        saved = await self.save(base, intent, fence, Guard("policy", expected))
        if not urgent and rollout.phase is not Phase.PAUSED:  # moving traffic *away* from a broken version
            # never waits on its health, nor does taking a mirror off while the weights stay as they are
            try:
                async with asyncio.timeout(self.fast.call_timeout_s):
                    await self.triton.require_ready(rollout.model, spec.versions())
            except TimeoutError:
                raise UpstreamTimeout(f"Triton did not answer within {self.fast.call_timeout_s:g}s") from None
        event = EventDraft(actor, "rollout_weights", rollout.reason)
        announced = Guard("rollout", saved.revision)
        if fence is None:
            written = await self.store.put_policy(rollout.model, spec, expected, event, announced)
        else:
            written = await self.store.put_policy_fenced(rollout.model, spec, expected, event, fence, announced)
        self.policies.apply(written)
        self.overridden.discard(rollout.model)
        done = _applied(intent, written.revision, f"policy revision {written.revision} written")
        return await self.save(saved, done, fence), done


def adopt_own_write(rollout: Rollout, policy: StoredPolicy | None) -> Rollout:
    """A crash between our policy write and the rollout's record of it: the policy is at the
    revision we announced, with our weights. It is ours, not a human's."""
    if rollout.pending_revision and policy is not None and policy.revision == rollout.pending_revision \
            and weights_of(policy.spec) == nonzero(rollout.weights()):
        return _applied(rollout, policy.revision, f"policy revision {policy.revision} adopted after a restart")
    return rollout


def mirrors_paused_warmup(rollout: Rollout, policy: StoredPolicy | None) -> bool:
    """A paused rollout's policy, as this rollout wrote it, still copies live traffic to the
    canary for a warm-up that is not running: the mirror comes off (a resumed warm-up puts it back)."""
    warmup = rollout.spec.warmup
    if rollout.phase is not Phase.PAUSED or warmup is None or not rollout.warmup or policy is None \
            or policy.spec is None or policy.revision != rollout.policy_revision:
        return False  # a human's revision is theirs, mirror and all
    return policy.spec.shadow == ShadowSpec(version=rollout.canary, percent=warmup.percent)


def manual_change(rollout: Rollout, policy: StoredPolicy | None) -> bool:
    """A policy revision this rollout did not write (nor already yielded to)."""
    return policy is not None and policy.revision not in (rollout.policy_revision, rollout.manual_revision)


def _applied(rollout: Rollout, revision: int, why: str) -> Rollout:
    return dataclasses.replace(rollout, applied=True, apply_reason=why, policy_revision=revision, pending_revision=0)


def shows_shadow(spec: PolicySpec | None, shadow: object) -> bool:
    """The policy mirrors what the rollout wants (KEEP_SHADOW: whatever it mirrors)."""
    return shadow == KEEP_SHADOW or (spec.shadow if spec is not None else None) == shadow


def revision_of(policy: StoredPolicy | None) -> int:
    return policy.revision if policy is not None else 0


def weights_of(spec: PolicySpec | None) -> dict[str, Decimal]:
    return {} if spec is None else nonzero(spec.weights)


def nonzero(weights: dict[str, Decimal]) -> dict[str, Decimal]:
    return {v: Decimal(w) for v, w in weights.items() if w}

