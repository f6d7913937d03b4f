"""Recorder deltas: what a worker's recorder gained since its last report, and the sum of them.

The hot path is untouched: a worker's :class:`DeltaRecorder` is the plain
:class:`~gateway.telemetry.recorder.Recorder` (``record()`` is inherited, keyword arguments
and all), and :meth:`DeltaRecorder.take_delta` finds what changed by comparing the
cumulative counters with the copy it reported last (every 250 ms, off the request path).
A delta holds only integers (and latency sums): counts per label set, per (model, version,
second) and outcome, histogram buckets, plus the latency samples of the watched versions
with how many values each one was drawn from.

The control plane's :class:`MergedRecorder` adds deltas in, so ``/metrics`` and the rollout
judge read one recorder with the exact sum over workers. Reservoir samples merge into a
uniform sample of the union (:class:`MergedSample`): a hypergeometric draw of how many
values each side keeps, then a uniform choice inside each side.

Both classes reach into the recorder's own tables (they are the recorder, as subclasses):
``gateway/telemetry/recorder.py`` stays as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.telemetry.recorder import (
    LATENCY_BOUNDS,
    MAX_CLIENTS,
    OUTCOMES,
    OVERFLOW_CLIENT,
    Outcome,
    Recorder,
    ShadowStats,
)
from gateway.telemetry.reservoir import DEFAULT_SIZE

_BUCKETS = len(LATENCY_BOUNDS) + 1
_SHADOW_FIELDS = ("requests", "errors", "compared", "agreed", "dropped")
Sample = tuple[int, list[float]]  # (values it was drawn from, the values)


def _minus(now: list[int], before: list[int] | None) -> list[int] | None:
    """``now - before`` element-wise, None when nothing changed."""
    if before is None:
        return list(now) if any(now) else None
    if now == before:
        return None
    return [a - b for a, b in zip(now, before)]


@dataclass
class Delta:
    """One worker's report. Every count is an increment since its previous report, except
    ``inflight`` (the worker's current requests in flight: a gauge)."""

    totals: dict[tuple[str, str, str, str, str], tuple[int, float, list[int]]] = field(default_factory=dict)
    # per (model, version, second): requests, errors, client errors, overloads, then the histogram
    seconds: dict[tuple[str, str, int], list[int]] = field(default_factory=dict)
    outcomes: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    steered: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    upstream_errors: dict[tuple[str, str, str], int] = field(default_factory=dict)
    shadow: dict[tuple[str, str], tuple[list[int], float, list[int]]] = field(default_factory=dict)
    streams: dict[tuple[str, str, bool], tuple[int, float, list[int]]] = field(default_factory=dict)
    samples: dict[tuple[str, str], Sample] = field(default_factory=dict)
    stream_samples: dict[tuple[str, str, bool], Sample] = field(default_factory=dict)
    # per watched version, each client's (answered, upstream errors, 4xx): the judge caps each client's share
    clients: dict[tuple[str, str], dict[str, tuple[int, int, int]]] = field(default_factory=dict)
    inflight: dict[tuple[str, str], int] = field(default_factory=dict)
    # per (fleet, server): the worker's fleet counters (gateway.workers.fleet_counts)
    servers: dict[tuple[str, str], tuple[int, int, int, int, int]] = field(default_factory=dict)

    def requests(self) -> int:
        return sum(count for count, _, _ in self.totals.values())


class DeltaRecorder(Recorder):
    """A worker's recorder: the plain recorder, plus :meth:`take_delta` for the control plane."""

    def __init__(self, horizon_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(horizon_s, clock)
        self._sent_totals: dict[Any, tuple[int, float, list[int]]] = {}
        self._sent_seconds: dict[tuple[str, str, int], list[int]] = {}
        self._sent_outcomes: dict[Any, dict[Outcome, int]] = {}
        self._sent_steered: dict[Any, dict[Outcome, int]] = {}
        self._sent_errors: dict[Any, int] = {}
        self._sent_shadow: dict[Any, tuple[list[int], float, list[int]]] = {}
        self._sent_streams: dict[Any, tuple[int, float, list[int]]] = {}
        self._last_second = int(clock())

    def watch_only(self, watched: set[tuple[str, str]]) -> None:
        """Sample exactly these versions' latencies (the control plane's rollouts watch them)."""
        for key in self.watched():
            if key not in watched:
                self.unwatch_latencies(*key)
        for model, version in watched:
            self.watch_latencies(model, version)

    def take_delta(self) -> Delta:
        delta = Delta()
        self._take_totals(delta)
        self._take_seconds(delta)
        delta.outcomes = _outcome_increments(self._series_outcomes(), self._sent_outcomes)
        delta.steered = _outcome_increments(self.steered_outcome_totals(), self._sent_steered)
        for key, count in list(self.upstream_errors.items()):
            if count != self._sent_errors.get(key, 0):
                delta.upstream_errors[key] = count - self._sent_errors.get(key, 0)
                self._sent_errors[key] = count
        self._take_shadow(delta)
        self._take_streams(delta)
        for watched, reservoir in list(self._reservoirs.items()):
            if reservoir.seen:
                seen = reservoir.seen
                delta.samples[watched] = (seen, reservoir.take())
            clients = self.take_clients(*watched)
            if clients:
                delta.clients[watched] = clients
        for (model, version), stream in list(self._streams.items()):
            if stream.samples is not None:
                for first, part in zip((True, False), stream.samples):
                    if part.seen:
                        seen = part.seen
                        delta.stream_samples[(model, version, first)] = (seen, part.take())
        delta.inflight = {key: count for key, count in self.inflight.items() if count}
        return delta

    def _series_outcomes(self) -> dict[tuple[str, str], dict[Outcome, int]]:
        return {key: series.outcomes for key, series in list(self._series.items())}

    def _take_totals(self, delta: Delta) -> None:
        for label, totals in list(self.totals.items()):
            sent = self._sent_totals.get(label)
            if sent is not None and sent[0] == totals.count:
                continue
            count, total, hist = sent if sent is not None else (0, 0.0, [0] * _BUCKETS)
            delta.totals[label] = (totals.count - count, totals.sum - total,
                                   [a - b for a, b in zip(totals.hist, hist)])
            self._sent_totals[label] = (totals.count, totals.sum, list(totals.hist))

    def _take_seconds(self, delta: Delta) -> None:
        """The per-second slots written since the last report (the judge's windows)."""
        now = int(self._clock())
        first = min(self._last_second, now)
        self._last_second = now
        for (model, version), series in list(self._series.items()):
            for second in range(first, now + 1):
                slot = second % self._slots
                if series.stamp[slot] != second:
                    continue
                current = [series.requests[slot], series.errors[slot], series.client_errors[slot],
                           series.overloads[slot], *series.hist[slot]]
                key = (model, version, second)
                change = _minus(current, self._sent_seconds.get(key))
                if change is not None:
                    delta.seconds[key] = change
                    self._sent_seconds[key] = current
        for key in [key for key in self._sent_seconds if key[2] < now - 2]:
            del self._sent_seconds[key]

    def _take_shadow(self, delta: Delta) -> None:
        for key, stats in list(self.shadow.items()):
            counts = [getattr(stats, name) for name in _SHADOW_FIELDS]
            sent = self._sent_shadow.get(key)
            if sent is not None and sent[0] == counts and sent[1] == stats.latency_sum:
                continue
            before = sent or ([0] * len(counts), 0.0, [0] * _BUCKETS)
            delta.shadow[key] = ([a - b for a, b in zip(counts, before[0])], stats.latency_sum - before[1],
                                 [a - b for a, b in zip(stats.histogram, before[2])])
            self._sent_shadow[key] = (counts, stats.latency_sum, list(stats.histogram))

    def _take_streams(self, delta: Delta) -> None:
        for (model, version), stream in list(self.streams.items()):
            for first, totals in ((True, stream.first), (False, stream.gap)):
                key = (model, version, first)
                sent = self._sent_streams.get(key)
                if sent is not None and sent[0] == totals.count:
                    continue
                count, total, hist = sent or (0, 0.0, [0] * _BUCKETS)
                delta.streams[key] = (totals.count - count, totals.sum - total,
                                      [a - b for a, b in zip(totals.hist, hist)])
                self._sent_streams[key] = (totals.count, totals.sum, list(totals.hist))


def _outcome_increments(now: dict[Any, dict[Outcome, int]], sent: dict[Any, dict[Outcome, int]]
                        ) -> dict[Any, dict[str, int]]:
    out: dict[Any, dict[str, int]] = {}
    for key, counts in now.items():
        before = sent.get(key)
        changed = {outcome.value: count - (before.get(outcome, 0) if before else 0)
                   for outcome, count in counts.items() if count != (before.get(outcome, 0) if before else 0)}
        if changed:
            out[key] = changed
            sent[key] = dict(counts)
    return out


class MergedSample:
    """A uniform sample of at most ``size`` values of everything merged since the last take.

    Same ``take()`` and ``seen`` as :class:`~gateway.telemetry.reservoir.Reservoir` (the
    recorder's readers do not see the difference); ``merge`` instead of ``add``."""

    __slots__ = ("size", "seen", "_values", "_rng")

    def __init__(self, size: int = DEFAULT_SIZE, rng: np.random.Generator | None = None) -> None:
        self.size = size
        self.seen = 0
        self._values: list[float] = []
        self._rng = rng or np.random.default_rng()

    def merge(self, seen: int, values: list[float]) -> None:
        """Add a uniform sample ``values`` (``min(seen, size)`` of them) of ``seen`` values."""
        if not seen:
            return
        total = self.seen + seen
        keep = min(total, self.size)
        if total <= self.size:
            self._values.extend(values)
        else:
            mine = int(self._rng.hypergeometric(self.seen, seen, keep)) if self.seen else 0
            ours = self._pick(self._values, mine)
            theirs = self._pick(values, keep - mine)
            self._values = ours + theirs
        self.seen = total

    def _pick(self, values: list[float], count: int) -> list[float]:
        if count >= len(values):
            return list(values[:count])
        chosen = self._rng.choice(len(values), size=count, replace=False)
        return [values[int(index)] for index in chosen]

    def add(self, value: float) -> None:
        self.merge(1, [value])

    def take(self) -> list[float]:
        sample, self._values, self.seen = self._values, [], 0
        return sample


class MergedRecorder(Recorder):
    """The control plane's recorder: every worker's deltas added in. Readers (``/metrics``, the
    judge, the drain) use it as any recorder; nothing records into it directly."""

    def __init__(self, horizon_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(horizon_s, clock)
        self._worker_inflight: dict[int, dict[tuple[str, str], int]] = {}
        self.watch_changed: Callable[[], None] = lambda: None  # the supervisor tells the workers

    def watch_latencies(self, model: str, version: str) -> None:
        if (model, version) in self._reservoirs:
            return
        super().watch_latencies(model, version)
        if (model, version) in self._reservoirs:
            self._reservoirs[(model, version)] = MergedSample()  # type: ignore[assignment]
            self._streams[(model, version)].samples = (MergedSample(), MergedSample())  # type: ignore[assignment]
        self.watch_changed()

    def unwatch_latencies(self, model: str, version: str) -> None:
        super().unwatch_latencies(model, version)
        self.watch_changed()

    def forget_worker(self, worker: int) -> None:
        """A worker (by process id) is gone: its requests in flight are no longer in flight."""
        self._worker_inflight.pop(worker, None)
        self._sum_inflight()

    def merge(self, worker: int, delta: Delta) -> None:
        for label, (count, total, hist) in delta.totals.items():
            totals = self._totals.get(label) or self._new_totals(label)
            totals.count += count
            totals.sum += total
            _add(totals.hist, hist)
        self._merge_seconds(delta)
        for key, counts in delta.outcomes.items():
            series = self._series.get(key) or self._new_series(key)
            for outcome, count in counts.items():
                series.outcomes[Outcome(outcome)] = series.outcomes.get(Outcome(outcome), 0) + count
        for key, counts in delta.steered.items():
            steered = self._steered.get(key)
            if steered is None:
                steered = self._steered[key] = dict.fromkeys(OUTCOMES, 0)
            for outcome, count in counts.items():
                steered[Outcome(outcome)] = steered.get(Outcome(outcome), 0) + count
        for kind, errors in delta.upstream_errors.items():
            self._upstream_errors[kind] = self._upstream_errors.get(kind, 0) + errors
        for version_key, (shadow_counts, latency, hist) in delta.shadow.items():
            stats: ShadowStats = self.shadow_stats(*version_key)
            for name, bump in zip(_SHADOW_FIELDS, shadow_counts):
                setattr(stats, name, getattr(stats, name) + bump)
            stats.latency_sum += latency
            _add(stats.histogram, hist)
        for (model, version, first), (count, total, hist) in delta.streams.items():
            stream = self._streams.get((model, version)) or self._new_stream((model, version))
            timings = stream.first if first else stream.gap
            timings.count += count
            timings.sum += total
            _add(timings.hist, hist)
        for watched, (seen, values) in delta.samples.items():
            sample = self._reservoirs.get(watched)
            if isinstance(sample, MergedSample):
                sample.merge(seen, values)
        for watched, clients in delta.clients.items():
            self._merge_clients(watched, clients)
        for (model, version, first), (seen, values) in delta.stream_samples.items():
            streamed = self._streams.get((model, version))
            if streamed is not None and streamed.samples is not None:
                part = streamed.samples[0 if first else 1]
                if isinstance(part, MergedSample):
                    part.merge(seen, values)
        self._worker_inflight[worker] = delta.inflight
        self._sum_inflight()

    def _merge_clients(self, watched: tuple[str, str], clients: dict[str, tuple[int, int, int]]) -> None:
        table = self._clients.get(watched)
        if table is None:
            return  # no longer watched here: the judge will not read it
        for client, (answered, errors, client_errors) in clients.items():
            counts = table.get(client)
            if counts is None:
                if len(table) >= MAX_CLIENTS:
                    client = OVERFLOW_CLIENT
                counts = table.get(client)
                if counts is None:
                    counts = table[client] = [0, 0, 0]
            counts[0] += answered
            counts[1] += errors
            counts[2] += client_errors

    def _merge_seconds(self, delta: Delta) -> None:
        for (model, version, second), change in delta.seconds.items():
            series = self._series.get((model, version)) or self._new_series((model, version))
            slot = second % self._slots
            if series.stamp[slot] != second:
                if series.stamp[slot] > second:
                    continue  # older than what the slot holds now: outside the window anyway
                series.stamp[slot] = second
                series.requests[slot] = series.errors[slot] = series.client_errors[slot] = 0
                series.overloads[slot] = 0
                series.hist[slot] = [0] * _BUCKETS
            series.requests[slot] += change[0]
            series.errors[slot] += change[1]
            series.client_errors[slot] += change[2]
            series.overloads[slot] += change[3]
            _add(series.hist[slot], change[4:])

    def _sum_inflight(self) -> None:
        summed: dict[tuple[str, str], int] = {}
        for counts in self._worker_inflight.values():
            for key, count in counts.items():
                summed[key] = summed.get(key, 0) + count
        for key in self._inflight:
            self._inflight[key] = summed.pop(key, 0)
        self._inflight.update(summed)


def _add(into: list[int], change: list[int]) -> None:
    for index, count in enumerate(change):
        if count:
            into[index] += count

