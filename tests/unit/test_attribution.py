"""Where a canary's difference lies, in Triton's terms: rollout/attribution.py (pure)."""

from __future__ import annotations

import pytest

from gateway.rollout.attribution import (
    COMPUTE,
    OUTSIDE,
    QUEUE,
    ErrorClasses,
    attribute,
    error_words,
    latency_cause,
    median_ms,
    view,
    without_cache_hits,
)
from gateway.services.engine_stats import EngineCounters, TargetInterval

MS = 1_000_000  # ns


def counters(requests: int, queue_ms: float, compute_ms: float, batch: float = 1.0, hits: int = 0,
             fail: int = 0) -> EngineCounters:
    """An interval of ``requests`` successes at the given means per request; ``hits`` of them
    answered from the cache (queued, not computed)."""
    computed = requests - hits
    executions = max(1, round(computed / batch)) if computed else 0
    return EngineCounters(success=requests, fail=fail, queue_count=requests, queue_ns=int(queue_ms * MS * requests),
                          compute_count=computed, compute_input_ns=int(0.1 * compute_ms * MS * computed),
                          compute_infer_ns=int(0.8 * compute_ms * MS * computed),
                          compute_output_ns=int(0.1 * compute_ms * MS * computed), inference_count=computed,
                          execution_count=executions, cache_hits=hits, cache_misses=computed if hits else 0)


def target(found: EngineCounters | None, missing: tuple[str, ...] = ()) -> TargetInterval:
    return TargetInterval(found, ("s1",) if found is not None else (), missing)


def test_view_gives_means_per_request_and_the_batch_size() -> None:
    seen = view(counters(100, queue_ms=2.0, compute_ms=5.0, batch=4.0, fail=3))
    assert (seen.requests, seen.failures, seen.queue_ms, seen.compute_ms, seen.batch) == (103, 3, 2.0, 5.0, 4.0)
    assert seen.compute_infer_ms == pytest.approx(4.0)
    empty = view(EngineCounters())
    assert (empty.queue_ms, empty.compute_ms, empty.batch, empty.hit_share) == (None, None, None, 0.0)


def test_cache_hits_are_not_computed_and_their_share_is_counted() -> None:
    seen = view(counters(100, queue_ms=0.1, compute_ms=5.0, hits=80))
    assert seen.compute_ms == pytest.approx(5.0)  # per computed request: the hits' zero compute is not averaged in
    assert seen.hit_share == pytest.approx(0.8)


def test_without_cache_hits_drops_the_fastest_share_and_keeps_censored_latencies() -> None:
    sample = [0.0001, 0.0002, 0.005, 0.006, -0.5, 0.0001, 0.007, 0.0003]
    kept = without_cache_hits(sample, 3 / 7)
    assert sorted(kept) == sorted([0.0003, 0.005, 0.006, 0.007, -0.5])
    assert without_cache_hits(sample, 0.0) == sample
    assert without_cache_hits([0.1], 1.0) == []


def test_median_ignores_censored_latencies() -> None:
    assert median_ms([0.001, 0.003, -5.0]) == pytest.approx(2.0)
    assert median_ms([-1.0]) is None


@pytest.mark.parametrize(("canary", "reference", "observed", "cause"), [
    ((5.0, 1.0), (1.0, 1.0), 4.0, QUEUE),  # the same compute waits longer: capacity
    ((1.0, 4.0), (1.0, 1.0), 3.0, COMPUTE),
    ((40.0, 20.0), (1.0, 1.0), 58.0, COMPUTE),  # slower compute queues more too: the cause is compute
    ((27.0, 0.6), (0.5, 0.1), 27.0, QUEUE),  # a batcher waiting for batches: bigger batches compute a bit longer
    ((1.0, 1.0), (1.0, 1.0), 3.0, OUTSIDE),  # Triton saw no difference: the network, the gateway or a client
    ((1.0, 1.1), (1.0, 1.0), 0.1, None),  # within the 20% floor
    ((1.0, 1.0), (1.0, 1.0), None, None),
])
def test_latency_cause(canary: tuple[float, float], reference: tuple[float, float], observed: float | None,
                       cause: str | None) -> None:
    mine, theirs = view(counters(100, *canary)), view(counters(100, *reference))
    assert latency_cause(mine, theirs, observed, floor=0.2) == cause


