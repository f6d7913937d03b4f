"""What the rollout controller reads of Triton's own view of a rollout's versions, per interval:
their statistics (for the attribution of each verdict), their configurations (like for like at
the start; the same on every server before each step) and, where the gateway reads the model
repository, the canary's files. Reads only, a few calls per rollout per interval: one
statistics call and one config call per server of the versions' fleets, never the repository
index, so the cost follows the rollouts, not the size of the repository.

An interval's statistics are the difference between the reading taken at its first tick (the
"mark", kept in memory by the lease holder) and the one taken at its verdict, which is the next
interval's mark. A holder that took the lease mid-interval marks at its first tick: that
interval's attribution covers what it saw.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.policy import parse_target
from gateway.rollout import attribution
from gateway.rollout.analysis import BACKEND, CAPACITY, Outcome, Verdict
from gateway.rollout.attribution import Attribution, ErrorClasses
from gateway.rollout.config_diff import ConfigDifference, Drift, differences, drift
from gateway.rollout.judge import capacity_metric
from gateway.rollout.steps import Rollout
from gateway.services.engine_stats import EngineReading, EngineStats, StatsCalls, TargetInterval, interval
from gateway.services.model_repository import RepositoryUnreadable, read_model_async
from gateway.services.version_configs import changed_files, read_configs, version_digest_async
from gateway.telemetry.recorder import Window

log = logging.getLogger("gateway.rollout")


@dataclass(frozen=True)
class Likeness:
    """The stable's and the canary's configurations compared (``config_diff.differences``)."""

    differences: tuple[ConfigDifference, ...]
    unreadable: tuple[str, ...]  # why a side could not be compared

    def words(self, versus: str = "stable") -> str:
        if self.unreadable:
            return f"configs not compared ({'; '.join(self.unreadable)})"
        if not self.differences:
            return "configs alike"
        return "configs differ: " + "; ".join(d.words(versus) for d in self.differences)

    def document(self, versus: str = "stable") -> dict[str, Any]:
        return {"differences": [d.document() for d in self.differences], "unreadable": list(self.unreadable),
                "words": self.words(versus)}


class TritonView:
    """Triton's view of the rollouts' versions, for the controller (module docstring)."""

    def __init__(self, control: StatsCalls, timeout_s: float, repository: Path | None = None) -> None:
        self.control = control
        self.stats = EngineStats(control, timeout_s)
        self.timeout_s = timeout_s
        self.repository = repository  # the default fleet's model repository, as this gateway reads it
        self._marks: dict[str, tuple[float, EngineReading]] = {}  # model -> (interval start, reading)

    # -- statistics -------------------------------------------------------------------------
    async def mark(self, rollout: Rollout) -> None:
        """The current interval's first reading, once per interval."""
        mark = self._marks.get(rollout.model)
        if mark is None or mark[0] != rollout.step_started_at:
            self._marks[rollout.model] = (rollout.step_started_at, await self._read(rollout))

    def forget(self, model: str) -> None:
        self._marks.pop(model, None)

    async def interval(self, rollout: Rollout, now: float) -> tuple[TargetInterval, TargetInterval]:
        """The canary's and its reference's statistics over the interval ending now; the reading
        taken now marks the next interval (which starts now)."""
        reading = await self._read(rollout)
        mark = self._marks.get(rollout.model)
        before = mark[1] if mark is not None and mark[0] == rollout.step_started_at else None
        self._marks[rollout.model] = (now, reading)
        return (interval(before, reading, rollout.model, rollout.canary),
                interval(before, reading, rollout.model, rollout.reference))

    async def _read(self, rollout: Rollout) -> EngineReading:
        return await self.stats.read(rollout.model, (rollout.canary, rollout.reference))

    # -- configurations -----------------------------------------------------------------------
    async def likeness(self, model: str, stable: str, canary: str) -> Likeness:
        """The performance fields in which the canary's configuration differs from the stable's
        (each read from the first server of its fleet that answers)."""
        configs, unreadable = [], []
        for target in (stable, canary):
            found = await read_configs(self.control, model, target, self.timeout_s)
            if found.configs:
                configs.append(next(iter(found.configs.values())))
            else:
                why = "; ".join(f"{server}: {reason}" for server, reason in found.unreadable.items()) or "no server"
                unreadable.append(f"{target}: {why}")
        if unreadable:
            return Likeness((), tuple(unreadable))
        return Likeness(tuple(differences(configs[0], configs[1])), ())

    async def drift(self, model: str, target: str) -> tuple[list[Drift], dict[str, str]]:
        """The servers of ``target``'s fleet whose configuration of ``model`` differs from their
        peers', and the servers that could not be read."""
        found = await read_configs(self.control, model, target, self.timeout_s)
        reference = None
        named = parse_target(target)
        if self.repository is not None and named.fleet is None:
            try:
                reference = (await read_model_async(self.repository, named.model or model)).config
            except RepositoryUnreadable:
                reference = None
        return drift(found.configs, reference), dict(found.unreadable)

    async def files(self, model: str, target: str) -> dict[str, str] | None:
        """The digest of the version's files, for a version on the default fleet when the gateway
        reads its repository; None otherwise (or when they cannot be read)."""
        named = parse_target(target)
        if self.repository is None or named.fleet is not None or named.version is None:
            return None  # another fleet's repository is not the gateway's to read; a default version has no folder
        try:
            return await version_digest_async(self.repository, named.model or model, named.version)
        except OSError as exc:
            log.warning("rollout of %s: the files of %s cannot be hashed: %s", model, target, exc)
            return None

    async def held(self, rollout: Rollout) -> tuple[str | None, list[dict[str, Any]]]:
        """Why the canary may not take more weight now (a server of its fleet serves it with
        another configuration, or its files changed since the rollout started), and the drift
        found (for the record and ``/admin/models``)."""
        found, _ = await self.drift(rollout.model, rollout.canary)
        drifted = [d.document(rollout.model) for d in found]
        if found:
            return ("held: " + "; ".join(d.words(rollout.model) for d in found)
                    + f" (version {rollout.canary} must be the same on every server before it takes more weight)",
                    drifted)
        started = rollout.files
        if started:
            now = await self.files(rollout.model, rollout.canary)
            if now is not None and now != started:
                changed = changed_files(started, now)
                return (f"held: the files of version {rollout.canary} changed since the rollout started "
                        f"({', '.join(changed[:5])}): servers that load it again would serve another version 3 "
                        f"than those that do not; put them back or start a new rollout", drifted)
        return None, drifted

    # -- attribution --------------------------------------------------------------------------
    def attribute(self, rollout: Rollout, canary: TargetInterval, reference: TargetInterval,
                  canary_latencies: Sequence[float], reference_latencies: Sequence[float],
                  canary_errors: ErrorClasses | None, reference_errors: ErrorClasses | None) -> Attribution:
        """The interval's attribution (``rollout.attribution``), the latencies already without cache hits."""
        versus = "stable" if rollout.spec.baseline is None else "baseline"
        errors = None
        if canary_errors is not None and reference_errors is not None:
            errors = attribution.error_words(canary_errors, versus, reference_errors)
        found = attribution.attribute(canary, reference, canary_latencies, reference_latencies,
                                      rollout.spec.max_latency_increase, versus, errors)
        words = rollout.likeness.get("words") if rollout.likeness else None
        if words and words != "configs alike":
            found = dataclasses.replace(found, summary=f"{found.summary}; {words}")
        return found


