"""Worker deltas: what N workers' recorders saw, merged, is what one recorder would have seen."""

from __future__ import annotations

import random

import numpy as np
from scipy import stats

from gateway.telemetry.recorder import Outcome, Recorder
from gateway.workers.deltas import DeltaRecorder, MergedRecorder, MergedSample
from gateway.workers.worker import share

OUTCOME_CHOICES = list(Outcome)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_merged_reports_of_three_workers_equal_one_recorder_that_saw_everything() -> None:
    clock = Clock()
    workers = [DeltaRecorder(clock=clock) for _ in range(3)]
    merged, single = MergedRecorder(clock=clock), Recorder(clock=clock)
    rng = random.Random(7)
    for step in range(400):
        worker = rng.randrange(3)
        model, version = "qc", rng.choice(["1", "2"])
        outcome = rng.choice(OUTCOME_CHOICES)
        latency = rng.random() / 10
        route = rng.choice(["weighted", "sticky", "pinned"])
        code = rng.choice(["200", "500", "429"])
        for recorder in (workers[worker], single):
            recorder.record(model, version, outcome, latency, route, "http", code)
            if step % 7 == 0:
                recorder.upstream_error(model, version, "ConnectError")
        if step % 50 == 49:  # reports at irregular moments, across second boundaries
            clock.now += 0.6
            for index, recorder in enumerate(workers):
                merged.merge(index, recorder.take_delta())
    for index, recorder in enumerate(workers):
        merged.merge(index, recorder.take_delta())
    for index, recorder in enumerate(workers):  # nothing new: an empty delta changes nothing
        assert recorder.take_delta().requests() == 0
        merged.merge(index, recorder.take_delta())
    assert {k: (t.count, t.hist) for k, t in merged.totals.items()} == \
        {k: (t.count, t.hist) for k, t in single.totals.items()}
    assert merged.outcome_totals() == single.outcome_totals()
    assert merged.steered_outcome_totals() == single.steered_outcome_totals()
    assert dict(merged.upstream_errors) == dict(single.upstream_errors)
    for version in ("1", "2"):
        assert merged.window("qc", version, 60) == single.window("qc", version, 60)
        assert merged.window("qc", version, 2) == single.window("qc", version, 2)


def test_inflight_is_the_sum_of_the_workers_current_counts_and_a_dead_worker_leaves_it() -> None:
    workers = [DeltaRecorder(), DeltaRecorder()]
    merged = MergedRecorder()
    workers[0].add_inflight(("qc", "2"))
    workers[1].add_inflight(("qc", "2"))
    workers[1].add_inflight(("qc", "2"))
    for index, recorder in enumerate(workers):
        merged.merge(index, recorder.take_delta())
    assert merged.inflight[("qc", "2")] == 3
    merged.forget_worker(1)
    assert merged.inflight[("qc", "2")] == 1


def test_latency_samples_reach_the_control_plane_only_for_watched_versions() -> None:
    worker, merged = DeltaRecorder(), MergedRecorder()
    merged.watch_latencies("qc", "2")
    worker.watch_only(set(merged.watched()))
    for value in (0.01, 0.02, 0.03):
        worker.record("qc", "2", Outcome.SUCCESS, value, "weighted")
        worker.record("qc", "1", Outcome.SUCCESS, value, "weighted")
    merged.merge(0, worker.take_delta())
    assert sorted(merged.take_latencies("qc", "2")) == [0.01, 0.02, 0.03]
    assert merged.take_latencies("qc", "1") == []
    worker.watch_only(set())
    assert worker.watched() == []


def test_each_client_s_counts_of_a_watched_version_reach_the_judge_summed_over_workers() -> None:
    workers, merged, single = [DeltaRecorder(), DeltaRecorder()], MergedRecorder(), Recorder()
    for recorder in (*workers, merged, single):
        recorder.watch_latencies("qc", "3")
    for step in range(60):
        outcome = (Outcome.SUCCESS, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ERROR)[step % 3]
        client = f"10.0.0.{step % 4}"
        for recorder in (workers[step % 2], single):
            recorder.record("qc", "3", outcome, 0.01, "weighted", "http", "200", client=client)
    for index, recorder in enumerate(workers):
        merged.merge(index, recorder.take_delta())
    assert merged.take_clients("qc", "3") == single.take_clients("qc", "3")


def test_merged_sample_is_uniform_over_every_worker_s_values() -> None:
    """Two workers with 10x different traffic: each value must be kept with the same
    probability, wherever it came from (chi-square over many merges)."""
    rng = np.random.default_rng(3)
    kept = np.zeros(1100)
    rounds = 400
    for _ in range(rounds):
        sample = MergedSample(size=100, rng=rng)
        # worker A saw values 0..999 (sends a uniform 100 of them), worker B saw 1000..1099 (all)
        a_values = rng.choice(1000, size=100, replace=False).astype(float).tolist()
        sample.merge(1000, a_values)
        sample.merge(100, [float(v) for v in range(1000, 1100)])
        taken = sample.take()
        assert len(taken) == 100 and len(set(taken)) == 100
        for value in taken:
            kept[int(value)] += 1
    expected = rounds * 100 / 1100
    from_a, from_b = kept[:1000].sum(), kept[1000:].sum()
    assert abs(from_a / (from_a + from_b) - 1000 / 1100) < 0.01
    assert stats.chisquare(kept, np.full(1100, expected)).pvalue > 0.001


def test_a_per_node_budget_is_split_with_nothing_lost_and_unlimited_stays_unlimited() -> None:
    assert [share(64, i, 3) for i in range(3)] == [22, 21, 21]
    assert sum(share(100, i, 7) for i in range(7)) == 100
    assert [share(0, i, 4) for i in range(4)] == [0, 0, 0, 0]
    assert [share(2, i, 3) for i in range(3)] == [1, 1, 1]  # every worker can admit something
