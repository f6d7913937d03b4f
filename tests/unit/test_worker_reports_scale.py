"""A worker's report costs what changed: counted, never timed.

Before issue 36 each report (every 250 ms per worker) diffed every label set and every series
the worker had ever seen, and carried and merged 31 histogram buckets per label set and 35
integers per (series, second) touched: with --workers 2 and traffic over 1,000 models the
supervisor spent 143-188 ms CPU/s on it (bench/scale.py). Then a report carried only what
changed, but named every label set and series it carried and was merged one of them at a time
in Python: 44-60 ms CPU/s. Now a label set is named once, then numbered, and a report is added
in a few array operations whatever the label sets in it.
"""

from __future__ import annotations

import sys
from array import array
from types import FrameType
from typing import Any

import pytest

from gateway.telemetry.recorder import OUTCOMES, Outcome, Recorder
from gateway.workers import columns as columns_module
from gateway.workers import counting as counting_module
from gateway.workers.columns import SECOND_ROW
from gateway.workers.deltas import Delta, DeltaRecorder, MergedRecorder

MODELS = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def numbers(value: Any) -> int:
    """How many numbers a report carries (what is pickled, sent and merged)."""
    if isinstance(value, bool | int | float):
        return 1
    if isinstance(value, array):
        return len(value)
    if isinstance(value, dict):
        return sum(numbers(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(numbers(item) for item in value)
    return sum(numbers(item) for item in vars(value).values()) if hasattr(value, "__dict__") else 0


def test_a_report_carries_a_few_numbers_per_sample_not_every_bucket_of_every_label_set() -> None:
    clock = Clock()
    worker = DeltaRecorder(clock=clock)
    for index in range(MODELS):
        worker.record(f"m{index:05d}", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    delta = worker.take_delta()
    assert delta.requests() == MODELS
    carried = numbers(delta)
    # per sample: its label set's count, sum and one bucket; its series' outcomes (6) and its second's counts
    # and one bucket
    assert carried <= 20 * MODELS, f"{carried / MODELS:.0f} numbers per sample"


def carried(worker: DeltaRecorder, delta: Delta) -> tuple[list[Any], list[tuple[Any, list[int]]]]:
    """The label sets and the (series, seconds) a worker's report carries, by the worker's names."""
    columns = delta.columns
    assert columns is not None
    counting = worker._counting  # noqa: SLF001 - the worker's own numbering, to read its report back
    seconds = [columns.seconds[at:at + 2] for at in range(0, len(columns.seconds), SECOND_ROW)]
    return ([counting.label_keys[number] for number in columns.labels],
            [(counting.series_keys[number], [second for at, second in seconds if at == number])
             for number in columns.series])


def test_a_worker_holds_and_visits_only_what_changed_since_its_last_report() -> None:
    clock = Clock()
    worker = DeltaRecorder(clock=clock)
    for index in range(MODELS):
        worker.record(f"m{index:05d}", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
        worker.upstream_error(f"m{index:05d}", "2", "VersionUnavailable")
    worker.take_delta()
    clock.now += 2  # the seconds reported are over
    worker.take_delta()
    worker.record("m00007", "2", Outcome.UPSTREAM_ERROR, 0.02, "weighted", "http", "500")
    assert (len(worker.totals), len(worker.series()), len(worker.upstream_errors)) == (1, 1, 0), \
        "a worker's tables hold what came since its last report: what the next report visits"
    delta = worker.take_delta()
    labels, series = carried(worker, delta)
    assert labels == [("m00007", "2", "weighted", "http", "500")]
    assert series == [(("m00007", "2"), [1002])]
    assert delta.columns is not None
    assert list(delta.columns.outcomes) == [OUTCOMES.index(Outcome.UPSTREAM_ERROR), 1], \
        "its one outcome: (series row x outcomes + outcome, count)"


def test_a_label_set_is_named_once_then_a_report_carries_its_number() -> None:
    """A report of 1,000 models the worker reported before carries no name: numbers only
    (each report named all 2,000 label sets and series again: ~10,000 strings to unpickle)."""
    clock = Clock()
    worker = DeltaRecorder(clock=clock)
    for _ in range(2):
        for index in range(MODELS):
            worker.record(f"m{index:05d}", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
        delta = worker.take_delta()
        clock.now += 0.25
    assert delta.columns is not None
    assert (delta.columns.new_labels, delta.columns.new_series, delta.totals, delta.series) == ([], [], {}, [])
    assert len(delta.columns.labels) == len(delta.columns.series) == MODELS


def python_calls(action: Any) -> int:
    """How many Python functions and builtins ``action()`` calls: a merge that visits each label
    set in Python calls something per label set."""
    calls = 0

    def count(_frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def test_merging_a_report_of_a_thousand_models_is_a_few_array_operations_not_one_per_label_set() -> None:
    clock = Clock()
    worker, merged = DeltaRecorder(clock=clock), MergedRecorder(clock=clock)
    for step in range(3):
        for index in range(MODELS):
            outcome = Outcome.UPSTREAM_ERROR if index % 7 == 0 else Outcome.SUCCESS
            worker.record(f"m{index:05d}", "2", outcome, index / 10_000, "weighted", "http", "200")
            worker.record(f"m{index:05d}", "3", Outcome.SUCCESS, 0.004, "sticky", "grpc", "OK")
        clock.now += 0.6
        delta = worker.take_delta()
        calls = python_calls(lambda delta=delta: merged.merge(1, delta))
        if step:  # the first report names every label set and series: each gets its row once
            assert calls < 150, f"{calls} calls to merge a report of {2 * MODELS} label sets"
    assert merged.totals[("m00007", "2", "weighted", "http", "200")].count == 3
    assert merged.window("m00007", "2", 10).errors == 3


def worker_calls_per_request(models: int, per_report: int = 1500, reports: int = 3) -> float:
    """Python calls (functions and builtins) per request of a worker recording ``per_report``
    requests over ``models`` models (80/20 over two versions) between reports, its reports included,
    once every label set was named (the first reports, not counted)."""
    clock = Clock()
    worker = DeltaRecorder(clock=clock)
    names = ["qc"] if models == 1 else [f"m{index:05d}" for index in range(models)]

    def serve() -> None:
        for _ in range(reports):
            for index in range(per_report):
                worker.record(names[index % models], "3" if index % 5 == 0 else "2", Outcome.SUCCESS, 0.003,
                              "weighted", "http", "200", "client")
            clock.now += 0.25
            worker.take_delta()

    serve()
    return python_calls(serve) / (per_report * reports)


def test_a_worker_s_sample_costs_the_same_over_a_thousand_models_as_over_one() -> None:
    """Over 1,000 models nearly every sample of a report is its label set's and series' first
    (~3,000 requests a report over ~2,000 of each): a worker that made or took up a totals and a
    series object for each, then encoded them one by one in Python, called ~12 more functions per
    request than over one model (17 against 5; +23% CPU per request, bench/scale.py --only workers).
    Now such a sample takes the next row of the report's arrays inline, and a report is a few
    array operations whatever it carries."""
    one, spread = worker_calls_per_request(1), worker_calls_per_request(MODELS)
    assert spread <= one + 0.05, f"calls per request: {one:.2f} over one model, {spread:.2f} over {MODELS}"


def test_past_max_series_in_one_report_a_worker_s_label_sets_fold_into_the_overflow_and_lose_no_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counting_module, "MAX_SERIES", 40)
    clock = Clock()
    worker, merged = DeltaRecorder(clock=clock), MergedRecorder(clock=clock)
    for _ in range(2):
        for index in range(100):
            worker.record(f"m{index:05d}", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
        worker.record("m00099", "2", Outcome.CLIENT_ERROR, 0.004, "weighted", "grpc", "400")
        clock.now += 0.5
        delta = worker.take_delta()
        assert delta.columns is not None
        assert (len(delta.columns.labels), len(delta.columns.series)) == (42, 41), \
            "40 label sets, then one overflow per protocol; 40 series, then the overflow's"
        merged.merge(1, delta)
    rows = dict(merged.totals.items())
    assert rows[("_unknown", "", "", "http", "")].count == 2 * 60
    assert rows[("_unknown", "", "", "grpc", "")].count == 2
    assert sum(row.count for row in rows.values()) == 2 * 101
    assert merged.window("_unknown", "", 10).requests == 2 * 60 and merged.window("m00007", "2", 10).requests == 2


def test_a_worker_that_numbered_too_many_keys_starts_over_and_nothing_is_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The numbering is bounded: past NAMES_LIMIT keys a worker names them again from 0 and the
    control plane forgets its old numbers; a worker's numbers are its own (two workers, same names)."""
    monkeypatch.setattr(counting_module, "NAMES_LIMIT", 50)
    clock = Clock()
    workers = [DeltaRecorder(clock=clock) for _ in range(2)]
    merged, single = MergedRecorder(clock=clock), Recorder(clock=clock)
    restarts = 0
    for step in range(400):
        model = f"m{(step * 7) % 90:05d}" if step % 2 else f"m{step % 30:05d}"
        for recorder in (workers[step % 2], single):
            recorder.record(model, "2", Outcome.SUCCESS, step / 1000, "weighted", "http", "200")
        if step % 40 == 39:
            clock.now += 0.5
            for pid, worker in enumerate(workers):
                delta = worker.take_delta()
                assert delta.columns is not None
                restarts += delta.columns.restart
                merged.merge(pid, delta)
    assert restarts >= 2
    assert {k: (t.count, t.hist) for k, t in merged.totals.items()} == \
        {k: (t.count, t.hist) for k, t in single.totals.items()}
    assert merged.outcome_totals() == single.outcome_totals()
    assert merged.window("m00001", "2", 30) == single.window("m00001", "2", 30)


def test_a_report_in_numbers_the_control_plane_never_saw_named_is_refused_whole() -> None:
    """A worker's numbers are only good on its own channel: forgotten when it closes, a report
    of them is an error (the channel's reader logs it), not counts added to someone's rows."""
    worker, merged = DeltaRecorder(), MergedRecorder()
    worker.record("qc", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    merged.merge(7, worker.take_delta())
    merged.forget_names(7)
    worker.record("qc", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    with pytest.raises(IndexError):
        merged.merge(7, worker.take_delta())
    assert merged.totals[("qc", "2", "weighted", "http", "200")].count == 1


def test_reports_of_a_thousand_models_merge_to_what_one_recorder_saw() -> None:
    """The sparse reports lose nothing: over seconds, reports mid-second and label sets that
    come back after a report, the merged recorder equals one that saw every request."""
    clock = Clock()
    workers = [DeltaRecorder(clock=clock) for _ in range(2)]
    merged, single = MergedRecorder(clock=clock), Recorder(clock=clock)
    for step in range(6000):
        model, latency = f"m{step % MODELS:05d}", (step % 7) / 200
        outcome = Outcome.UPSTREAM_ERROR if step % 11 == 0 else Outcome.SUCCESS
        for recorder in (workers[step % 2], single):
            recorder.record(model, "2" if step % 3 else "3", outcome, latency, "weighted", "http", "200")
        if step % 700 == 699:
            clock.now += 0.4
            for index, worker in enumerate(workers):
                merged.merge(index, worker.take_delta())
    for index, worker in enumerate(workers):
        merged.merge(index, worker.take_delta())
    assert {k: (t.count, t.hist) for k, t in merged.totals.items()} == \
        {k: (t.count, t.hist) for k, t in single.totals.items()}
    assert merged.outcome_totals() == single.outcome_totals()
    for model in ("m00000", "m00999", "m00500"):
        for version in ("2", "3"):
            assert merged.window(model, version, 10) == single.window(model, version, 10)
            assert merged.window(model, version, 1) == single.window(model, version, 1)


def test_in_flight_requests_merge_by_difference_and_leave_nothing_behind_in_a_worker() -> None:
    workers, merged = [DeltaRecorder(), DeltaRecorder()], MergedRecorder()
    for index in range(MODELS):
        workers[0].add_inflight((f"m{index:05d}", "2"))
    workers[1].add_inflight(("m00001", "2"))
    for index, worker in enumerate(workers):
        merged.merge(index, worker.take_delta())
    assert merged.inflight[("m00001", "2")] == 2 and merged.inflight[("m00999", "2")] == 1
    for index in range(MODELS):
        workers[0].remove_inflight((f"m{index:05d}", "2"))
    delta = workers[0].take_delta()
    assert delta.inflight == {}, "a report carries what is in flight now"
    merged.merge(0, delta)
    assert merged.inflight[("m00001", "2")] == 1 and merged.inflight[("m00999", "2")] == 0
    merged.forget_worker(1)
    assert merged.inflight[("m00001", "2")] == 0


def test_past_max_series_the_merged_tables_fold_into_the_overflow_rows_and_lose_no_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control plane's array tables are bounded as the recorder's dicts are: past MAX_SERIES
    label sets (and series) a new one shares its overflow row. Which label sets get rows of their
    own follows the order they are merged in (a worker's report at a time), so they are not the
    ones a single recorder would have kept; every request is counted once either way."""
    from gateway.telemetry import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "MAX_SERIES", 40)
    monkeypatch.setattr(columns_module, "MAX_SERIES", 40)
    clock = Clock()
    workers = [DeltaRecorder(clock=clock) for _ in range(2)]
    merged, single = MergedRecorder(clock=clock), Recorder(clock=clock)
    for step in range(600):
        model = f"m{step % 100:05d}"
        for recorder in (workers[step % 2], single):
            recorder.record(model, "2", Outcome.SUCCESS, step / 10_000, "weighted", "http" if step % 3 else "grpc",
                            "200")
        if step % 60 == 59:
            clock.now += 0.5
            for pid, worker in enumerate(workers):
                merged.merge(pid, worker.take_delta())
    rows, kept = dict(merged.totals.items()), dict(single.totals.items())
    assert len(rows) == len(kept) == 42, "40 label sets, then one overflow row per protocol"
    assert ("_unknown", "", "", "grpc", "") in rows and ("_unknown", "", "", "http", "") in rows
    assert sum(row.count for row in rows.values()) == 600
    assert [sum(column) for column in zip(*(row.hist for row in rows.values()), strict=True)] == \
        [sum(column) for column in zip(*(row.hist for row in kept.values()), strict=True)]
    for label in rows.keys() & kept.keys() - {("_unknown", "", "", "grpc", ""), ("_unknown", "", "", "http", "")}:
        assert (rows[label].count, rows[label].hist) == (kept[label].count, kept[label].hist)
    assert len(merged.series()) == 41 and sum(sum(outcomes.values()) for outcomes in merged.outcome_totals().values()) \
        == 600
