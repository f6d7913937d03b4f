"""Recorder deltas: what a worker's recorder gained since its last report, and the sum of them.

A worker's :class:`DeltaRecorder` records as the plain
:class:`~gateway.telemetry.recorder.Recorder` does (same ``record()``, keyword arguments and
all). A report costs what changed, not what the worker has ever seen: a worker's tables
(totals per label set, per-second series, requests whose client chose the version, upstream
errors) hold only what came since its last report, and each report hands them over whole and
starts afresh, so nothing is diffed. The totals and series are counted in the arrays a report
carries (:mod:`gateway.workers.counting`), so a sample costs the same whether the traffic is on
one model or spread over thousands; they travel as numbered columns (:mod:`gateway.workers.columns`:
a label set is named once, histograms and outcomes as their non-zero cells). Measured before
(bench/scale.py, --workers 2, traffic over 1,000 models): 143-188 ms CPU/s on the supervisor when
every report diffed every label set and merged 31 buckets each; 44-60 ms CPU/s when a report named
every label set it carried and was merged one at a time.

The control plane's :class:`MergedRecorder` adds deltas in (its totals and series are arrays, a
report a few indexed adds), so ``/metrics`` and the rollout judge read one recorder with the
exact sum over workers. Reservoir samples merge into a
uniform sample of the union (:class:`MergedSample`): a hypergeometric draw of how many
values each side keeps, then a uniform choice inside each side.

Both classes reach into the recorder's own tables (they are the recorder, as subclasses).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import ne
from types import MappingProxyType
from typing import Any

import numpy as np

from gateway.telemetry.recorder import (
    LATENCY_BOUNDS,
    MAX_CLIENTS,
    OUTCOMES,
    OVERFLOW_CLIENT,
    STEERED_ROUTES,
    UNKNOWN_MODEL,
    Outcome,
    Recorder,
    ShadowStats,
    Window,
    _bounded,
    _zero_outcomes,
)
from gateway.telemetry.reservoir import DEFAULT_SIZE
from gateway.workers.columns import (
    SECOND_ROW,
    Cells,
    Columns,
    SeriesTable,
    TotalsTable,
    as_array,
    cells_of,
    named_columns,
)
from gateway.workers.counting import Counting

_BUCKETS = len(LATENCY_BOUNDS) + 1
_SHADOW_FIELDS = ("requests", "errors", "compared", "agreed", "dropped")
Sample = tuple[int, list[float]]  # (values it was drawn from, the values)


Sparse = tuple[tuple[int, int], ...]  # (bucket, count) of a histogram's non-zero buckets
Counts = tuple[int, ...]  # one count per Outcome, in OUTCOMES order
# (second, requests, upstream errors, client errors, overloads, rejected, the judged requests' histogram)
Second = tuple[int, int, int, int, int, int, Sparse]
FUTURE_S = 2  # a second this far past the merger's now is not added (no clock here runs ahead)
_POSITIONS = range(_BUCKETS)
_NONE = np.zeros(0, np.int64)


def sparse(hist: Sequence[int], before: Sequence[int] | None = None) -> Sparse:
    """``hist`` (minus ``before``) as its non-zero (bucket, count) pairs; the buckets are found
    in C (``compress``), so an entry costs its non-zero buckets, not all 31."""
    if before is None:
        return tuple((index, hist[index]) for index in compress(_POSITIONS, hist))
    return tuple((index, hist[index] - before[index]) for index in compress(_POSITIONS, map(ne, hist, before)))


@dataclass
class Delta:
    """One worker's report. Every count is an increment since its previous report, except
    ``inflight`` (the worker's current requests in flight: a gauge)."""

    totals: dict[tuple[str, str, str, str, str], tuple[int, float, Sparse]] = field(default_factory=dict)
    # per (model, version): its outcomes and its seconds (the judge's windows)
    series: list[tuple[str, str, Counts, tuple[Second, ...]]] = field(default_factory=list)
    steered: dict[tuple[str, str], Counts] = field(default_factory=dict)
    upstream_errors: dict[tuple[str, str, str], int] = field(default_factory=dict)
    shadow: dict[tuple[str, str], tuple[list[int], float, Sparse]] = field(default_factory=dict)
    streams: dict[tuple[str, str, bool], tuple[int, float, Sparse]] = field(default_factory=dict)
    samples: dict[tuple[str, str], Sample] = field(default_factory=dict)
    stream_samples: dict[tuple[str, str, bool], Sample] = field(default_factory=dict)
    # per watched version, each client's (answered, upstream errors, 4xx, rejected): the judge caps each client's share
    clients: dict[tuple[str, str], dict[str, tuple[int, int, int, int]]] = field(default_factory=dict)
    inflight: dict[tuple[str, str], int] = field(default_factory=dict)
    # per (fleet, server): the worker's fleet counters (gateway.workers.fleet_counts)
    servers: dict[tuple[str, str], tuple[int, int, int, int, int]] = field(default_factory=dict)
    # a worker's totals and series, as numbered columns (gateway.workers.columns): ``totals`` and
    # ``series`` above are the same tables keyed by name, as other producers (replica windows) send them
    columns: Columns | None = None

    def requests(self) -> int:
        return sum(count for count, _, _ in self.totals.values()) + (self.columns.requests() if self.columns else 0)


class DeltaRecorder(Recorder):
    """A worker's recorder: the recorder's methods, its totals and judged series counted in the
    arrays a report carries (:class:`~gateway.workers.counting.Counting`), and :meth:`take_delta`."""

    def __init__(self, horizon_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(horizon_s, clock)
        self._counting = Counting()
        self.totals = self._counting.totals()  # type: ignore[assignment]  # read as count, sum, hist: as _Totals
        self._sent_shadow: dict[Any, tuple[list[int], float, list[int]]] = {}
        self._sent_streams: dict[Any, tuple[int, float, list[int]]] = {}

    def record(self, model: str, version: str, outcome: Outcome, latency_s: float,
               route: str = "", protocol: str = "http", code: str = "200", client: str = "") -> None:
        """As :meth:`Recorder.record`: a label set's totals, the version's judged series (not when
        the client chose the version: those are only counted), the watched versions' samples."""
        bucket = bisect_left(LATENCY_BOUNDS, latency_s) \
            if outcome is Outcome.SUCCESS or outcome is Outcome.UPSTREAM_ERROR else -1
        key = (model, version)
        if route in STEERED_ROUTES:
            self._counting.record((model, version, route, protocol, code), None, outcome, bucket, latency_s, 0)
            counts = self._steered.get(key) or _bounded(self._steered, key, _zero_outcomes, (UNKNOWN_MODEL, ""))
            counts[outcome] += 1
            return
        self._counting.record((model, version, route, protocol, code), key, outcome, bucket, latency_s,
                              int(self._clock()))
        if self._reservoirs:
            self._watched(key, outcome, latency_s, client)

    def series(self) -> list[tuple[str, str]]:
        """The series counted since the last report."""
        return self._counting.series_counted()

    def watch_only(self, watched: set[tuple[str, str]]) -> None:
        """Sample exactly these versions' latencies (the control plane's rollouts watch them)."""
        for key in self.watched():
            if key not in watched:
                self.unwatch_latencies(*key)
        for model, version in watched:
            self.watch_latencies(model, version)

    def remove_inflight(self, key: tuple[str, str]) -> None:
        """As the recorder does, and a version with nothing in flight leaves the table: a report
        carries the requests in flight now, not every version that ever had one."""
        inflight = self._inflight
        count = inflight[key] - 1
        if count:
            inflight[key] = count
        else:
            del inflight[key]

    def take_delta(self) -> Delta:
        delta = Delta()
        self._take_tables(delta)
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
        delta.inflight = dict(self._inflight)
        return delta

    def _take_tables(self, delta: Delta) -> None:
        """Every table that holds only what came since the last report, handed over whole."""
        steered, self._steered = self._steered, {}
        errors, self._upstream_errors = self._upstream_errors, {}
        self.upstream_errors = MappingProxyType(self._upstream_errors)
        delta.columns = self._counting.take()
        delta.steered = {key: tuple(counts.values()) for key, counts in steered.items()}
        delta.upstream_errors = errors

    def _take_shadow(self, delta: Delta) -> None:
        for key, stats in list(self.shadow.items()):
            counts = [getattr(stats, name) for name in _SHADOW_FIELDS]
            sent = self._sent_shadow.get(key)
            if sent is not None and sent[0] == counts and sent[1] == stats.latency_sum:
                continue
            before = sent or ([0] * len(counts), 0.0, [0] * _BUCKETS)
            delta.shadow[key] = ([a - b for a, b in zip(counts, before[0])], stats.latency_sum - before[1],
                                 sparse(stats.histogram, before[2]))
            self._sent_shadow[key] = (counts, stats.latency_sum, list(stats.histogram))

    def _take_streams(self, delta: Delta) -> None:
        for (model, version), stream in list(self.streams.items()):
            for first, totals in ((True, stream.first), (False, stream.gap)):
                key = (model, version, first)
                sent = self._sent_streams.get(key)
                if sent is not None and sent[0] == totals.count:
                    continue
                count, total, hist = sent or (0, 0.0, [0] * _BUCKETS)
                delta.streams[key] = (totals.count - count, totals.sum - total, sparse(totals.hist, hist))
                self._sent_streams[key] = (totals.count, totals.sum, list(totals.hist))


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
        if seen <= 0:
            return
        if len(values) > min(seen, self.size):  # more than a sample of them: never hold more than size
            values = values[:min(seen, self.size)]
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
        # totals and series in arrays, a row each: a report adds in a few indexed adds
        self._totals_table = TotalsTable()
        self.totals = self._totals_table  # type: ignore[assignment]  # read as count, sum, hist: as _Totals
        self._series_table = SeriesTable(horizon_s)
        # per worker: its label set and series numbers -> rows here (gateway.workers.counting numbers them)
        self._names: dict[int, tuple[Cells, Cells]] = {}

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
        self._merge_inflight(worker, {})
        self._worker_inflight.pop(worker, None)

    def forget_names(self, worker: int) -> None:
        """A worker's channel closed: no report of it will come, so its numbers are not needed
        (not at its exit: its last reports may still be in the channel then)."""
        self._names.pop(worker, None)

    def merge(self, worker: int, delta: Delta) -> None:
        if delta.columns is not None:
            self._merge_columns(worker, delta.columns)
        if delta.totals or delta.series:
            self._merge_named(delta)
        for key, counts in delta.steered.items():
            steered = self._steered.get(key)
            if steered is None:
                steered = self._steered[key] = dict.fromkeys(OUTCOMES, 0)
            _add_outcomes(steered, counts)
        for kind, errors in delta.upstream_errors.items():
            self._upstream_errors[kind] = self._upstream_errors.get(kind, 0) + errors
        for version_key, (shadow_counts, latency, shadow_hist) in delta.shadow.items():
            stats: ShadowStats = self.shadow_stats(*version_key)
            for name, bump in zip(_SHADOW_FIELDS, shadow_counts):
                setattr(stats, name, getattr(stats, name) + bump)
            stats.latency_sum += latency
            _add(stats.histogram, shadow_hist)
        for (model, version, first), (count, total, stream_hist) in delta.streams.items():
            stream = self._streams.get((model, version)) or self._new_stream((model, version))
            timings = stream.first if first else stream.gap
            timings.count += count
            timings.sum += total
            _add(timings.hist, stream_hist)
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
        self._merge_inflight(worker, delta.inflight)

    def _merge_clients(self, watched: tuple[str, str], clients: dict[str, tuple[int, int, int, int]]) -> None:
        table = self._clients.get(watched)
        if table is None:
            return  # no longer watched here: the judge will not read it
        for client, sent in clients.items():
            counts = table.get(client)
            if counts is None:
                if len(table) >= MAX_CLIENTS:
                    client = OVERFLOW_CLIENT
                counts = table.get(client)
                if counts is None:
                    counts = table[client] = [0, 0, 0, 0]
            for column, count in enumerate(sent):
                counts[column] += count

    def _merge_columns(self, worker: int, columns: Columns) -> None:
        """A worker's numbered columns: its new names get rows here, then everything is added by row."""
        known = None if columns.restart else self._names.get(worker)
        labels, series = known or (_NONE, _NONE)
        if columns.new_labels:
            labels = np.concatenate((labels, [self._totals_table.row(label) for label in columns.new_labels]))
        if columns.new_series:
            series = np.concatenate((series, [self._series_table.row(key) for key in columns.new_series]))
        self._names[worker] = labels, series
        self._add_columns(columns, labels, series)

    def _merge_named(self, delta: Delta) -> None:
        """Totals and series keyed by name (replica windows' reports, tests): as columns, each key its own number."""
        labels = np.array([self._totals_table.row(label) for label in delta.totals], np.int64)
        series = np.array([self._series_table.row((model, version)) for model, version, _, _ in delta.series],
                          np.int64)
        self._add_columns(named_columns(delta.totals, delta.series), labels, series)

    def _add_columns(self, columns: Columns, labels: Cells, series: Cells) -> None:
        if columns.labels:
            self._totals_table.add(labels[as_array(columns.labels)], columns)
        if columns.series:
            self._series_table.add_outcomes(series[as_array(columns.series)], columns.outcomes)
        if columns.seconds:
            rows = as_array(columns.seconds).reshape(-1, SECOND_ROW)
            (pairs, buckets), counts = cells_of(columns.second_hist, _BUCKETS)
            self._series_table.add_seconds(series[rows[:, 0]], rows[:, 1], rows[:, 2:],
                                           np.column_stack((pairs, buckets, counts)), int(self._clock()), FUTURE_S)

    # -- the recorder's readers, over the arrays -----------------------------------------------------
    def window(self, model: str, version: str, seconds: float) -> Window:
        span = max(1, min(int(seconds), self._slots))
        counts, hist = self._series_table.window((model, version), int(self._clock()), span)
        requests, errors, client_errors, overloads, rejected = counts
        return Window(model, version, float(span), requests, errors, client_errors, tuple(hist), overloads, rejected)

    def second_counts(self, model: str, version: str, second: int
                      ) -> tuple[int, int, int, int, int, array[int] | None] | None:
        found = self._series_table.second((model, version), second)
        if found is None:
            return None
        (requests, errors, client_errors, overloads, rejected), hist = found
        return requests, errors, client_errors, overloads, rejected, None if hist is None else array("q", hist)

    def outcome_totals(self) -> dict[tuple[str, str], dict[Outcome, int]]:
        return {key: dict(zip(OUTCOMES, counts, strict=True)) for key, counts in self._series_table.outcome_totals()}

    def series(self) -> list[tuple[str, str]]:
        return list(self._series_table.index.keys)

    def _merge_inflight(self, worker: int, now: dict[tuple[str, str], int]) -> None:
        """The worker's requests in flight now replace its previous ones: the sum changes by the
        difference, over the versions either one names (a version back to 0 stays, at 0)."""
        before = self._worker_inflight.get(worker, {})
        self._worker_inflight[worker] = now
        inflight = self._inflight
        for key in before.keys() | now.keys():
            change = now.get(key, 0) - before.get(key, 0)
            if change:
                inflight[key] = inflight.get(key, 0) + change

def _add_outcomes(into: dict[Outcome, int], counts: Counts) -> None:
    for index, count in enumerate(counts):
        if count:
            outcome = OUTCOMES[index]
            into[outcome] = into.get(outcome, 0) + count


def _add(into: MutableSequence[int], change: Sparse) -> None:
    for index, count in change:
        into[index] += count

