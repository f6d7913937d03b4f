"""A worker's counts since its last report, kept in the very arrays the report carries.

Why: with traffic spread over 1,000 models nearly every request of a worker is the first of its
label set and series since the last report (every 250 ms, ~3,000 requests over ~2,000 label sets
and as many series). When the worker kept a ``_Totals`` and a ``Series`` object per label set and
per series, handed its tables over at each report and encoded them entry by entry, each such
request paid for making (or taking up again) two objects and for encoding them in Python: ~10 us
of a worker's ~40 us per request over 1,000 models, +23% against the same traffic on one model
(bench/scale.py --only workers). Here a label set and a series are numbered once, as the control
plane knows them (:class:`~gateway.workers.columns.Columns`); a report's first sample of one takes
the next row of a few preallocated arrays, and the report is those arrays' used part, with the
histograms and outcomes made sparse in numpy. What a sample costs does not depend on how many
models the traffic is spread over; what a report costs is a few array copies of what it carries.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from gateway.telemetry.recorder import LATENCY_BOUNDS, MAX_SERIES, OUTCOMES, UNKNOWN_MODEL, Outcome
from gateway.workers.columns import COUNTS, SECOND_ROW, Columns, TotalsRow

Label = tuple[str, str, str, str, str]
SeriesKey = tuple[str, str]
BUCKETS = len(LATENCY_BOUNDS) + 1
NAMES_LIMIT = 4 * MAX_SERIES  # a worker that named more than this starts its numbering over
_OUTCOMES = len(OUTCOMES)
OUTCOME_AT = {outcome: index for index, outcome in enumerate(OUTCOMES)}
_ZERO_BUCKETS = array("i", [0]) * BUCKETS
_ZERO_OUTCOMES = array("i", [0]) * _OUTCOMES
_ZERO_COUNTS = array("q", [0]) * COUNTS
_FIRST_ROWS = 64  # each pool's rows at first; a pool doubles when a report needs more


def _sparse(dense: array[int], size: int) -> array[int]:
    """The first ``size`` cells of ``dense`` as (cell, count) pairs of its non-zero cells."""
    pairs = array("i")
    if size:
        values = np.frombuffer(dense, np.int32, count=size)
        cells = np.flatnonzero(values)
        flat = np.empty(2 * len(cells), np.int32)
        flat[0::2] = cells
        flat[1::2] = values[cells]
        pairs.frombytes(flat.tobytes())
    return pairs


def _double(*pools: array[Any]) -> None:
    for pool in pools:
        pool.frombytes(bytes(len(pool) * pool.itemsize))


class Counting:
    """A worker's totals per label set and judged requests per (series, second) since its last
    report, numbered as its reports name them. Per label set and series it keeps only its number
    and where it sits in the current report (a report's "generation" marks who is in it)."""

    def __init__(self) -> None:
        self.restart = False
        self.generation = 1
        self._start_numbering()
        rows = _FIRST_ROWS
        # this report's label sets: numbers, requests, latency sums, histograms (row x BUCKETS)
        self.labels, self.counts = array("i", bytes(4 * rows)), array("i", bytes(4 * rows))
        self.sums, self.hist = array("d", bytes(8 * rows)), array("i", bytes(4 * rows * BUCKETS))
        self.labels_used, self.label_rows = 0, rows
        # this report's series: numbers and outcomes (row x outcomes)
        self.series, self.outcomes = array("i", bytes(4 * rows)), array("i", bytes(4 * rows * _OUTCOMES))
        self.series_used, self.series_rows = 0, rows
        # this report's (series, second) pairs: SECOND_ROW numbers each, and their histograms
        self.seconds, self.second_hist = array("q", bytes(8 * rows * SECOND_ROW)), array("i", bytes(4 * rows * BUCKETS))
        self.cells_used, self.cell_rows = 0, rows

    def _start_numbering(self) -> None:
        self.label_numbers: dict[Label, int] = {}
        self.label_keys: list[Label] = []
        self.label_mark, self.label_at = array("q"), array("i")  # per number: its report, its row in it
        self.series_numbers: dict[SeriesKey, int] = {}
        self.series_keys: list[SeriesKey] = []
        # per series number: its report, its row in it, the second it last counted, that second's pair
        self.series_mark, self.series_at = array("q"), array("i")
        self.series_second, self.series_cell = array("q"), array("i")
        self.new_labels: list[Label] = []
        self.new_series: list[SeriesKey] = []

    def record(self, label: Label, key: SeriesKey | None, outcome: Outcome, bucket: int, latency_s: float,
               second: int) -> None:
        """One sample: ``label``'s totals (``bucket`` -1: not timed), and unless ``key`` is None
        (the client chose the version: never judged) the series' outcomes and ``second``'s counts.
        A report's first sample of a label set, a series or a (series, second) pair takes the next
        row of its pool, inline: no call, whatever the number of models in the traffic."""
        generation = self.generation
        number = self.label_numbers.get(label)
        if number is None or self.labels_used >= MAX_SERIES and self.label_mark[number] != generation:
            number = self._label_number(label)
        if self.label_mark[number] == generation:
            at = self.label_at[number]
        else:
            at = self.labels_used
            if at == self.label_rows:
                self._more_labels()
            self.labels_used = at + 1
            self.label_mark[number], self.label_at[number] = generation, at
            self.labels[at], self.counts[at], self.sums[at] = number, 0, 0.0
            self.hist[at * BUCKETS:(at + 1) * BUCKETS] = _ZERO_BUCKETS
        self.counts[at] += 1
        if bucket >= 0:
            self.sums[at] += latency_s
            self.hist[at * BUCKETS + bucket] += 1
        if key is None:
            return
        number = self.series_numbers.get(key)
        if number is None or self.series_used >= MAX_SERIES and self.series_mark[number] != generation:
            number = self._series_number(key)
        if self.series_mark[number] == generation:
            at = self.series_at[number]
            fresh = self.series_second[number] != second
        else:
            at = self.series_used
            if at == self.series_rows:
                self._more_series()
            self.series_used = at + 1
            self.series_mark[number], self.series_at[number] = generation, at
            self.series[at] = number
            self.outcomes[at * _OUTCOMES:(at + 1) * _OUTCOMES] = _ZERO_OUTCOMES
            fresh = True
        if fresh:  # the series' first sample of this second in this report: a new (series, second) pair
            cell = self.cells_used
            if cell == self.cell_rows:
                self._more_cells()
            self.cells_used = cell + 1
            self.series_second[number], self.series_cell[number] = second, cell
            row = cell * SECOND_ROW
            self.seconds[row], self.seconds[row + 1] = number, second
            self.seconds[row + 2:row + SECOND_ROW] = _ZERO_COUNTS
            self.second_hist[cell * BUCKETS:(cell + 1) * BUCKETS] = _ZERO_BUCKETS
        else:
            cell = self.series_cell[number]
            row = cell * SECOND_ROW
        self.outcomes[at * _OUTCOMES + OUTCOME_AT[outcome]] += 1
        if bucket >= 0:  # the judged requests: successes and upstream errors, timed
            self.seconds[row + 2] += 1
            self.second_hist[cell * BUCKETS + bucket] += 1
            if outcome is Outcome.UPSTREAM_ERROR:
                self.seconds[row + 3] += 1
        elif outcome is Outcome.CLIENT_ERROR:
            self.seconds[row + 4] += 1
        elif outcome is Outcome.OVERLOAD:
            self.seconds[row + 5] += 1
        elif outcome is Outcome.REJECTED:
            self.seconds[row + 6] += 1

    def _label_number(self, label: Label) -> int:
        """A label set's number, named now if it is new; past MAX_SERIES label sets in one report,
        the overflow's (label sets that clients control cannot grow a report)."""
        if self.labels_used >= MAX_SERIES:
            label = (UNKNOWN_MODEL, "", "", label[3], "")
        number = self.label_numbers.get(label)
        if number is None:
            number = self.label_numbers[label] = len(self.label_keys)
            self.label_keys.append(label)
            self.new_labels.append(label)
            self.label_mark.append(0)
            self.label_at.append(0)
        return number

    def _series_number(self, key: SeriesKey) -> int:
        """A series' number, as :meth:`_label_number` does for a label set."""
        if self.series_used >= MAX_SERIES:
            key = (UNKNOWN_MODEL, "")
        number = self.series_numbers.get(key)
        if number is None:
            number = self.series_numbers[key] = len(self.series_keys)
            self.series_keys.append(key)
            self.new_series.append(key)
            for per_number in (self.series_mark, self.series_at, self.series_second, self.series_cell):
                per_number.append(0)
        return number

    def _more_labels(self) -> None:
        _double(self.labels, self.counts, self.sums, self.hist)
        self.label_rows *= 2

    def _more_series(self) -> None:
        _double(self.series, self.outcomes)
        self.series_rows *= 2

    def _more_cells(self) -> None:
        _double(self.seconds, self.second_hist)
        self.cell_rows *= 2

    def take(self) -> Columns:
        """What came since the last report, as columns; the next report starts empty."""
        labels, series, cells = self.labels_used, self.series_used, self.cells_used
        columns = Columns(self.restart, self.new_labels, self.new_series, self.labels[:labels], self.counts[:labels],
                          self.sums[:labels], _sparse(self.hist, labels * BUCKETS), self.series[:series],
                          _sparse(self.outcomes, series * _OUTCOMES), self.seconds[:cells * SECOND_ROW],
                          _sparse(self.second_hist, cells * BUCKETS))
        self.labels_used = self.series_used = self.cells_used = 0
        self.generation += 1
        self.new_labels, self.new_series, self.restart = [], [], False
        if len(self.label_keys) + MAX_SERIES > NAMES_LIMIT or len(self.series_keys) + MAX_SERIES > NAMES_LIMIT:
            self._start_numbering()  # bounded: the next report names them again
            self.restart = True
        return columns

    def totals(self) -> Mapping[Label, TotalsRow]:
        """The label sets counted since the last report (what the next one carries)."""
        return _ReportTotals(self)

    def series_counted(self) -> list[SeriesKey]:
        """The series counted since the last report."""
        return [self.series_keys[number] for number in self.series[:self.series_used]]


class _ReportTotals(Mapping[Label, TotalsRow]):
    """A read-only view of the label sets counted since the last report."""

    def __init__(self, counting: Counting) -> None:
        self.counting = counting

    def _rows(self) -> dict[Label, int]:
        counting = self.counting
        return {counting.label_keys[number]: at for at, number in enumerate(counting.labels[:counting.labels_used])}

    def __getitem__(self, label: Label) -> TotalsRow:
        at, counting = self._rows()[label], self.counting
        return TotalsRow(counting.counts[at], counting.sums[at], list(counting.hist[at * BUCKETS:(at + 1) * BUCKETS]))

    def __iter__(self) -> Iterator[Label]:
        return iter(self._rows())

    def __len__(self) -> int:
        return self.counting.labels_used