def test_attribution_names_the_queue_in_words() -> None:
    canary, stable = [0.0041] * 50, [0.001] * 50
    found = attribute(target(counters(50, queue_ms=3.0, compute_ms=1.0, batch=1.0)),
                      target(counters(500, queue_ms=0.1, compute_ms=0.9, batch=3.8)), canary, stable, 0.2)
    assert found.cause == QUEUE
    assert found.observed_ms == pytest.approx(3.1)
    assert found.queue_ms == pytest.approx(2.9) and found.compute_ms == pytest.approx(0.1)
    assert found.summary.startswith("canary +3.10 ms median vs stable: queue +2.90 ms, compute +0.10 ms, "
                                    "batch 1.0 vs 3.8 (the difference is in the queue)")


def test_attribution_of_a_slow_reader_is_outside_triton() -> None:
    """A client reading its answers slowly makes the gateway's latency longer, never Triton's:
    the difference can only be put outside Triton."""
    found = attribute(target(counters(50, 0.1, 1.0)), target(counters(500, 0.1, 1.0)),
                      [0.0061] * 50, [0.0011] * 50, 0.2)
    assert found.cause == OUTSIDE and "outside Triton +5.00 ms" in found.summary


def test_attribution_counts_cache_hits_apart() -> None:
    found = attribute(target(counters(100, 0.1, 5.0, hits=10)), target(counters(100, 0.1, 5.0, hits=80)),
                      [0.0052] * 90, [0.0051] * 20, 0.2)
    assert "cache hits (not in latency): canary 10% of 100, stable 80% of 100" in found.summary
    assert found.cause is None


def test_attribution_says_when_triton_cannot_be_read() -> None:
    found = attribute(target(None, ("s1: no answer to /v2/models/qc/stats within 2s",)),
                      target(counters(10, 0.1, 1.0)), [0.002] * 10, [0.001] * 10, 0.2, errors="canary errors x")
    assert found.canary is None and found.cause is None
    assert found.summary == ("canary +1.00 ms median; Triton's statistics unreadable (s1: no answer to "
                             "/v2/models/qc/stats within 2s): judged on the gateway's view only")
    assert found.errors == "canary errors x"
    assert found.unreadable == ("s1: no answer to /v2/models/qc/stats within 2s",)
    assert found.document()["unreadable"] == list(found.unreadable)


def test_partial_attribution_names_the_missing_server() -> None:
    found = attribute(TargetInterval(counters(10, 2.0, 1.0), ("s1",), ("s2: refused",)),
                      target(counters(10, 0.1, 1.0)), [0.003] * 10, [0.001] * 10, 0.2)
    assert found.cause == QUEUE and found.summary.endswith("statistics missing from s2: refused")


def test_error_words_in_tritons_terms() -> None:
    assert error_words(ErrorClasses(), "stable", ErrorClasses()) is None
    assert error_words(ErrorClasses(rejected=30), "stable", ErrorClasses(rejected=1)) == (
        "canary errors are REJECTED (its queue full or timed out: capacity), not BACKEND (30 vs stable 1)")
    assert error_words(ErrorClasses(backend=7), "baseline", ErrorClasses()) == (
        "canary errors are BACKEND (the model failed), not REJECTED (7 vs baseline 0)")
    assert error_words(ErrorClasses(3, 4), "stable", ErrorClasses(1, 0)) == (
        "canary errors: 3 REJECTED (capacity), 4 BACKEND (the model); stable 1 and 0")


def test_error_classes_come_from_the_intervals_client_counts_when_kept() -> None:
    """The window of a 1.5 s interval spans one whole second (the recorder's slots): the per-client
    counts since the last interval are exact, and what the words are taken from when kept."""
    from gateway.rollout.engine import error_classes
    from gateway.telemetry.recorder import LATENCY_BOUNDS, Window

    window = Window("qc", "3", 1.0, 10, 0, 0, (0,) * (len(LATENCY_BOUNDS) + 1), rejected=0)
    clients = {"a": (50, 9, 1, 2), "b": (20, 1, 0, 0), "old": (5, 1, 0)}
    assert error_classes(window, clients) == ErrorClasses(rejected=2, backend=11)
    assert error_classes(window, None) == ErrorClasses(rejected=0, backend=0)
    assert error_classes(None, None) is None
