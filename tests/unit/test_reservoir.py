"""The latency reservoir: bounded, uniform, and starting over when taken."""

from __future__ import annotations

import numpy as np
from scipy import stats

from gateway.telemetry.reservoir import Reservoir


def test_fewer_values_than_the_size_are_all_kept_and_take_starts_over() -> None:
    reservoir = Reservoir(8)
    for value in range(5):
        reservoir.add(float(value))
    assert sorted(reservoir.take()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert reservoir.take() == [] and reservoir.seen == 0
    reservoir.add(9.0)
    assert reservoir.take() == [9.0]


def test_the_sample_is_bounded_and_holds_distinct_added_values() -> None:
    reservoir = Reservoir(16, rng=np.random.default_rng(1))
    for value in range(10_000):
        reservoir.add(float(value))
    sample = reservoir.take()
    assert len(sample) == 16 and len(set(sample)) == 16 and all(0 <= v < 10_000 for v in sample)


def test_every_value_is_equally_likely_to_be_kept() -> None:
    """2,000 windows of 200 values into a reservoir of 10 (seeded), taken and reused, so the
    schedules drawn at take() and the replanning inside a long window are both exercised:
    each value is kept ~100 times (chi-square against uniform), late values (those Algorithm
    L reaches by skipping) as often as early ones."""
    rng = np.random.default_rng(7)
    counts = [0] * 200
    reservoir = Reservoir(10, rng=rng)
    for _ in range(2_000):
        for value in range(200):
            reservoir.add(float(value))
        for kept in reservoir.take():
            counts[int(kept)] += 1
    assert sum(counts) == 20_000
    assert stats.chisquare(counts).pvalue > 0.001
    assert abs(sum(counts[:100]) - sum(counts[100:])) < 600  # 10,000 each, sd ~ 95


def test_a_window_longer_than_one_schedule_stays_uniform() -> None:
    """Schedules of 3 replacements: a window of 3,000 values into a reservoir of 4 needs
    ~10 schedules; the kept values still split evenly over the window's halves."""
    rng = np.random.default_rng(3)
    halves = [0, 0]
    reservoir = Reservoir(4, rng=rng, planned=3)
    for _ in range(300):
        for value in range(3_000):
            reservoir.add(float(value))
        for kept in reservoir.take():
            halves[kept >= 1_500] += 1
    assert sum(halves) == 1200 and abs(halves[0] - halves[1]) < 180  # 600 each, sd ~ 17


class CountedRng:
    """A generator that counts the numbers drawn from it."""

    def __init__(self, seed: int) -> None:
        self.inner = np.random.default_rng(seed)
        self.drawn = 0

    def random(self, size: int | None = None) -> object:
        self.drawn += 1 if size is None else size
        return self.inner.random(size)

    def integers(self, low: int, high: int, size: int) -> object:
        self.drawn += size
        return self.inner.integers(low, high, size)


def test_a_take_with_nothing_added_draws_nothing_and_the_next_window_stays_uniform() -> None:
    """Replicas take every watched version's reservoirs each second (gateway.services.replica_windows):
    a schedule drawn at each take (~4,000 numbers) was most of an idle gateway's CPU with 50
    rollouts (~90 ms/s). A take with nothing added leaves the schedule drawn before: its draws
    do not depend on any value. Counted, and the windows after idle takes are still uniform."""
    rng = CountedRng(11)
    reservoir = Reservoir(10, rng=rng)  # type: ignore[arg-type]
    created = rng.drawn
    for _ in range(100):
        assert reservoir.take() == []
    assert rng.drawn == created, f"{rng.drawn - created} numbers drawn by 100 takes with nothing added"
    counts = [0] * 200
    for _ in range(2_000):
        for value in range(200):
            reservoir.add(float(value))
        for kept in reservoir.take():
            counts[int(kept)] += 1
        assert reservoir.take() == []  # an idle second between windows
    assert sum(counts) == 2_000 * 10
    assert stats.chisquare(counts).pvalue > 0.001


def test_a_new_reservoir_draws_its_schedule_only_once_a_value_comes_past_its_size() -> None:
    """A rollout's versions are watched with three reservoirs each, most of which never see more
    values than they hold: 50 rollouts starting drew 300 schedules at once (~60 ms). Counted; and
    the first window past the size, whose schedule is drawn then, is still uniform."""
    rng = CountedRng(5)
    reservoir = Reservoir(10, rng=rng)  # type: ignore[arg-type]
    for value in range(10):
        reservoir.add(float(value))
    assert rng.drawn == 0 and sorted(reservoir.take()) == [float(v) for v in range(10)]
    counts = [0] * 200
    for seed in range(2_000):
        fresh = Reservoir(10, rng=np.random.default_rng(seed))
        for value in range(200):
            fresh.add(float(value))
        for kept in fresh.take():
            counts[int(kept)] += 1
    assert sum(counts) == 2_000 * 10
    assert stats.chisquare(counts).pvalue > 0.001
