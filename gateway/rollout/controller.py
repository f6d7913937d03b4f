"""The rollout controller: a level-triggered reconcile tick over every rollout, and its loop.

All state lives in the store, so any replica can run a tick and a restarted gateway carries on
at the same step. Only the holder of the fenced ``rollout-controller`` lease
(:mod:`gateway.rollout.lease`, kept apart from the ticks) runs the loop, and every write it
makes carries the lease's epoch: a holder deposed mid-tick (a pause longer than the lease) has
its writes refused by the store. Each tick, per rollout not yet settled:

1. a policy revision the rollout did not write is a human's: an active rollout pauses, a
   finished one yields, and the human's weights are never overwritten;
2. a paused rollout is left alone (but for a paused warm-up's mirror, which comes off);
3. fast path (:mod:`gateway.rollout.fast_path`): failures that are the canary's own roll back
   at once;
4. a rollout warming up (spec ``warmup``) takes its windows of mirrored answers until its
   latency is steady, and only then its first step (:mod:`gateway.rollout.warmup`);
5. when the interval is over and the step's weights are in place: judge the canary against
   the stable (or the spec's baseline, a copy of it at the canary's weight) over the same
   window and step, the verdict saying where Triton's own statistics put the difference; a
   step the canary may not take yet (a server of its fleet serves it with another config) is
   held (:mod:`gateway.rollout.interval`);
6. drive the policy toward the rollout's weights (:mod:`gateway.rollout.driver`) until it
   shows them, whatever the phase; a final phase counts as applied only then.

While the store is down, the last lease holder keeps judging from memory; a rollback then
goes into this replica's policy book at once and into the store when it is back.

The SREs' commands (:mod:`gateway.rollout.commands`) run on any replica and write through the
same fenced commit as the tick; what the tick reads of telemetry is in
:mod:`gateway.rollout.readings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from gateway.background import Background
from gateway.errors import GatewayError, LeaseLost, NotFound, StaleRevision, StoreError
from gateway.policy import parse_target
from gateway.rollout import history, steps
from gateway.rollout.analysis import Outcome, Verdict
from gateway.rollout.checks import Checks
from gateway.rollout.commands import RolloutCommands
from gateway.rollout.driver import PolicyDriver, PolicyMoved, adopt_own_write, manual_change, mirrors_paused_warmup
from gateway.rollout.engine import TritonView
from gateway.rollout.fast_path import FastPath
from gateway.rollout.hooks import PHASE_EVENTS, Hooks
from gateway.rollout.interval import Intervals
from gateway.rollout.lease import ControllerLease
from gateway.rollout.phases import Phase
from gateway.rollout.readings import Samples, take_samples, watch, windows
from gateway.rollout.rollback import critical_verdict
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.steps import Rollout
from gateway.rollout.variant_steps import VariantSteps
from gateway.services.ensembles import FOLDED, LOADED, EnsembleCanaries
from gateway.services.policies import PolicyService
from gateway.services.replica_windows import ReplicaWindows
from gateway.services.triton_control import TritonControl
from gateway.store.base import Fence, StateStore, StoredPolicy, StoredRollout
from gateway.store.budget import bounded, call_budget
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import MetricsSource, RecorderSource

log = logging.getLogger("gateway.rollout")
ACTOR = "rollout-controller"
PHASES = tuple(phase.value for phase in Phase)


class RolloutController:
    def __init__(self, store: StateStore, triton: TritonControl, policies: PolicyService, source: MetricsSource,
                 recorder: Recorder, clock: Callable[[], float] = time.time, tick_s: float = 1.0,
                 lifecycle: Any = None, shadow: Any = None, lease_ttl_s: float = 3.0,
                 call_timeout_s: float = 1.5, prometheus_url: str | None = None,
                 history_per_model: int = history.KEEP_PER_MODEL, holder: str | None = None,
                 windows: ReplicaWindows | None = None) -> None:
        self.lifecycle = lifecycle  # gateway.services.lifecycle.ModelLifecycle: unload_previous after promotion
        self.shadow = shadow  # gateway.proxy.shadow.ShadowMirror: shadow numbers in the status
        self.store = bounded(store)  # within a tick each call gets call_timeout_s (see lead())
        self.triton = triton
        self.policies = policies
        self.source = source
        self.recorder = recorder
        # metrics_source recorder: the holder judges every replica's published windows (the fleet
        # view), not only its own recorder's (gateway.services.replica_windows)
        self.windows = windows
        self.clock = clock
        self.tick_s = tick_s
        self.lease_ttl_s = lease_ttl_s
        self.call_timeout_s = call_timeout_s  # every metrics query and Triton call of a tick, well inside the TTL
        self.holder = holder or uuid.uuid4().hex  # the replica's name: the store shows who judges
        self.fast = FastPath(recorder, triton, call_timeout_s)
        self.engine = TritonView(triton, call_timeout_s, getattr(triton, "repository", None))  # Triton's own view
        self.driver = PolicyDriver(self.store, triton, policies, self.fast)
        self._listed = self.driver.known  # the newest records seen: the tick's memory while the store is down
        self.lease = ControllerLease(self.store, self.holder, lease_ttl_s, tick_s, call_timeout_s,
                                     on_lost=self._deposed, on_held=self._restore_loaded_versions)
        # model -> (base revision, state the store has not taken, the metric that decided it)
        self._unsaved: dict[str, tuple[int, Rollout, str | None]] = {}
        self.starting: set[str] = set()  # models whose rollout start is writing its first step (commands)
        self._background = Background()  # the loop, and unload tasks after promotions
        self._restoring: asyncio.Task[Any] | None = None
        self.hooks = Hooks(clock)  # webhooks (queued, sent off the tick) and gates (asked in the tick)
        self.checks = Checks(prometheus_url, call_timeout_s, recorder.shadow,  # custom checks, shadow agreement
                             lambda model: getattr(self.policies.book.get(model), "shadow_version", None))
        self.commands = RolloutCommands(self)
        self.history_per_model = history_per_model  # finished rollouts kept per model (gateway.rollout.history)
        self.ensembles = EnsembleCanaries(triton)  # the variants of canaries inside ensembles
        self.variants = VariantSteps(self)
        self.intervals = Intervals(self)

    # -- commands from the admin API (gateway.rollout.commands) ---------------------------------
    async def begin(self, model: str, spec: RolloutSpec, actor: str) -> Rollout:
        return await self.commands.begin(model, spec, actor)

    async def command(self, model: str, command: str, actor: str) -> Rollout:
        return await self.commands.command(model, command, actor)

    async def status(self, model: str) -> dict[str, Any]:
        return await self.commands.status(model)

    async def acknowledge(self, model: str, actor: str) -> Rollout:
        return await self.commands.acknowledge(model, actor)

    def show_state(self, model: str, phase: Phase) -> None:
        """/metrics shows the phase through the recorder (the collector knows no rollout types)."""
        self.recorder.set_rollout_state(model, phase.value, PHASES)

    # -- the reconcile tick ----------------------------------------------------------------
    @property
    def judged(self) -> Recorder:
        """What the judge reads: the fleet view of every replica's windows, or this recorder."""
        return self.windows.view if self.windows is not None else self.recorder

    def judged_source(self) -> MetricsSource:
        return RecorderSource(self.windows.view) if self.windows is not None else self.source

    async def tick(self, fence: Fence | None = None) -> None:
        """One pass over every rollout; ``fence`` (the loop's lease) is checked on every write."""
        try:
            listed = await self.store.list_rollouts()
            self._listed.clear()
            self._listed.update(listed)
            self.driver.keep_read(listed)
        except StoreError as exc:
            log.warning("rollout controller: store unavailable (%s): judging from memory", exc)
        if self.windows is not None:  # after the listing: a rollout it knows is judged on its own windows
            try:
                await self.windows.refresh(dict(self._listed))  # every replica's windows since the last tick
            except StoreError as exc:
                log.warning("rollout controller: replicas' windows unavailable (%s): judging what it has", exc)
        for model, stored in list(self._listed.items()):
            if model in self.starting:  # its start commits its first step itself
                continue
            try:
                rollout = self._working(model, stored)
            except Exception as exc:  # one record this version cannot read must not stop every other rollout
                log.error("rollout of %s: stored record cannot be read (%s: %s): skipped", model,
                          type(exc).__name__, exc)
                continue
            self.show_state(model, rollout.phase)
            watch(self.judged, rollout)
            if rollout.settled:
                continue
            try:
                await self._reconcile(stored, rollout, fence)
                self._unsaved.pop(model, None)
            except StaleRevision:
                self._unsaved.pop(model, None)  # someone else wrote: next tick starts from the store
            except LeaseLost as exc:
                log.warning("rollout controller deposed: %s", exc)
                await self.lease.lost(fence)
                return
            except StoreError as exc:
                log.warning("rollout of %s: store unavailable (%s): kept in memory", model, exc)
            except GatewayError as exc:
                log.warning("rollout of %s: tick failed: %s", model, exc)
            except Exception:  # a bug in one rollout's tick must not stop every other model's
                log.exception("rollout of %s: tick failed unexpectedly", model)

    def _working(self, model: str, stored: StoredRollout) -> Rollout:
        """The store's rollout, or the newer state this replica could not save yet on top of it."""
        unsaved = self._unsaved.get(model)
        if unsaved is not None and unsaved[0] == stored.revision:
            return unsaved[1]
        self._unsaved.pop(model, None)
        return self.driver.read(stored)

    async def _reconcile(self, stored: StoredRollout, rollout: Rollout, fence: Fence | None) -> None:
        now = self.clock()
        policy = await self._policy(rollout.model)
        rollout = adopt_own_write(rollout, policy)
        if rollout.phase is not Phase.PAUSED and manual_change(rollout, policy):
            await self._yield(stored, rollout, policy, now, fence)
            return
        if rollout.phase is Phase.PAUSED:
            if mirrors_paused_warmup(rollout, policy):  # its pause's write failed: the mirror still comes off
                try:
                    await self.commit(stored, rollout, policy, fence, ACTOR)
                except PolicyMoved:
                    pass  # a human's revision: theirs stands, mirror and all
            return
        if rollout.variant.get("state") in (LOADED, FOLDED) and not rollout.phase.active and rollout.applied \
                and not rollout.manual_revision:
            await self.commit(stored, await self.variants.settle(rollout), policy, fence, ACTOR)
            return
        decided, metric = await self._decide(rollout, now)
        unsaved = self._unsaved.get(rollout.model)
        if metric is None and unsaved is not None and unsaved[1] == rollout:
            metric = unsaved[2]  # decided on an earlier tick, while the store was down
        try:
            await self.commit(stored, decided, policy, fence, ACTOR, metric)
        except PolicyMoved as moved:  # a human wrote during this tick: theirs stands
            await self._yield(stored, rollout, moved.policy, now, fence)
        except StoreError:
            if decided.step == rollout.step or decided.canary_percent == 0:  # hold, never advance, from memory
                self._unsaved[rollout.model] = (stored.revision, decided, metric)
            raise

    async def _policy(self, model: str) -> StoredPolicy | None:
        """The stored policy; while the store is down, what this replica's book holds."""
        try:
            return await self.store.get_policy(model)
        except StoreError:
            held = self.policies.book.get(model)
            if held is None:
                raise
            return StoredPolicy(model, held.spec, held.revision, 0.0)

    async def _decide(self, rollout: Rollout, now: float) -> tuple[Rollout, str | None]:
        if rollout.phase is Phase.ROLLING_BACK:
            return await self._descend(rollout, now), None  # its rollback was counted when it started
        if rollout.phase is not Phase.PROGRESSING:
            return rollout, None  # a final phase not applied yet: only its weights to drive
        lost, missing = await self.fast.check(rollout)
        if lost:
            return steps.roll_back(rollout, now, lost), "canary_lost"
        if rollout.warming:
            return self.intervals.warm(rollout, now), None
        if missing:  # nothing to judge the canary against, and its traffic goes elsewhere: a human decides
            return steps.on_command(rollout, "pause", now, f"{ACTOR} ({missing})"), None
        if not rollout.due(now):
            await self.engine.mark(rollout)  # Triton's statistics at the interval's first tick
        if rollout.applied and rollout.due(now):  # judge a step only once its weights are in place
            if self.fast.troubled_within(rollout.model, rollout.spec.interval_s + self.tick_s):
                verdict = Verdict(Outcome.INCONCLUSIVE, "Triton could not serve the model during this interval "
                                  "(down, restarting or reloading): its errors are no version's fault")
                self.take_samples(rollout)  # nor are its latencies: drop them
                self.engine.forget(rollout.model)
                return steps.on_verdict(rollout, verdict, now), None
            verdict, evidence = await self._judge(rollout, now)
            judged = await self.intervals.held(rollout, steps.on_verdict(rollout, verdict, now, evidence), verdict,
                                               now, evidence)
            if judged.variant and judged.verdicts:
                judged = await self.variants.attributed(judged)
            gated = await self.hooks.gated(rollout, judged, now, self.call_timeout_s)
            if gated is not judged:
                return gated, "gate" if gated.phase is Phase.ROLLED_BACK else None
            rolled_back = judged.phase in (Phase.ROLLED_BACK, Phase.ROLLING_BACK)
            return judged, verdict.metric if rolled_back else None
        return rollout, None

    async def _descend(self, rollout: Rollout, now: float) -> Rollout:
        """A gradual rollback: one step down per interval once the last step's weights are in
        place; a critical failure (the fast path's, or critical_error_rate) goes to 0 at once."""
        lost, _ = await self.fast.check(rollout)
        if lost:
            return steps.descend(rollout, now, lost)
        if not rollout.due(now):
            return rollout
        critical = None
        if not self.fast.troubled_within(rollout.model, rollout.spec.interval_s + self.tick_s):
            critical = critical_verdict(rollout.spec, *await windows(self.judged_source(), rollout,
                                                                      self.call_timeout_s * 2))
        if critical is None and not rollout.applied:
            return rollout  # the next step down waits for this one's weights; a critical failure does not
        return steps.descend(rollout, now, None if critical is None else critical.reason)

    async def _yield(self, stored: StoredRollout, rollout: Rollout, policy: StoredPolicy | None, now: float,
                     fence: Fence | None) -> None:
        """A human changed the policy: pause (active) or step aside (final); never overwrite."""
        latest = await self.store.events(rollout.model, limit=1)
        who = latest[0].actor if latest else "someone"
        revision = policy.revision if policy is not None else 0
        if rollout.phase is Phase.ROLLING_BACK:  # the verdict stands (no pause: a resume would retry the canary)
            changed = dataclasses.replace(steps.roll_back(rollout, now, f"{rollout.rollback_reason} (the gradual "
                                                          f"rollback ended by {who}'s manual policy change)"),
                                          manual_revision=revision, apply_reason=(
                f"manual policy change by {who} at revision {revision}: left as set"))
        elif rollout.phase.active:
            changed = steps.on_command(rollout, "pause", now, f"{who} (manual policy change during the rollout)")
        else:
            changed = dataclasses.replace(rollout, applied=False, manual_revision=revision, apply_reason=(
                f"manual policy change by {who} at revision {revision}: left as set"))
        await self.commit(stored, changed, policy, fence, ACTOR)

    async def _judge(self, rollout: Rollout, now: float) -> tuple[Verdict, dict[str, Any] | None]:
        """The interval's verdict and the statistical judge's evidence (:meth:`Intervals.judge`),
        naming the replicas whose published windows it covers (metrics_source: recorder)."""
        verdict, evidence = await self.intervals.judge(rollout, now)
        if self.windows is not None:
            names = self.windows.view.reporters(rollout.spec.interval_s)
            verdict = dataclasses.replace(verdict, replicas={"reported": len(names), "names": names})
        return verdict, evidence

    def take_samples(self, rollout: Rollout) -> list[Samples]:
        """The interval's samples of the canary and its reference (:func:`readings.take_samples`)."""
        return take_samples(self.judged, self.judged_source(), rollout)

    # -- persistence -------------------------------------------------------------------------
    async def commit(self, stored: StoredRollout, rollout: Rollout, policy: StoredPolicy | None,
                      fence: Fence | None, actor: str, metric: str | None = None) -> Rollout:
        before = Phase(stored.document["state"])
        stepped = rollout.phase is Phase.PROGRESSING and before is Phase.PROGRESSING \
            and rollout.step != stored.document["step"]
        try:
            _, rollout = await self.driver.commit(stored, rollout, policy, fence, actor)
        except GatewayError:
            saved = self.driver.known.get(rollout.model)
            if saved is not None and saved.revision > stored.revision:  # the change is stored; its weights are not
                if rollout.phase is not before:
                    await self._announce(rollout, actor, metric, before)
                elif stepped:
                    self.hooks.notify(rollout, "step")
            raise
        watch(self.judged, rollout)
        self.recorder.set_rollback_blocked(rollout.model, rollout.canary_percent == 0 and not rollout.applied
                                           and not rollout.manual_revision and "not READY" in rollout.apply_reason)
        if rollout.phase is not before:
            await self._announce(rollout, actor, metric, before)
        elif stepped:
            self.hooks.notify(rollout, "step")
        was_done = before is Phase.PROMOTED and stored.document.get("applied", False)
        if rollout.phase is Phase.PROMOTED and rollout.applied and not was_done and rollout.spec.unload_previous \
                and self.lifecycle is not None:
            self._cleanup(rollout)  # only once the promoted weights are in place
        return rollout

    async def _announce(self, rollout: Rollout, actor: str, metric: str | None, before: Phase | None = None) -> None:
        """A phase change the store has taken: metrics, log line, audit trail (once). A gradual
        rollback is counted and sent as ``rolled_back`` when it starts (the decision), so the
        end of its descent is only logged and audited."""
        self.show_state(rollout.model, rollout.phase)
        descent_over = before is Phase.ROLLING_BACK
        if rollout.phase in (Phase.ROLLED_BACK, Phase.ROLLING_BACK) and not descent_over:
            self.recorder.count_rollback(rollout.model, metric or "unhealthy")
        if not (descent_over and rollout.phase is Phase.ROLLED_BACK):
            self.hooks.notify(rollout, PHASE_EVENTS.get(rollout.phase, "resumed"))  # progressing: only from paused
        log.info(json.dumps({"type": "rollout", "model": rollout.model, "state": rollout.phase.value,
                             "step": rollout.step, "actor": actor, "reason": rollout.reason}))
        await self.policies.audit(rollout.model, actor, f"rollout_{rollout.phase.value}", rollout.reason,
                                  at=self.clock())
        if not rollout.phase.active:
            await history.archive(self.store, rollout.document(), self.history_per_model)

    @property
    def fence(self) -> Fence | None:
        """The lease's epoch while this replica holds it (:class:`ControllerLease`)."""
        return self.lease.fence

    @fence.setter
    def fence(self, fence: Fence | None) -> None:
        self.lease.fence = fence

    async def _deposed(self) -> None:
        """Another replica holds the lease now: forget what we could not save, and give the
        book back to the store's record (a local rollback is the new holder's to decide)."""
        self.fence = None
        if self.windows is not None:
            self.windows.stop_reading()  # taken again later, the lease starts from what the store kept
        self._unsaved.clear()
        for model in list(self.driver.overridden):
            try:
                stored = await self.store.get_policy(model)
            except StoreError:
                continue
            if stored is not None and stored.spec is not None:
                self.policies.book.override(model, stored.spec)
            self.driver.overridden.discard(model)

    def _cleanup(self, rollout: Rollout) -> None:
        """After promotion, in the background: drain and unload the previous versions that
        take no traffic any more, keeping the newest ``keep_previous`` of them loaded."""
        async def unload() -> None:
            previous = await self.previous_versions(rollout)
            if not previous:
                return
            try:  # one reload for them all (ModelLifecycle.unload_versions says why)
                await self.lifecycle.unload_versions(rollout.model, previous, ACTOR)
            except GatewayError as exc:
                log.warning("rollout of %s: unloading versions %s failed: %s", rollout.model, previous, exc)

        self._background.spawn(unload())

    async def previous_versions(self, rollout: Rollout) -> list[str]:
        """Loaded versions other than the canary that no policy entry uses, newest first,
        minus the ``keep_previous`` newest ones: what promotion cleanup unloads. None when the
        canary is another model's name: the versions of the model it replaced are not versions
        of the canary's model, and an unversioned target uses whichever is newest."""
        if parse_target(rollout.canary).renames(rollout.model):
            return []
        serving = await self.lifecycle.serving(rollout.model)
        policy = await self.store.get_policy(rollout.model)
        used = policy.spec.versions() if policy is not None and policy.spec is not None else set()
        previous = sorted((v for v in serving if v != rollout.canary and v not in used), key=int, reverse=True)
        return previous[rollout.spec.keep_previous:]

    async def load(self, model: str) -> tuple[StoredRollout, Rollout]:
        stored = await self.store.get_rollout(model)
        if stored is None:
            raise NotFound(f"model '{model}' has no rollout")
        return stored, Rollout.from_document(stored.document)

    def _restore_loaded_versions(self) -> None:
        """In the background (a reload takes seconds): the versions the gateway itself loaded or
        unloaded made so again, e.g. after Triton restarted with only its config.pbtxt's list;
        loads and unloads made on Triton's own port are left alone (``ModelLifecycle.restore``)."""
        if self.lifecycle is None or (self._restoring is not None and not self._restoring.done()):
            return

        async def restore() -> None:
            try:
                await self.lifecycle.restore()
            except GatewayError as exc:
                log.warning("restoring loaded versions failed: %s", exc)
            await self.variants.restore(self._listed)

        self._restoring = self._background.spawn(restore())

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._background.spawn(self._run())
        self._background.spawn(self.lease.keep())

    async def stop(self) -> None:
        await self._background.cancel_all()
        await self.lease.hand_over()
        await self.hooks.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.lead()
            except GatewayError as exc:
                log.warning("rollout controller tick failed: %s", exc)
            except TimeoutError:
                log.warning("rollout controller tick ran past %.1fs: cut short", self.lease.tick_bound_s)
            except Exception:  # never let one bad tick stop the loop for good
                log.exception("rollout controller tick crashed")
            with contextlib.suppress(TimeoutError):  # a lease just taken over ticks at once
                async with asyncio.timeout(self.tick_s):
                    await self.lease.taken.wait()
            self.lease.taken.clear()

    async def lead(self) -> None:
        """Keep or take the fenced lease (:meth:`ControllerLease.hold`), then tick with its epoch.

        Every store call of the tick (the lease's included) gets ``call_timeout_s``, and once
        one has failed the tick asks the store nothing more: a store that is locked or silent
        costs a tick one call timeout, so a rollback decided meanwhile reaches this replica's
        policy book within a tick or two, however long the store stays away."""
        with call_budget(self.call_timeout_s) as budget:
            held = self.fence is not None
            if not self.lease.keeping or not held:  # the keeper renews between ticks (gateway.rollout.lease)
                with call_budget(self.lease.renewal_budget_s()):
                    held = await self.lease.hold(budget)
            elif self.lease.store_away:  # its last renewal failed: the tick judges from memory, asking nothing
                budget.failure = "the lease was not renewed: the store is away"
            if held and self.fence is not None:
                async with asyncio.timeout(self.lease.tick_bound_s):
                    await self.tick(self.fence)
