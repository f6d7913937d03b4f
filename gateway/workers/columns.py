"""A worker report's counting tables as columns, and the control plane's tables they add into.

Why: with traffic spread over 1,000 models a worker's report (every 250 ms) carries ~2,000 label
sets and as many (series, second) pairs, each with a sample or two. Merged one Python object at a
time (a dict lookup of a freshly unpickled key, then attribute and array updates) that cost the
control plane 6-7 ms per report: 44-60 ms CPU/s for two workers. Here a worker names each label
set and series once, by number (:mod:`gateway.workers.counting`), and a report carries numbers in flat arrays
(:class:`Columns`); the control plane keeps its cumulative totals and per-second series in numpy
arrays (:class:`TotalsTable`, :class:`SeriesTable`) and adds a whole report with a few indexed
adds, whatever the number of label sets in it. What a report carries is still only what changed
(the worker's tables start afresh at each report), and histograms and outcomes still travel
sparse: their non-zero cells, as (row x width + column, count) pairs.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from gateway.telemetry.recorder import HIST_SECONDS, LATENCY_BOUNDS, MAX_SERIES, OUTCOMES, UNKNOWN_MODEL

BUCKETS = len(LATENCY_BOUNDS) + 1
COUNTS = 5  # a second's requests, upstream errors, client errors, overloads, rejected
SECOND_ROW = 2 + COUNTS  # (series number, second, its counts)
Key = TypeVar("Key", bound=Hashable)
Cells = npt.NDArray[Any]  # a table or a column of one: int64, int32 or float64


@dataclass
class Columns:
    """A worker's counting tables since its last report. Label sets and series are numbers; a
    report names the ones it numbers first (``new_labels``, ``new_series``, in number order), and
    ``restart`` says the worker's numbering started over (the control plane forgets its names)."""

    restart: bool = False
    new_labels: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    new_series: list[tuple[str, str]] = field(default_factory=list)
    labels: array[int] = field(default_factory=lambda: array("i"))  # label set numbers
    counts: array[int] = field(default_factory=lambda: array("i"))  # each one's requests
    sums: array[float] = field(default_factory=lambda: array("d"))  # each one's latency sum
    label_hist: array[int] = field(default_factory=lambda: array("i"))  # (row x BUCKETS + bucket, count)
    series: array[int] = field(default_factory=lambda: array("i"))  # series numbers
    outcomes: array[int] = field(default_factory=lambda: array("i"))  # (row x len(OUTCOMES) + outcome, count)
    seconds: array[int] = field(default_factory=lambda: array("q"))  # SECOND_ROW per (series, second)
    second_hist: array[int] = field(default_factory=lambda: array("i"))  # (second row x BUCKETS + bucket, count)

    def requests(self) -> int:
        return sum(self.counts)

    def entries(self) -> int:
        """The label sets and (series, second) pairs it carries: what merging it visits in Python
        on the worker's side (the control plane adds them as arrays)."""
        return len(self.labels) + len(self.seconds) // SECOND_ROW


