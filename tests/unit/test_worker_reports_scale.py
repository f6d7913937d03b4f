"""A worker's report costs what changed: counted, never timed.

Before issue 36 each report (every 250 ms per worker) diffed every label set and every series
the worker had ever seen, and carried and merged 31 histogram buckets per label set and 35
integers per (series, second) touched: with --workers 2 and traffic over 1,000 models the
supervisor spent 143-188 ms CPU/s on it (bench/scale.py).
"""

from __future__ import annotations

from typing import Any

from gateway.telemetry.recorder import OUTCOMES, Outcome, Recorder
from gateway.workers.deltas import DeltaRecorder, MergedRecorder

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
    assert list(delta.totals) == [("m00007", "2", "weighted", "http", "500")]
    [(model, version, outcomes, seconds)] = delta.series
    assert (model, version) == ("m00007", "2") and [second[0] for second in seconds] == [1002]
    assert dict(zip(OUTCOMES, outcomes, strict=True)) == {**dict.fromkeys(OUTCOMES, 0), Outcome.UPSTREAM_ERROR: 1}


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
