"""The rollout state and its pure step function: (rollout, event, now) -> rollout.

Nothing here does I/O; the controller loads a :class:`Rollout` from the store, feeds it a
verdict or a command, persists what comes back and applies its weights. Every phase change
goes through :func:`_move` (checked against ``phases.ALLOWED``, stamped, kept in history).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gateway.policy import ShadowSpec
from gateway.rollout.analysis import BACKEND, CAPACITY, Outcome, Verdict
from gateway.rollout.phases import Phase, TransitionError, check
from gateway.rollout.rollback import CRITICAL
from gateway.rollout.spec import RolloutSpec
from gateway.store.records import lenient_model

KEEP_VERDICTS = 20
KEEP_SHADOW = "keep"  # Rollout.shadow(): leave the policy's shadow as it is


@dataclass(frozen=True)
class Rollout:
    model: str
    spec: RolloutSpec
    stable: str
    phase: Phase
    step: int  # index into spec.steps
    started_at: float
    step_started_at: float
    last_transition_at: float
    reason: str
    policy_revision: int = 0  # the policy revision the rollout last wrote: anything newer is a manual change
    consecutive_failures: int = 0
    consecutive_errors: int = 0
    awaiting_promote: bool = False
    canary_requests: int = 0  # judged requests that reached the canary, over the whole rollout
    verdicts: tuple[dict[str, Any], ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)  # the statistical judge's, over the whole rollout
    consecutive_inconclusive: int = 0
    history: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # Level-triggered apply (the controller's bookkeeping, not the state machine's):
    applied: bool = False  # the policy shows weights(); a final phase counts only once it does
    apply_reason: str = "not written yet"  # why not applied (or how it was)
    pending_revision: int = 0  # the policy revision our write in flight will produce: a crash after it resumes
    manual_revision: int = 0  # a policy revision a human wrote that this rollout yields to (final phases)
    # A gradual rollback (ROLLING_BACK): index into spec.rollback.steps, and why it started
    # (each step's reason repeats it). Defaults, so a rollout stored before them still loads.
    rollback_step: int = 0
    rollback_reason: str = ""
    # The fast path counts the canary's failures from this moment (the start, the last resume):
    # in the record, so the lease holder resets its counts whichever replica took the command.
    fast_path_from: float = 0.0
    # A finished rollback stays in the console's "Needs attention" until someone says they saw it:
    # {"by": actor, "at": time} (commands.acknowledge).
    acknowledged: dict[str, Any] | None = None
    # A canary inside an ensemble (spec.composing): the variant's record (services.ensembles.plan),
    # its state ("loaded", then "folded" on promotion, "unloaded" at the end) and Triton's last
    # reading of the composing model's versions (attribution). Empty for any other rollout.
    variant: dict[str, Any] = field(default_factory=dict)
    # Triton's own view (rollout.engine): the stable's and canary's configs compared at the start,
    # the canary's files then (where the gateway reads the repository), and the drift last found.
    likeness: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    drift: tuple[dict[str, Any], ...] = ()
    warmup: dict[str, Any] = field(default_factory=dict)  # warm before weight (rollout.warmup): its state, evidence

    @property
    def settled(self) -> bool:
        """Nothing left to drive: a final phase whose weights are in place (and whose ensemble
        variant is unloaded), or left to humans."""
        if self.phase.active:
            return False
        if self.manual_revision > 0:
            return True
        return self.applied and self.variant.get("state", "unloaded") == "unloaded"

    @property
    def folded(self) -> bool:
        """A promoted ensemble canary whose version the ensemble itself now pins: the traffic
        goes back to the ensemble (the variant runs the same stages) before it is unloaded."""
        return self.phase is Phase.PROMOTED and self.variant.get("state") in ("folded", "unloaded")

    @property
    def canary(self) -> str:
        return self.spec.canary

    @property
    def warming(self) -> bool:
        """Warming up (rollout.warmup): the canary takes mirrored copies, no weight yet."""
        return self.phase is Phase.PROGRESSING and self.warmup.get("state") == "warming"

    def shadow(self) -> ShadowSpec | None | str:
        """What the policy's shadow must be: the canary's mirror while warming, what the policy had
        before once the warm-up is over; KEEP_SHADOW (as it is) for a rollout without a warm-up."""
        if self.warming:
            assert self.spec.warmup is not None
            return ShadowSpec(version=self.canary, percent=self.spec.warmup.percent)
        if not self.warmup:
            return KEEP_SHADOW
        before = self.warmup.get("shadow_before")
        return ShadowSpec.model_validate(before) if before else None

    @property
    def canary_percent(self) -> Decimal:
        if self.warming:
            return Decimal(0)
        if self.phase is Phase.PROMOTED:
            return Decimal(100)
        if self.phase in (Phase.ROLLED_BACK, Phase.ABORTED):
            return Decimal(0)
        if self.phase is Phase.ROLLING_BACK:
            return self.spec.rollback.steps[self.rollback_step]
        return self.spec.steps[self.step]

    @property
    def descent(self) -> list[Decimal]:
        """The rollback steps a gradual rollback goes through: those below the step it failed at."""
        rollback = self.spec.rollback
        return rollback.steps[rollback.descent_from(self.spec.steps[self.step]):]

    @property
    def reference(self) -> str:
        """The version the canary is judged against: the baseline when there is one."""
        return self.spec.baseline or self.stable

    def weights(self) -> dict[str, Decimal]:
        if self.folded:
            return {self.stable: Decimal(100), self.canary: Decimal(0)}
        canary = self.canary_percent
        if self.spec.baseline is None:
            return {self.stable: Decimal(100) - canary, self.canary: canary}
        baseline = min(canary, Decimal(100) - canary)  # as much as the canary, out of the stable's share
        return {self.stable: Decimal(100) - canary - baseline, self.spec.baseline: baseline, self.canary: canary}

    def due(self, now: float) -> bool:
        """Time for a verdict on the current interval (or, rolling back, for the next step down)."""
        return (self.phase in (Phase.PROGRESSING, Phase.ROLLING_BACK) and not self.awaiting_promote
                and not self.warming and now - self.step_started_at >= self.spec.interval_s)

    def document(self) -> dict[str, Any]:
        return {
            "model": self.model, "spec": self.spec.document(), "stable": self.stable, "canary": self.canary,
            "baseline": self.spec.baseline,
            "state": self.phase.value, "step": self.step, "steps": self.spec.document()["steps"],
            "weights": {v: _number(w) for v, w in self.weights().items()},
            "started_at": self.started_at, "step_started_at": self.step_started_at,
            "last_transition_at": self.last_transition_at, "reason": self.reason,
            "policy_revision": self.policy_revision, "consecutive_failures": self.consecutive_failures,
            "consecutive_errors": self.consecutive_errors, "awaiting_promote": self.awaiting_promote,
            "canary_requests": self.canary_requests, "verdicts": list(self.verdicts), "history": list(self.history),
            "evidence": self.evidence, "consecutive_inconclusive": self.consecutive_inconclusive,
            "applied": self.applied, "apply_reason": self.apply_reason, "pending_revision": self.pending_revision,
            "manual_revision": self.manual_revision, "rollback_step": self.rollback_step,
            "rollback_reason": self.rollback_reason, "fast_path_from": self.fast_path_from,
            "acknowledged": self.acknowledged, "variant": self.variant,
            "likeness": self.likeness, "files": self.files, "drift": list(self.drift), "warmup": self.warmup,
            # derived, for status readers: the percents of a gradual rollback under way
            "descent": [_number(p) for p in self.descent] if self.phase is Phase.ROLLING_BACK else None,
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Rollout:
        return cls(
            model=doc["model"], spec=lenient_model(RolloutSpec, doc["spec"], f"stored rollout of '{doc['model']}'"),
            stable=doc["stable"],
            phase=Phase(doc["state"]), step=doc["step"], started_at=doc["started_at"],
            step_started_at=doc["step_started_at"], last_transition_at=doc["last_transition_at"],
            reason=doc["reason"], policy_revision=doc.get("policy_revision", 0),
            consecutive_failures=doc["consecutive_failures"], consecutive_errors=doc["consecutive_errors"],
            awaiting_promote=doc["awaiting_promote"], canary_requests=doc["canary_requests"],
            verdicts=tuple(doc["verdicts"]), history=tuple(doc["history"]),
            evidence=doc.get("evidence", {}), consecutive_inconclusive=doc.get("consecutive_inconclusive", 0),
            applied=doc.get("applied", False), apply_reason=doc.get("apply_reason", "not written yet"),
            pending_revision=doc.get("pending_revision", 0), manual_revision=doc.get("manual_revision", 0),
            rollback_step=doc.get("rollback_step", 0), rollback_reason=doc.get("rollback_reason", ""),
            fast_path_from=doc.get("fast_path_from", 0.0), acknowledged=doc.get("acknowledged"),
            variant=doc.get("variant") or {},
            likeness=doc.get("likeness") or {}, files=doc.get("files") or {}, drift=tuple(doc.get("drift") or ()),
            warmup=doc.get("warmup") or {},
        )


def _number(value: Decimal) -> int | float:
    return int(value) if value == value.to_integral_value() else float(value)


def _move(rollout: Rollout, phase: Phase, now: float, reason: str, **changes: Any) -> Rollout:
    check(rollout.phase, phase)
    entry = {"at": now, "from": rollout.phase.value, "to": phase.value, "step": changes.get("step", rollout.step),
             "reason": reason}
    changes.setdefault("applied", False)  # new weights (maybe): applied again only once the policy shows them
    return dataclasses.replace(rollout, phase=phase, last_transition_at=now, reason=reason,
                               history=(*rollout.history, entry)[-100:], **changes)


def begin(model: str, spec: RolloutSpec, stable: str, now: float) -> Rollout:
    reason = f"started: step 1 of {len(spec.steps)}, canary {spec.canary} at {_number(spec.steps[0])}%"
    warmup: dict[str, Any] = {}
    if spec.warmup is not None:
        warmup = {"state": "warming", "since": now, "windows": [], "test": "no window yet"}
        reason = (f"started: warming up canary {spec.canary} on a mirrored {_number(spec.warmup.percent)}% of live "
                  f"traffic (answers dropped) until its latency is steady, at most {spec.warmup.max_s:g} s; then "
                  f"step 1 of {len(spec.steps)} at {_number(spec.steps[0])}%")
    if spec.baseline is not None:
        reason += f", judged against baseline {spec.baseline} at the same weight"
    return Rollout(model=model, spec=spec, stable=stable, phase=Phase.PROGRESSING, step=0, started_at=now,
                   step_started_at=now, last_transition_at=now, reason=reason, fast_path_from=now, warmup=warmup,
                   history=({"at": now, "from": None, "to": Phase.PROGRESSING.value, "step": 0, "reason": reason},))


def warmed(rollout: Rollout, now: float, windows: list[dict[str, Any]], steady: bool, words: str) -> Rollout:
    """The warm-up is over: its test passed (``steady``), or its time limit ran out without it.
    The first step starts now, or the rollout pauses (``on_timeout: pause``)."""
    assert rollout.spec.warmup is not None
    state = "steady" if steady else "timed_out"
    warmup = {**rollout.warmup, "state": state, "until": now, "windows": windows, "test": words}
    done = dataclasses.replace(rollout, warmup=warmup)
    first = f"step 1 of {len(rollout.spec.steps)}: canary at {_number(rollout.spec.steps[0])}%"
    if steady:
        return _move(done, Phase.PROGRESSING, now, f"{first} (warm after {now - rollout.warmup['since']:.0f} s: "
                     f"{words})", step_started_at=now, fast_path_from=now)
    limit = f"not steady after {rollout.spec.warmup.max_s:g} s of warm-up ({words})"
    if rollout.spec.warmup.on_timeout == "pause":
        return _move(done, Phase.PAUSED, now, f"paused: canary {limit}; resume to take step 1 anyway, or abort")
    return _move(done, Phase.PROGRESSING, now, f"{first} ({limit}: latency_warmup_s applies)", step_started_at=now,
                 fast_path_from=now)


def advance(rollout: Rollout, now: float, why: str) -> Rollout:
    """Next step, or promotion after the last one."""
    if rollout.step + 1 >= len(rollout.spec.steps):
        return _move(rollout, Phase.PROMOTED, now, f"promoted: canary {rollout.canary} takes 100% ({why})",
                     awaiting_promote=False, consecutive_failures=0)
    step = rollout.step + 1
    percent = _number(rollout.spec.steps[step])
    return _move(rollout, Phase.PROGRESSING, now, f"step {step + 1} of {len(rollout.spec.steps)}: canary at "
                 f"{percent}% ({why})", step=step, step_started_at=now, awaiting_promote=False, consecutive_failures=0)


def roll_back(rollout: Rollout, now: float, why: str) -> Rollout:
    """At once, whatever the rollback mode (a critical failure, a gate, or the end of a descent)."""
    return _move(rollout, Phase.ROLLED_BACK, now, f"rolled back to {rollout.stable}: {why}", awaiting_promote=False)


def was_rolled_back(doc: dict[str, Any]) -> bool:
    """A stored rollout whose canary was rejected: rolled back, or aborted on its way down (the
    abort only hurried the descent; the verdict stands, so a new rollout of it needs retry)."""
    return doc["state"] == Phase.ROLLED_BACK.value or (
        doc["state"] == Phase.ABORTED.value and any(h["to"] == Phase.ROLLING_BACK.value for h in doc["history"]))


def judged_roll_back(rollout: Rollout, now: float, why: str) -> Rollout:
    """The judge's rollback: down through the rollback steps below the canary's weight when
    ``rollback.mode`` is gradual and there is one above 0; at once otherwise."""
    rollback = rollout.spec.rollback
    if rollback.mode == "immediate":
        return roll_back(rollout, now, why)
    first = rollback.descent_from(rollout.canary_percent)
    if rollback.steps[first] == 0:
        return roll_back(rollout, now, f"{why} (no rollback step below the canary's "
                         f"{_number(rollout.canary_percent)}%)")
    return _descend_to(rollout, first, now, why)


def descend(rollout: Rollout, now: float, critical: str | None = None) -> Rollout:
    """One interval of a gradual rollback later: the next step down, or rolled back at its
    end; straight to 0 when ``critical`` says why."""
    if critical is not None:
        return roll_back(rollout, now, f"{critical} (during the gradual rollback, at "
                         f"{_number(rollout.canary_percent)}%)")
    following = rollout.rollback_step + 1
    if rollout.spec.rollback.steps[following] == 0:
        return roll_back(rollout, now, f"{rollout.rollback_reason} (gradual rollback through "
                         f"{_percents(rollout.descent)} done)")
    return _descend_to(rollout, following, now, rollout.rollback_reason)


def _descend_to(rollout: Rollout, index: int, now: float, why: str) -> Rollout:
    moved = dataclasses.replace(rollout, rollback_step=index, rollback_reason=why)
    descent, percent = moved.descent, rollout.spec.rollback.steps[index]
    where = descent.index(percent) + 1
    return _move(moved, Phase.ROLLING_BACK, now, f"rolling back gradually to {rollout.stable}: canary at "
                 f"{_number(percent)}% (step {where} of {len(descent)} down {_percents(descent)}, "
                 f"one per interval): {why}", step_started_at=now, awaiting_promote=False)


def _percents(percents: list[Decimal]) -> str:
    return " -> ".join(f"{_number(p)}%" for p in percents)


def on_verdict(rollout: Rollout, verdict: Verdict, now: float, evidence: dict[str, Any] | None = None) -> Rollout:
    """Apply one interval's verdict to a progressing rollout; ``evidence`` is the statistical
    judge's accumulated evidence, this interval included, kept with the rollout."""
    spec = rollout.spec
    judged = dataclasses.replace(
        rollout, verdicts=(*rollout.verdicts, {"at": now, "step": rollout.step, **verdict.document()})[-KEEP_VERDICTS:],
        canary_requests=rollout.canary_requests + verdict.canary_requests, step_started_at=now,
        evidence=rollout.evidence if evidence is None else evidence,
        # an unreadable interval decides nothing either: it must not restart the inconclusive count
        # (a flaky check alternating error and ok would otherwise reset both counts for ever)
        consecutive_inconclusive=rollout.consecutive_inconclusive + 1
        if verdict.outcome in (Outcome.INCONCLUSIVE, Outcome.ERROR) else 0)
    undecided = spec.judge == "statistical" and judged.consecutive_inconclusive >= spec.inconclusive_limit
    if verdict.outcome is Outcome.INCONCLUSIVE:  # no data: hold the step, count nothing
        if undecided:
            return _move(judged, Phase.PAUSED, now, f"paused: {judged.consecutive_inconclusive} inconclusive "
                         f"intervals in a row ({verdict.reason})", consecutive_errors=0, consecutive_inconclusive=0)
        return dataclasses.replace(judged, consecutive_errors=0)
    if verdict.outcome is Outcome.ERROR:
        errors = rollout.consecutive_errors + 1
        if errors >= spec.error_limit:
            return _move(judged, Phase.PAUSED, now, f"paused: metrics unreadable for {errors} intervals "
                         f"({verdict.reason})", consecutive_errors=errors, consecutive_inconclusive=0)
        if undecided:
            return _move(judged, Phase.PAUSED, now, f"paused: {judged.consecutive_inconclusive} inconclusive "
                         f"intervals in a row, some with metrics unreadable ({verdict.reason})",
                         consecutive_errors=0, consecutive_inconclusive=0)
        return dataclasses.replace(judged, consecutive_errors=errors)
    if verdict.outcome is Outcome.UNHEALTHY:
        failures = rollout.consecutive_failures + 1
        judged = dataclasses.replace(judged, consecutive_failures=failures, consecutive_errors=0)
        if verdict.metric == CRITICAL:  # no failure limit, no descent
            return roll_back(judged, now, verdict.reason)
        if failures >= spec.failure_limit:
            why = f"{verdict.reason} ({failures} unhealthy intervals in a row)"
            kind = verdict.failure_class or BACKEND
            if getattr(spec.failure_classes, kind) == "pause":
                what = "canary under-provisioned: queue" if kind == CAPACITY else "canary failing"
                return _move(judged, Phase.PAUSED, now, f"paused: {what} ({why}); "
                             + ("add instances to it and resume, or abort" if kind == CAPACITY else "resume or abort"),
                             consecutive_failures=0)
            return judged_roll_back(judged, now, why)
        return judged
    judged = dataclasses.replace(judged, consecutive_failures=0, consecutive_errors=0)
    if spec.manual_gates:
        return dataclasses.replace(judged, awaiting_promote=True, reason="healthy: waiting for a manual promote")
    return advance(judged, now, "healthy interval")