def named_columns(totals: Mapping[Any, tuple[int, float, Sequence[tuple[int, int]]]],
                  series: Sequence[tuple[str, str, Sequence[int], Sequence[tuple[Any, ...]]]]) -> Columns:
    """Totals and series keyed by name (as replica windows publish them) as columns, numbered in
    their order: label set i is number i, series j number j."""
    columns = Columns()
    for row, (count, total, hist) in enumerate(totals.values()):
        columns.labels.append(row)
        columns.counts.append(count)
        columns.sums.append(total)
        for bucket, bucket_count in hist:
            columns.label_hist.extend((row * BUCKETS + bucket, bucket_count))
    for number, (_, _, outcomes, seconds) in enumerate(series):
        columns.series.append(number)
        for outcome, count in enumerate(outcomes):
            columns.outcomes.extend((number * len(OUTCOMES) + outcome, count))
        for second, *counts, hist in seconds:
            for bucket, bucket_count in hist:
                columns.second_hist.extend((len(columns.seconds) // SECOND_ROW * BUCKETS + bucket, bucket_count))
            columns.seconds.extend((number, second, *counts))
    return columns


def _grown(old: Cells, size: int, fill: int = 0) -> Cells:
    new = np.full((size, *old.shape[1:]), fill, dtype=old.dtype)
    new[:len(old)] = old
    return new


class _Index(Generic[Key]):
    """Keys to rows, bounded as the recorder's tables are: past MAX_SERIES keys, a new one shares
    the row of its ``overflow`` key."""

    def __init__(self) -> None:
        self.rows: dict[Key, int] = {}
        self.keys: list[Key] = []

    def row(self, key: Key, overflow: Key) -> int:
        row = self.rows.get(key)
        if row is None:
            if len(self.keys) >= MAX_SERIES:
                row = self.rows.get(overflow)
                if row is not None:
                    return row
                key = overflow
            row = self.rows[key] = len(self.keys)
            self.keys.append(key)
        return row


@dataclass(frozen=True)
class TotalsRow:
    """One label set's cumulative counters, as the recorder's readers read them."""

    count: int
    sum: float
    hist: list[int]


class TotalsTable(Mapping[tuple[str, str, str, str, str], TotalsRow]):
    """Cumulative counters per label set (``/metrics``), one row each: counts, sums, histograms.
    A read-only mapping of label set to :class:`TotalsRow` for the recorder's readers."""

    def __init__(self) -> None:
        self.index: _Index[tuple[str, str, str, str, str]] = _Index()
        self.count = np.zeros(64, np.int64)
        self.sum = np.zeros(64, np.float64)
        self.hist = np.zeros((64, BUCKETS), np.int64)

    def row(self, label: tuple[str, str, str, str, str]) -> int:
        row = self.index.row(label, (UNKNOWN_MODEL, "", "", label[3], ""))
        if row >= len(self.count):
            size = len(self.count) * 3 // 2
            self.count, self.sum, self.hist = _grown(self.count, size), _grown(self.sum, size), _grown(self.hist, size)
        return row

    def add(self, rows: Cells, columns: Columns) -> None:
        """Add ``columns``' label sets, whose rows here are ``rows``."""
        add_at(self.count, rows, as_array(columns.counts))
        add_at(self.sum, rows, as_array(columns.sums))
        (at, buckets), counts = cells_of(columns.label_hist, BUCKETS)
        add_at(self.hist, rows[at] * BUCKETS + buckets, counts)

    def __getitem__(self, label: tuple[str, str, str, str, str]) -> TotalsRow:
        row = self.index.rows[label]
        return TotalsRow(int(self.count[row]), float(self.sum[row]), self.hist[row].tolist())

    def __iter__(self) -> Iterator[tuple[str, str, str, str, str]]:
        return iter(list(self.index.keys))

    def __len__(self) -> int:
        return len(self.index.keys)

    def items(self) -> Iterator[tuple[tuple[str, str, str, str, str], TotalsRow]]:  # type: ignore[override]
        """Every row at once (a scrape reads them all): the arrays are converted in bulk."""
        size = len(self.index.keys)
        rows = zip(self.count[:size].tolist(), self.sum[:size].tolist(), self.hist[:size].tolist(), strict=True)
        return iter([(label, TotalsRow(*row)) for label, row in zip(list(self.index.keys), rows, strict=False)])


class SeriesTable:
    """Every (model, version)'s judged requests per second over the horizon and latency histograms
    over the last HIST_SECONDS, as the recorder's :class:`~gateway.telemetry.recorder.Series` holds
    them, in arrays with a row per series (~17 KB each), plus its cumulative outcomes."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.index: _Index[tuple[str, str]] = _Index()
        self.stamp = np.full((16, slots), -1, np.int64)
        self.counts = np.zeros((16, slots, COUNTS), np.int32)
        self.hist_stamp = np.full((16, HIST_SECONDS), -1, np.int64)
        self.hist = np.zeros((16, HIST_SECONDS, BUCKETS), np.int32)
        self.outcomes = np.zeros((16, len(OUTCOMES)), np.int64)

    def row(self, key: tuple[str, str]) -> int:
        row = self.index.row(key, (UNKNOWN_MODEL, ""))
        if row >= len(self.stamp):
            size = len(self.stamp) * 3 // 2
            self.stamp, self.hist_stamp = _grown(self.stamp, size, -1), _grown(self.hist_stamp, size, -1)
            self.counts, self.hist, self.outcomes = (_grown(self.counts, size), _grown(self.hist, size),
                                                     _grown(self.outcomes, size))
        return row

    def add_outcomes(self, rows: Cells, outcomes: array[int]) -> None:
        """``outcomes``' (cell, count) pairs, of the series whose rows here are ``rows``."""
        (at, outcome), counts = cells_of(outcomes, len(OUTCOMES))
        add_at(self.outcomes, rows[at] * len(OUTCOMES) + outcome, counts)

    def add_seconds(self, rows: Cells, seconds: Cells, counts: Cells, hist: Cells,
                    now: int, future_s: int) -> None:
        """Add (series ``rows``, ``seconds``) pairs' ``counts`` (COUNTS columns) and ``hist`` (triples
        of (pair, bucket, count)), as the recorder would have recorded them: a second past
        ``now + future_s`` is not added (a clock ahead would take its real second's slot), nor one
        older than its slot holds; its histogram only while it is kept (HIST_SECONDS)."""
        slots = seconds % self.slots
        held = self.stamp[rows, slots]
        kept = (seconds <= now + future_s) & (held <= seconds)
        if not kept.all():
            rows, seconds, slots, held, counts = rows[kept], seconds[kept], slots[kept], held[kept], counts[kept]
            pair = np.cumsum(kept) - 1  # a kept pair's new position
            hist = hist[kept[hist[:, 0]]] if len(hist) else hist
            hist = np.column_stack((pair[hist[:, 0]], hist[:, 1:])) if len(hist) else hist
        fresh = held != seconds
        if fresh.any():
            self.stamp[rows[fresh], slots[fresh]] = seconds[fresh]
            self.counts[rows[fresh], slots[fresh]] = 0
        cells = (rows * self.slots + slots) * COUNTS
        add_at(self.counts, (cells[:, None] + np.arange(COUNTS)).ravel(), counts.ravel())
        if not len(hist):
            return
        at = seconds % HIST_SECONDS
        timed = np.zeros(len(rows), bool)
        timed[hist[:, 0]] = True
        timed &= (now - seconds < HIST_SECONDS) & (self.hist_stamp[rows, at] <= seconds)
        fresh = timed & (self.hist_stamp[rows, at] != seconds)
        if fresh.any():
            self.hist_stamp[rows[fresh], at[fresh]] = seconds[fresh]
            self.hist[rows[fresh], at[fresh]] = 0
        hist = hist[timed[hist[:, 0]]]
        pairs = hist[:, 0]
        add_at(self.hist, (rows[pairs] * HIST_SECONDS + at[pairs]) * BUCKETS + hist[:, 1], hist[:, 2])

    # -- the recorder's readers ----------------------------------------------------------------
    def window(self, key: tuple[str, str], now: int, span: int) -> tuple[list[int], list[int]]:
        """The ``span`` seconds up to ``now``: (the COUNTS summed, the histogram summed)."""
        row = self.index.rows.get(key)
        if row is None:
            return [0] * COUNTS, [0] * BUCKETS
        seconds = np.arange(now - span + 1, now + 1)
        seconds = seconds[self.stamp[row, seconds % self.slots] == seconds]
        counts = self.counts[row, seconds % self.slots].sum(axis=0, dtype=np.int64)
        recent = seconds[now - seconds < HIST_SECONDS]
        recent = recent[self.hist_stamp[row, recent % HIST_SECONDS] == recent]
        hist = self.hist[row, recent % HIST_SECONDS].sum(axis=0, dtype=np.int64)
        return counts.tolist(), hist.tolist()

    def second(self, key: tuple[str, str], second: int) -> tuple[list[int], list[int] | None] | None:
        row = self.index.rows.get(key)
        if row is None or self.stamp[row, second % self.slots] != second:
            return None
        at = second % HIST_SECONDS
        hist = self.hist[row, at].tolist() if self.hist_stamp[row, at] == second else None
        return self.counts[row, second % self.slots].tolist(), hist

    def outcome_totals(self) -> Iterator[tuple[tuple[str, str], list[int]]]:
        keys = list(self.index.keys)
        return zip(keys, self.outcomes[:len(keys)].tolist(), strict=True)


def as_array(values: array[Any]) -> Cells:
    """An array's numbers as numpy's, in its own type: no copy."""
    return np.frombuffer(values, np.dtype(values.typecode)) if values else np.zeros(0, np.dtype(values.typecode))


def add_at(table: Cells, cells: Cells, values: Cells) -> None:
    """``table``'s cells (flat indices) plus ``values``, a cell named twice added twice: on the flat
    view, in the table's own type (numpy's fast path; tens of times faster than by rows and columns)."""
    np.add.at(table.reshape(-1), cells, values.astype(table.dtype, copy=False))


def cells_of(pairs: array[int], width: int) -> tuple[tuple[Cells, Cells], Cells]:
    """(row x width + column, count) pairs as ((rows, columns), counts)."""
    flat = as_array(pairs).reshape(-1, 2)
    return np.divmod(flat[:, 0], width), flat[:, 1]
