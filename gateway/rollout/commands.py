"""The SREs' commands on a rollout, from the admin API (and the console): start one; promote,
pause, resume or abort it; read its status.

They run on whichever replica received them, not only on the lease holder, so none of them
writes blindly: each is a compare-and-set on the rollout record (and, for the weights, on the
policy: :mod:`gateway.rollout.driver`), through the controller's own commit, so a command and
the lease holder's tick cannot lose each other's write, and both have the same effects
(hooks, audit trail, metrics)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gateway.errors import Conflict, GatewayError, MetricsUnavailable, StaleRevision
from gateway.policy import PolicySpec, heaviest, parse_target
from gateway.rollout import history, steps
from gateway.rollout.driver import PolicyMoved, adopt_own_write
from gateway.rollout.evidence_words import with_words
from gateway.rollout.phases import Phase, TransitionError
from gateway.rollout.spec import RolloutSpec, newest_first
from gateway.rollout.steps import Rollout
from gateway.services.engine_stats import EngineReading
from gateway.services.ensembles import LOADED, gateway_pins
from gateway.store.base import StoredPolicy, StoredRollout

if TYPE_CHECKING:
    from gateway.rollout.controller import RolloutController

COMMAND_ATTEMPTS = 5  # an admin command re-read and re-applied after a concurrent write, at most


class RolloutCommands:
    """The commands, run against the controller's store, Triton control and effects."""

    def __init__(self, controller: RolloutController) -> None:
        self.controller = controller

    async def begin(self, model: str, spec: RolloutSpec, actor: str) -> Rollout:
        c = self.controller
        existing = await c.store.get_rollout(model)
        if existing is not None and Phase(existing.document["state"]).active:
            raise Conflict(f"model '{model}' already has an active rollout "
                           f"({existing.document['state']}); abort it first")
        policy = await c.store.get_policy(model)
        stable = spec.stable or await self._default_stable(model, policy.spec if policy else None)
        if spec.composing is None:
            return await self._begin(model, spec, actor, existing, policy, stable, {})
        if parse_target(stable).renames(model):
            raise Conflict(f"the stable of '{model}' is {stable}, another model: a canary inside the ensemble splits "
                           f"'{model}' itself and its variant (name a version of it as the stable)")
        variant = await c.ensembles.prepare(model, spec.composing)
        variant["kept_pins"] = gateway_pins(existing.document if existing is not None else None)
        spec = spec.model_copy(update={"canary": variant["name"]})
        await c.ensembles.load(variant)
        try:
            _, reading = await c.ensembles.attribution(variant)  # where the composing versions' counters start
            return await self._begin(model, spec, actor, existing, policy, stable,
                                     {**variant, "state": LOADED, "reading": reading.document(),
                                      "started_reading": reading.document()})
        except BaseException:
            await c.ensembles.unload(variant)  # nothing of a rollout that did not start stays loaded
            raise

    async def _begin(self, model: str, spec: RolloutSpec, actor: str, existing: StoredRollout | None,
                     policy: StoredPolicy | None, stable: str, variant: dict[str, Any]) -> Rollout:
        """A start commits its own first step: the ticks leave the model alone until it has (a tick
        between the record's write and the start's policy write wrote the policy first, and the
        start then failed on its own rollout: 412 "policy ... is at revision 2, not 1")."""
        self.controller.starting.add(model)
        try:
            return await self._begin_guarded(model, spec, actor, existing, policy, stable, variant)
        finally:
            self.controller.starting.discard(model)

    async def _begin_guarded(self, model: str, spec: RolloutSpec, actor: str, existing: StoredRollout | None,
                             policy: StoredPolicy | None, stable: str, variant: dict[str, Any]) -> Rollout:
        c = self.controller
        if stable == spec.canary:
            raise Conflict(f"version {stable} already takes most of the traffic: name another stable version")
        if spec.baseline is not None:
            if stable == spec.baseline:
                raise Conflict(f"version {stable} takes most of the traffic, so it is the stable version: the "
                               "baseline must be a copy of it loaded as a version of its own")
            try:
                newest_first(spec.canary, stable)
            except ValueError as exc:
                raise Conflict(str(exc)) from None
        if existing is not None and steps.was_rolled_back(existing.document) \
                and existing.document["canary"] == spec.canary and not spec.retry:
            raise Conflict(f"version {spec.canary} of model '{model}' was rolled back ({existing.document['reason']}); "
                           f'start again with "retry": true to roll it out anyway')
        refused_checks = c.checks.refusal(spec)
        if refused_checks is not None:
            raise Conflict(refused_checks)
        versions = {stable, spec.canary} | ({spec.baseline} if spec.baseline else set())
        await c.triton.require_ready(model, versions)
        rollout = await self._like_for_like(dataclasses.replace(steps.begin(model, spec, stable, c.clock()),
                                                                policy_revision=policy.revision if policy else 0,
                                                                variant=variant))
        if rollout.warming:  # the policy's own shadow comes back once the warm-up is over
            shadow = policy.spec.shadow if policy is not None and policy.spec is not None else None
            rollout = dataclasses.replace(rollout, warmup={
                **rollout.warmup, "shadow_before": shadow.model_dump(mode="json") if shadow is not None else None})
        c.fast.count_from(rollout)  # only failures from now on count (the lease holder's: see FastPath.check)
        refused = await c.hooks.refusal(rollout, ("pre_rollout",), c.call_timeout_s)
        if refused is not None:
            raise Conflict(f"the pre_rollout gate {refused[0].url} refused the rollout: {refused[1]}")
        c.take_samples(rollout)  # the first interval's samples start now
        if existing is not None:  # archived when it ended; again here, in case that write failed
            await history.archive(c.store, existing.document, c.history_per_model)
        stored = await c.store.put_rollout(model, rollout.document(), existing.revision if existing else 0)
        c.driver.known[model] = stored  # what the commit below starts from, never an older attempt's
        try:
            rollout = await c.commit(stored, rollout, policy, None, actor)  # watches the latencies
        except Exception:
            # Refused (a version named by the policy not READY, a concurrent policy change):
            # take the record back, or it would block every retry as an "active rollout".
            saved = c.driver.known.get(model)
            revision = saved.revision if saved is not None and saved.revision > stored.revision else stored.revision
            c.driver.known.pop(model, None)
            if existing is not None:
                await c.store.put_rollout(model, existing.document, revision)
            else:
                await c.store.delete_rollout(model, revision)
            for version in (spec.canary, rollout.reference):
                c.recorder.unwatch_latencies(model, version)
            raise
        c.show_state(model, rollout.phase)
        c.hooks.notify(rollout, "started")
        await c.policies.audit(model, actor, "rollout_started", rollout.reason, at=c.clock())
        return rollout

    async def _like_for_like(self, rollout: Rollout) -> Rollout:
        """The rollout with Triton's view of its versions at the start: the canary's configuration
        compared with its reference's (in the record, and in the start's reason when they differ),
        the digest of its files; Conflict naming the server and the field when the servers of the
        canary's fleet do not all serve it with the same configuration."""
        engine = self.controller.engine
        drifted, _ = await engine.drift(rollout.model, rollout.canary)
        if drifted:
            raise Conflict(f"version {rollout.canary} of model '{rollout.model}' is not the same on every server of "
                           f"its fleet: {'; '.join(d.words(rollout.model) for d in drifted)}; load it alike "
                           "everywhere before it takes weight")
        versus = "stable" if rollout.spec.baseline is None else "baseline"
        likeness = await engine.likeness(rollout.model, rollout.reference, rollout.canary)
        words = likeness.words(versus)
        reason = rollout.reason if words == "configs alike" else f"{rollout.reason}; {words}"
        history = (*rollout.history[:-1], {**rollout.history[-1], "reason": reason})
        return dataclasses.replace(rollout, likeness=likeness.document(versus), reason=reason, history=history,
                                   files=await engine.files(rollout.model, rollout.canary) or {})

    async def command(self, model: str, command: str, actor: str) -> Rollout:
        """An SRE's promote / pause / resume / abort, on whichever replica received it: a
        compare-and-set on the rollout record (and, for its weights, on the policy; see
        :mod:`gateway.rollout.driver`). When the lease holder's tick wrote in between, the
        command reads both records again and is applied to what the tick left."""
        c = self.controller
        for _ in range(COMMAND_ATTEMPTS):
            stored, rollout = await c.load(model)
            policy = await c.store.get_policy(model)
            rollout = adopt_own_write(rollout, policy)  # a tick's policy write that just landed is the rollout's
            try:
                changed = steps.on_command(rollout, command, c.clock(), actor)
            except TransitionError as exc:
                raise Conflict(str(exc)) from None
            if command == "resume":  # the SRE's resume re-asserts the rollout's weights over theirs
                changed = dataclasses.replace(changed, policy_revision=policy.revision if policy else 0)
            try:
                result = await c.commit(stored, changed, policy, None, actor)
            except (PolicyMoved, StaleRevision):
                continue  # someone wrote in between: read both records again
            if command == "resume":  # here at once; on the lease holder when it reads the record
                c.fast.count_from(result)
            await c.policies.audit(model, actor, f"rollout_{command}", result.reason, at=c.clock())
            return result
        raise Conflict(f"the rollout of '{model}' kept changing while the {command} ran: try again")

    async def acknowledge(self, model: str, actor: str) -> Rollout:
        """Someone saw a finished rollback: it leaves the console's "Needs attention" (audited).
        Acknowledging one already acknowledged changes nothing."""
        c = self.controller
        for _ in range(COMMAND_ATTEMPTS):
            stored, rollout = await c.load(model)
            if rollout.phase.active or not steps.was_rolled_back(stored.document):
                raise Conflict(f"nothing to acknowledge: the rollout of '{model}' is {rollout.phase.value}; only a "
                               "finished rollback waits for an acknowledgement")
            if rollout.acknowledged is not None:
                return rollout
            seen = dataclasses.replace(rollout, acknowledged={"by": actor, "at": c.clock()})
            try:
                await c.driver.save(stored, seen, None)
            except StaleRevision:
                continue  # the controller wrote the record meanwhile (its weights applied): read it again
            await c.policies.audit(model, actor, "rollout_acknowledged", f"rollback seen: {rollout.reason}",
                                   at=c.clock())
            await history.archive(c.store, seen.document(), c.history_per_model)
            return seen
        raise Conflict(f"the rollout of '{model}' kept changing while the acknowledgement ran: try again")

    async def status(self, model: str) -> dict[str, Any]:
        c = self.controller
        _, rollout = await c.load(model)
        doc = rollout.document()
        doc["live"] = await self._live_numbers(rollout)
        doc["hooks"] = c.hooks.status(model)
        doc = history.redacted(doc)  # a status reader may not sign as the gateway
        versus = "baseline" if rollout.spec.baseline else "stable"
        doc["verdicts"] = [with_words(verdict, versus) for verdict in doc["verdicts"]]  # evidence in words too
        if c.shadow is not None:
            doc["shadow"] = {version: stats.document() for (m, version), stats in c.shadow.stats.items()
                             if m == model}
        if rollout.variant:
            doc["variant"] = await self._variant_status(rollout)
        return doc

    async def _variant_status(self, rollout: Rollout) -> dict[str, Any]:
        """The variant's record without Triton's raw counters, and the composing model's two
        versions in Triton since the rollout started (``attribution``; null when unreadable)."""
        variant = rollout.variant
        shown = {key: value for key, value in variant.items() if key not in ("reading", "started_reading")}
        try:
            since = EngineReading.from_document(variant.get("started_reading"))
            shown["attribution"], _ = await self.controller.ensembles.attribution(variant, since)
        except GatewayError as exc:
            shown["attribution"] = {"summary": f"Triton's statistics unreadable: {exc.message}"}
        return shown

    async def _default_stable(self, model: str, policy: PolicySpec | None) -> str:
        c = self.controller
        if policy is not None:
            return heaviest(policy.weights)
        ready = [v for v, state in (await c.triton.versions(model)).items() if state.state == "READY"]
        if not ready:
            raise Conflict(f"model '{model}' has no READY version on Triton")
        return max(ready, key=int)  # Triton's own default for unversioned requests

    async def _live_numbers(self, rollout: Rollout) -> dict[str, Any]:
        c = self.controller
        live = {}
        for version in dict.fromkeys((rollout.stable, rollout.reference, rollout.canary)):
            try:
                window = await c.source.window(rollout.model, version, rollout.spec.interval_s)
            except MetricsUnavailable:
                continue
            p99 = window.quantile(0.99)
            live[version] = {"requests": window.requests, "errors": window.errors,
                             "error_rate": window.error_rate, "p99_ms": None if p99 is None else round(p99 * 1000, 3)}
        return live