def hold(rollout: Rollout, verdict: Verdict, now: float, why: str, evidence: dict[str, Any] | None = None) -> Rollout:
    """A healthy verdict whose next step the canary may not take yet (``why``: a server of its
    fleet serves it otherwise, see rollout.engine): recorded like any verdict, and the rollout
    stays at its step, judged again after another interval."""
    return dataclasses.replace(
        rollout, verdicts=(*rollout.verdicts, {"at": now, "step": rollout.step, **verdict.document(),
                                               "held": why})[-KEEP_VERDICTS:],
        canary_requests=rollout.canary_requests + verdict.canary_requests, step_started_at=now,
        evidence=rollout.evidence if evidence is None else evidence, reason=why, consecutive_failures=0,
        consecutive_errors=0, consecutive_inconclusive=0)


def on_command(rollout: Rollout, command: str, now: float, actor: str) -> Rollout:
    """An SRE's promote / pause / resume / abort. Raises TransitionError when not allowed."""
    if rollout.phase is Phase.ROLLING_BACK and command in ("promote", "pause", "resume"):
        raise TransitionError(f"the rollout is rolling back gradually (canary at {_number(rollout.canary_percent)}%, "
                              f"going down {_percents(rollout.descent)}: {rollout.rollback_reason}); it cannot be "
                              f"{command}d: abort it to take the canary to 0% at once, or start a new rollout "
                              'with "retry": true once it has ended')
    if command == "promote":
        check(rollout.phase, Phase.PROGRESSING)
        return advance(rollout, now, f"promoted by {actor}")
    if command == "pause":
        return _move(rollout, Phase.PAUSED, now, f"paused by {actor}")
    if command == "resume":
        if rollout.phase is not Phase.PAUSED:
            raise TransitionError(f"the rollout is {rollout.phase.value}, not paused")
        return _move(rollout, Phase.PROGRESSING, now, f"resumed by {actor}", step_started_at=now,
                     consecutive_errors=0, consecutive_inconclusive=0, fast_path_from=now)
    if command == "abort":
        return _move(rollout, Phase.ABORTED, now, f"aborted by {actor}: back to {rollout.stable}",
                     awaiting_promote=False)
    raise ValueError(f"unknown rollout command {command!r}")

