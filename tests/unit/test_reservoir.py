"""The latency reservoir: bounded, uniform, and starting over when taken."""

from __future__ import annotations

import random

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
    reservoir = Reservoir(16, rng=random.Random(1).random)
    for value in range(10_000):
        reservoir.add(float(value))
    sample = reservoir.take()
    assert len(sample) == 16 and len(set(sample)) == 16 and all(0 <= v < 10_000 for v in sample)


def test_every_value_is_equally_likely_to_be_kept() -> None:
    """2,000 reservoirs of 10 out of 200 values (seeded): each value is kept ~100 times; a
    chi-square test of the counts against uniform, and the late values (those Algorithm L
    reaches by skipping) as likely as the first ones."""
    rng = random.Random(7)
    counts = [0] * 200
    for _ in range(2_000):
        reservoir = Reservoir(10, rng=rng.random)
        for value in range(200):
            reservoir.add(float(value))
        for kept in reservoir.take():
            counts[int(kept)] += 1
    assert sum(counts) == 20_000
    assert stats.chisquare(counts).pvalue > 0.001
    assert abs(sum(counts[:100]) - sum(counts[100:])) < 600  # 10,000 each, sd ~ 95
