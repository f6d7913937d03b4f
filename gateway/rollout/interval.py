"""One interval of a progressing rollout: its verdict, saying where Triton puts the difference
(:mod:`gateway.rollout.engine`); whether the canary may take the step the verdict allows (the
same version on every server); and the ticks of a warm-up (:mod:`gateway.rollout.warmup`). The
controller (:mod:`gateway.rollout.controller`) calls these from its reconcile tick and persists
what they return; nothing here writes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gateway.rollout import steps
from gateway.rollout.analysis import Verdict, judge
from gateway.rollout.checks import Checks
from gateway.rollout.engine import TritonView, error_classes, histogram_without_hits, observe, with_attribution
from gateway.rollout.judge import Evidence, VersionSample, assess, client_weighted, fold
from gateway.rollout.phases import Phase
from gateway.rollout.readings import take_samples, windows
from gateway.rollout.rollback import critical_verdict
from gateway.rollout.steps import Rollout
from gateway.rollout.warmup import KEEP_WINDOWS, WarmupWindows, steadiness
from gateway.telemetry.recorder import LATENCY_BOUNDS, Recorder
from gateway.telemetry.sources import MetricsSource

if TYPE_CHECKING:
    from gateway.rollout.controller import RolloutController

BUCKETS = len(LATENCY_BOUNDS) + 1


class Intervals:
    """The interval's reads and pure decisions, over the controller's telemetry and Triton's view
    (read off the controller each time, as :class:`rollout.commands.RolloutCommands` does)."""

    def __init__(self, controller: RolloutController) -> None:
        self.controller = controller
        self.warmups = WarmupWindows()  # the open warm-up window per model (rollout.warmup)

    @property
    def source(self) -> MetricsSource:
        return self.controller.source

    @property
    def recorder(self) -> Recorder:
        return self.controller.recorder

    @property
    def checks(self) -> Checks:
        return self.controller.checks

    @property
    def engine(self) -> TritonView:
        return self.controller.engine

    @property
    def call_timeout_s(self) -> float:
        return self.controller.call_timeout_s

    def warm(self, rollout: Rollout, now: float) -> Rollout:
        """One tick of a warm-up (rollout.warmup): a window of the canary's mirrored answers closed
        when one ended, and the warm-up over when its test passes or its time limit runs out."""
        spec = rollout.spec.warmup
        assert spec is not None
        if not rollout.applied:
            return rollout  # the mirror is not in the policy yet: nothing to count
        stats = self.recorder.shadow.get((rollout.model, rollout.canary))
        window = self.warmups.close(rollout.model, now, spec.window_s, stats.requests if stats else 0,
                                    stats.errors if stats else 0, stats.histogram if stats else [0] * BUCKETS)
        windows = list(rollout.warmup.get("windows", ()))
        if window is not None:
            windows = [*windows, window][-KEEP_WINDOWS:]
        steady, words = steadiness(spec, windows)
        if steady or now - rollout.warmup["since"] >= spec.max_s:
            self.warmups.forget(rollout.model)
            return steps.warmed(rollout, now, windows, steady, words)
        if window is None:
            return rollout
        return dataclasses.replace(rollout, warmup={**rollout.warmup, "windows": windows, "test": words})

    async def held(self, rollout: Rollout, judged: Rollout, verdict: Verdict, now: float,
                    evidence: dict[str, Any] | None) -> Rollout:
        """The judged rollout, unless it would give the canary more weight while a server of its
        fleet serves it otherwise (rollout.engine.TritonView.held): then held at its step."""
        why, drift = await self.engine.held(rollout)
        judged = dataclasses.replace(judged, drift=tuple(drift))
        advancing = judged.step > rollout.step or judged.phase is Phase.PROMOTED or \
            (judged.awaiting_promote and not rollout.awaiting_promote)
        if why is None or not advancing:
            return judged
        return dataclasses.replace(steps.hold(rollout, verdict, now, why, evidence), drift=tuple(drift))

    async def judge(self, rollout: Rollout, now: float) -> tuple[Verdict, dict[str, Any] | None]:
        """The spec's judge on this interval, the canary against its reference (the baseline, or the
        stable), saying where Triton puts the difference; the statistical one also returns its evidence."""
        # metrics_source recorder: every replica's published windows, summed (controller.judged)
        source = self.controller.judged_source()
        canary, reference = await windows(source, rollout, self.call_timeout_s * 2)
        # taken even when the windows are unreadable, so the next interval's sample is its own
        canary_samples, reference_samples = take_samples(self.controller.judged, source, rollout)
        seen = await observe(self.engine, rollout, now, canary_samples[0], reference_samples[0],
                             error_classes(canary, canary_samples[2]), error_classes(reference, reference_samples[2]))
        # whatever the judge: no waiting on it; each client counted up to the interval's median client's share
        critical = critical_verdict(rollout.spec, canary and client_weighted(canary, canary_samples[2]),
                                    reference and client_weighted(reference, reference_samples[2]))
        if critical is not None:
            return with_attribution(critical, seen.attribution), None
        extra = await self.checks.evaluate(rollout.model, rollout.spec, rollout.stable)
        if rollout.spec.judge == "thresholds":
            trimmed = [None if window is None else histogram_without_hits(window, share)
                       for window, share in ((canary, seen.canary_hits), (reference, seen.reference_hits))]
            return with_attribution(fold(judge(rollout.spec, *trimmed), extra), seen.attribution), None
        if canary is None or reference is None:
            return fold(judge(rollout.spec, None, None), extra), None  # the ERROR verdict, unless a check fails
        spec = rollout.spec
        if rollout.warmup.get("state") == "steady":  # shown warm: its latency is judged from the first interval
            spec = spec.model_copy(update={"latency_warmup_s": 0.0})
        verdict, evidence = assess(spec, Evidence.from_document(rollout.evidence),
                                   VersionSample.of(canary, seen.canary_latencies, *canary_samples[1:]),
                                   VersionSample.of(reference, seen.reference_latencies, *reference_samples[1:]),
                                   extra, cause=seen.attribution.cause)
        return with_attribution(verdict, seen.attribution), evidence.document()