def hit_share(found: TargetInterval) -> float:
    """The share of a version's requests Triton answered from its cache this interval (0 unread)."""
    return attribution.view(found.counters).hit_share if found.counters is not None else 0.0


def histogram_without_hits(window: Window, share: float) -> Window:
    """A window whose latency histogram has its fastest ``share`` taken out (the cache hits: what
    the thresholds judge's quantiles are then of)."""
    if share <= 0 or not window.histogram:
        return window
    drop = round(share * sum(window.histogram))
    kept = []
    for count in window.histogram:
        taken = min(count, drop)
        drop -= taken
        kept.append(count - taken)
    return dataclasses.replace(window, histogram=tuple(kept))


@dataclass(frozen=True)
class Observed:
    """One interval in Triton's view: its attribution, and the latencies the judge compares
    (each version's cache hits taken out, Triton's share of them)."""

    attribution: Attribution
    canary_latencies: list[float]
    reference_latencies: list[float]
    canary_hits: float
    reference_hits: float


def error_classes(window: Window | None, clients: Mapping[str, Sequence[int]] | None) -> ErrorClasses | None:
    """A version's failed answers this interval by class: from its per-client counts since the
    last interval (exact) when the source keeps them, else from its metrics window."""
    if clients is not None:
        return ErrorClasses(sum(c[3] for c in clients.values() if len(c) > 3), sum(c[1] for c in clients.values()))
    return None if window is None else ErrorClasses(window.rejected, window.errors)


async def observe(view: TritonView, rollout: Rollout, now: float, canary_latencies: Sequence[float],
                  reference_latencies: Sequence[float], canary: ErrorClasses | None,
                  reference: ErrorClasses | None) -> Observed:
    """Read the interval's statistics (never raises: an unreadable Triton is said in the
    attribution) and attribute it (``canary``, ``reference``: their failed answers by class)."""
    mine, theirs = await view.interval(rollout, now)
    canary_hits, reference_hits = hit_share(mine), hit_share(theirs)
    kept_canary = attribution.without_cache_hits(canary_latencies, canary_hits)
    kept_reference = attribution.without_cache_hits(reference_latencies, reference_hits)
    seen = view.attribute(rollout, mine, theirs, kept_canary, kept_reference, canary, reference)
    return Observed(seen, kept_canary, kept_reference, canary_hits, reference_hits)


ERROR_METRICS = frozenset(("error_rate", "capacity_error_rate", "error_ceiling", "critical_error_rate"))


def with_attribution(verdict: Verdict, seen: Attribution) -> Verdict:
    """The verdict saying where the difference lies: the attribution in its record and its
    reason, and an UNHEALTHY verdict's failure class where the judge left it to the cause. The
    canary's errors in Triton's words join the reason only when an error metric failed."""
    failure = verdict.failure_class
    if verdict.outcome is Outcome.UNHEALTHY and failure is None and verdict.metric is not None:
        failure = CAPACITY if capacity_metric(verdict.metric, seen.cause) else BACKEND
    failed = {verdict.metric} | {m.name for m in verdict.metrics if getattr(m, "verdict", None) == "fail"}
    words = [seen.summary] if seen.summary else []
    if seen.errors and verdict.outcome is Outcome.UNHEALTHY and failed & ERROR_METRICS:
        words.append(seen.errors)
    return dataclasses.replace(verdict, attribution=seen.document(), failure_class=failure,
                               reason="; ".join([verdict.reason, *words]))
