"""The rollout controller: a reconcile tick over every active rollout, and its loop.

All state lives in the store, so any replica can run a tick and a restarted gateway
carries on at the same step. Only the holder of the ``rollout-controller`` lease runs the
loop. Each tick, per active rollout:

1. fast path: a canary Triton reports not READY, or that the data path saw fail with
   "version unavailable" / connection errors, is rolled back at once;
2. a policy revision newer than the one the rollout wrote means someone changed the
   weights by hand: the rollout pauses instead of overwriting them;
3. when the interval is over: judge the canary against the stable over the same window,
   step (pure), persist with compare-and-set, then apply the weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from gateway.background import Background
from gateway.errors import Conflict, GatewayError, MetricsUnavailable, NotFound, StaleRevision
from gateway.policy import PolicySpec, heaviest, with_weights
from gateway.rollout import steps
from gateway.rollout.analysis import judge
from gateway.rollout.phases import Phase, TransitionError
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.steps import Rollout
from gateway.services.policies import PolicyService
from gateway.services.triton_control import TritonControl
from gateway.store.base import EventDraft, StateStore, StoredRollout
from gateway.telemetry.recorder import Recorder, Window
from gateway.telemetry.sources import MetricsSource

log = logging.getLogger("gateway.rollout")
ACTOR = "rollout-controller"
LEASE = "rollout-controller"
FAST_PATH_KINDS = ("VersionUnavailable", "UpstreamUnavailable")
PHASES = tuple(phase.value for phase in Phase)


class RolloutController:
    def __init__(self, store: StateStore, triton: TritonControl, policies: PolicyService, source: MetricsSource,
                 recorder: Recorder, clock: Callable[[], float] = time.time, tick_s: float = 1.0,
                 lifecycle: Any = None, shadow: Any = None) -> None:
        self.lifecycle = lifecycle  # gateway.services.lifecycle.ModelLifecycle: unload_previous after promotion
        self.shadow = shadow  # gateway.proxy.shadow.ShadowMirror: shadow numbers in the status
        self.store = store
        self.triton = triton
        self.policies = policies
        self.source = source
        self.recorder = recorder
        self.clock = clock
        self.tick_s = tick_s
        self.holder = uuid.uuid4().hex
        self._seen_errors: dict[tuple[str, str, str], int] = {}
        self._background = Background()  # the loop, and unload tasks after promotions

    # -- commands from the admin API -----------------------------------------------------
    async def begin(self, model: str, spec: RolloutSpec, actor: str) -> Rollout:
        existing = await self.store.get_rollout(model)
        if existing is not None and Phase(existing.document["state"]).active:
            raise Conflict(f"model '{model}' already has an active rollout "
                           f"({existing.document['state']}); abort it first")
        policy = await self.store.get_policy(model)
        stable = spec.stable or await self._default_stable(model, policy.spec if policy else None)
        if stable == spec.canary:
            raise Conflict(f"version {stable} already takes most of the traffic: name another stable version")
        await self.triton.require_ready(model, {stable, spec.canary})
        for kind in FAST_PATH_KINDS:  # baselines: only errors from now on count
            self._new_errors(model, spec.canary, kind)
            self._new_errors(model, stable, kind)
        rollout = steps.begin(model, spec, stable, self.clock())
        stored = await self.store.put_rollout(model, rollout.document(), existing.revision if existing else 0)
        rollout = await self._apply(stored, rollout, actor)
        self._show_state(model, rollout.phase)
        await self.policies.audit(model, actor, "rollout_started", rollout.reason, at=self.clock())
        return rollout

    async def command(self, model: str, command: str, actor: str) -> Rollout:
        stored, rollout = await self._load(model)
        try:
            changed = steps.on_command(rollout, command, self.clock(), actor)
        except TransitionError as exc:
            raise Conflict(str(exc)) from None
        if command == "resume":  # the SRE's resume re-asserts the rollout's weights
            policy = await self.store.get_policy(model)
            changed = _with_revision(changed, policy.revision if policy else 0)
        result = await self._persist_and_apply(stored, changed, actor)
        await self.policies.audit(model, actor, f"rollout_{command}", result.reason, at=self.clock())
        return result

    async def status(self, model: str) -> dict[str, Any]:
        _, rollout = await self._load(model)
        doc = rollout.document()
        doc["live"] = await self._live_numbers(rollout)
        if self.shadow is not None:
            doc["shadow"] = {version: stats.document() for (m, version), stats in self.shadow.stats.items()
                             if m == model}
        return doc

    def _show_state(self, model: str, phase: Phase) -> None:
        """/metrics shows the phase through the recorder (the collector knows no rollout types)."""
        self.recorder.set_rollout_state(model, phase.value, PHASES)

    # -- the reconcile tick ----------------------------------------------------------------
    async def tick(self) -> None:
        for model, stored in (await self.store.list_rollouts()).items():
            rollout = Rollout.from_document(stored.document)
            self._show_state(model, rollout.phase)
            if not rollout.phase.active:
                continue
            try:
                await self._reconcile(stored, rollout)
            except StaleRevision:
                continue  # an admin command got there first; next tick sees it
            except GatewayError as exc:
                log.warning("rollout of %s: tick failed: %s", model, exc)

    async def _reconcile(self, stored: StoredRollout, rollout: Rollout) -> None:
        now = self.clock()
        lost = await self._canary_lost(rollout)
        if lost:
            await self._persist_and_apply(stored, steps.roll_back(rollout, now, lost), ACTOR, metric="canary_lost")
            return
        policy = await self.store.get_policy(rollout.model)
        if rollout.phase is Phase.PROGRESSING and policy is not None and policy.revision != rollout.policy_revision:
            latest = await self.store.events(rollout.model, limit=1)
            who = latest[0].actor if latest else "someone"
            paused = steps.on_command(rollout, "pause", now, f"{who} (manual policy change during the rollout)")
            await self._persist_and_apply(stored, paused, ACTOR)
            return
        if rollout.due(now):
            verdict = judge(rollout.spec, *await self._windows(rollout))
            judged = steps.on_verdict(rollout, verdict, now)
            metric = verdict.metric if judged.phase is Phase.ROLLED_BACK else None
            await self._persist_and_apply(stored, judged, ACTOR, metric=metric)
        elif policy is not None and _weights(policy.spec) != _nonzero(rollout.weights()) \
                and rollout.phase is Phase.PROGRESSING:
            await self._persist_and_apply(stored, rollout, ACTOR)  # heal a crash between our two writes

    async def _windows(self, rollout: Rollout) -> tuple[Window | None, Window | None]:
        seconds = rollout.spec.interval_s
        try:
            canary = await self.source.window(rollout.model, rollout.canary, seconds)
            stable = await self.source.window(rollout.model, rollout.stable, seconds)
        except MetricsUnavailable as exc:
            log.warning("rollout of %s: %s", rollout.model, exc)
            return None, None
        return canary, stable

    async def _canary_lost(self, rollout: Rollout) -> str | None:
        if rollout.canary_percent == 0:
            return None
        ready = await self.triton.is_version_ready(rollout.model, rollout.canary)
        if ready is False:
            return f"Triton reports version {rollout.canary} not READY"
        for kind in FAST_PATH_KINDS:
            canary_new = self._new_errors(rollout.model, rollout.canary, kind)
            stable_new = self._new_errors(rollout.model, rollout.stable, kind)
            if canary_new and not stable_new:  # both failing is Triton's outage, not the canary's fault
                return f"version {rollout.canary} failed with {kind} ({canary_new} requests) while stable did not"
        return None

    def _new_errors(self, model: str, version: str, kind: str) -> int:
        """Errors of this kind since the previous look (0 on the first look)."""
        key = (model, version, kind)
        count = self.recorder.upstream_errors.get(key, 0)
        previous = self._seen_errors.get(key)
        self._seen_errors[key] = count
        return 0 if previous is None else count - previous

    # -- persistence -------------------------------------------------------------------------
    async def _persist_and_apply(self, stored: StoredRollout, rollout: Rollout, actor: str,
                                 metric: str | None = None) -> Rollout:
        saved = await self.store.put_rollout(rollout.model, rollout.document(), stored.revision)
        if rollout.phase is not Phase(stored.document["state"]):
            self._show_state(rollout.model, rollout.phase)
            log.info(json.dumps({"type": "rollout", "model": rollout.model, "state": rollout.phase.value,
                                 "step": rollout.step, "actor": actor, "reason": rollout.reason}))
            await self.policies.audit(rollout.model, actor, f"rollout_{rollout.phase.value}", rollout.reason,
                                      at=self.clock())
            if rollout.phase is Phase.ROLLED_BACK:
                self.recorder.count_rollback(rollout.model, metric or "unhealthy")
        if rollout.phase is Phase.PAUSED:
            return rollout  # a paused rollout leaves the weights to the humans
        applied = await self._apply(saved, rollout, actor)
        promoted_now = rollout.phase is Phase.PROMOTED and Phase(stored.document["state"]) is not Phase.PROMOTED
        if promoted_now and rollout.spec.unload_previous and self.lifecycle is not None:
            self._cleanup(rollout)  # only once the promoted weights are in place
        return applied

    async def _apply(self, saved: StoredRollout, rollout: Rollout, actor: str) -> Rollout:
        """Set the policy to the rollout's weights and remember the revision we wrote."""
        policy = await self.store.get_policy(rollout.model)
        weights = rollout.weights()
        if policy is not None and policy.spec is not None and _weights(policy.spec) == _nonzero(weights):
            revision = policy.revision
        else:
            spec = with_weights(policy.spec if policy is not None else None, weights)
            expected = policy.revision if policy is not None else 0
            urgent = rollout.phase in (Phase.ROLLED_BACK, Phase.ABORTED)
            written = await self.policies.put(rollout.model, spec, expected,
                                               EventDraft(actor, "rollout_weights", rollout.reason),
                                               require_ready=not urgent)
            revision = written.revision
        if revision != rollout.policy_revision:
            rollout = _with_revision(rollout, revision)
            await self.store.put_rollout(rollout.model, rollout.document(), saved.revision)
        return rollout

    def _cleanup(self, rollout: Rollout) -> None:
        """After promotion, in the background: drain and unload the previous versions that
        take no traffic any more, keeping the newest ``keep_previous`` of them loaded."""
        async def unload() -> None:
            for version in await self.previous_versions(rollout):
                try:
                    await self.lifecycle.unload(rollout.model, version, ACTOR)
                except GatewayError as exc:
                    log.warning("rollout of %s: unloading version %s failed: %s", rollout.model, version, exc)

        self._background.spawn(unload())

    async def previous_versions(self, rollout: Rollout) -> list[str]:
        """Loaded versions other than the canary that no policy entry uses, newest first,
        minus the ``keep_previous`` newest ones: what promotion cleanup unloads."""
        serving = await self.lifecycle.serving(rollout.model)
        policy = await self.store.get_policy(rollout.model)
        used = policy.spec.versions() if policy is not None and policy.spec is not None else set()
        previous = sorted((v for v in serving if v != rollout.canary and v not in used), key=int, reverse=True)
        return previous[rollout.spec.keep_previous:]

    async def _load(self, model: str) -> tuple[StoredRollout, Rollout]:
        stored = await self.store.get_rollout(model)
        if stored is None:
            raise NotFound(f"model '{model}' has no rollout")
        return stored, Rollout.from_document(stored.document)

    async def _default_stable(self, model: str, policy: PolicySpec | None) -> str:
        if policy is not None:
            return heaviest(policy.weights)
        ready = [v for v, state in (await self.triton.versions(model)).items() if state.state == "READY"]
        if not ready:
            raise Conflict(f"model '{model}' has no READY version on Triton")
        return max(ready, key=int)  # Triton's own default for unversioned requests

    async def _live_numbers(self, rollout: Rollout) -> dict[str, Any]:
        live = {}
        for version in (rollout.stable, rollout.canary):
            try:
                window = await self.source.window(rollout.model, version, rollout.spec.interval_s)
            except MetricsUnavailable:
                continue
            p99 = window.quantile(0.99)
            live[version] = {"requests": window.requests, "errors": window.errors,
                             "error_rate": window.error_rate, "p99_ms": None if p99 is None else round(p99 * 1000, 3)}
        return live

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._background.spawn(self._run())

    async def stop(self) -> None:
        await self._background.cancel_all()

    async def _run(self) -> None:
        while True:
            try:
                if await self.store.acquire_lease(LEASE, self.holder, ttl_s=max(3.0, self.tick_s * 3)):
                    await self.tick()
            except GatewayError as exc:
                log.warning("rollout controller tick failed: %s", exc)
            except Exception:  # never let one bad tick stop the loop for good
                log.exception("rollout controller tick crashed")
            await asyncio.sleep(self.tick_s)


def _weights(spec: PolicySpec | None) -> dict[str, Decimal]:
    return {} if spec is None else _nonzero(spec.weights)


def _nonzero(weights: dict[str, Decimal]) -> dict[str, Decimal]:
    return {v: Decimal(w) for v, w in weights.items() if w}


def _with_revision(rollout: Rollout, revision: int) -> Rollout:
    return dataclasses.replace(rollout, policy_revision=revision)
