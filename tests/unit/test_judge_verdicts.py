"""The statistical judge's verdicts: properties, evidence over a rollout, and the bench smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.rollout import steps
from gateway.rollout.analysis import Outcome, Verdict
from gateway.rollout.judge import Evidence, VersionSample, assess
from gateway.rollout.phases import Phase
from gateway.rollout.spec import RolloutSpec

SPEC = RolloutSpec(canary="3", stable="2", steps=[1, 5, 20, 50, 100], interval_s=30, latency_warmup_s=0)
ROOT = Path(__file__).resolve().parents[2]


def latencies(n: int, median_s: float = 0.0006, seed: int = 0) -> list[float]:
    return [float(v) for v in np.random.default_rng(seed).lognormal(math.log(median_s), 0.35, n)]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 400), st.integers(1, 40), st.integers(0, 20), st.integers(0, 20), st.integers(1, 4))
def test_a_canary_identical_to_the_stable_never_fails(requests: int, scale: int, errors: int, client_errors: int,
                                                       intervals: int) -> None:
    """Same rates (the stable with ``scale`` times the traffic) and the same latencies. (The
    absolute error ceiling is off here: it fails a canary at 100% errors however the stable fares.)"""
    errors, client_errors = min(errors, requests), min(client_errors, requests - min(errors, requests))
    lat = latencies(min(requests, 300))
    canary = VersionSample(requests, errors, client_errors, 0, lat)
    stable = VersionSample(requests * scale, errors * scale, client_errors * scale, 0, lat * 3)
    evidence = Evidence()
    spec = SPEC.model_copy(update={"max_error_rate": 1.0})
    for _ in range(intervals):
        verdict, evidence = assess(spec, evidence, canary, stable)
        assert verdict.outcome is not Outcome.UNHEALTHY
        assert all(m.verdict != "fail" for m in verdict.metrics)


@pytest.mark.parametrize(("canary", "metric"), [
    (VersionSample(1000, 500, 0, 0, latencies(500)), "error_rate"),
    (VersionSample(1000, 5, 300, 0, latencies(695)), "client_error_rate"),
    (VersionSample(1000, 5, 0, 0, latencies(995, median_s=0.0012, seed=1)), "latency"),
])
def test_a_clearly_worse_canary_fails(canary: VersionSample, metric: str) -> None:
    stable = VersionSample(20_000, 100, 0, 0, latencies(1024, seed=2))
    verdict, _ = assess(SPEC, Evidence(), canary, stable)
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == metric
    failed = next(m for m in verdict.metrics if m.name == metric)
    assert failed.verdict == "fail" and failed.e_value >= failed.e_threshold
    assert failed.effect is not None and failed.effect > failed.floor and failed.low is not None
    assert "worse" in verdict.reason


def test_a_tiny_sample_is_inconclusive_and_says_how_many_requests_a_decision_needs() -> None:
    verdict, _ = assess(SPEC, Evidence(), VersionSample(12, 0, 0, 0, latencies(12)),
                        VersionSample(1200, 6, 0, 0, latencies(1024, seed=3)))
    assert verdict.outcome is Outcome.INCONCLUSIVE
    waiting = [m for m in verdict.metrics if m.verdict == "inconclusive"]
    assert {m.name for m in waiting} >= {"error_rate", "client_error_rate"}
    for metric in waiting:
        assert metric.requests_needed is not None and metric.requests_needed > 0
        assert f"about {metric.requests_needed} more canary requests" in metric.summary


def test_enough_healthy_traffic_passes_every_metric() -> None:
    verdict, _ = assess(SPEC, Evidence(), VersionSample(3000, 15, 0, 0, latencies(1024, seed=4)),
                        VersionSample(30_000, 150, 0, 0, latencies(1024, seed=5)))
    assert verdict.outcome is Outcome.HEALTHY
    assert all(m.verdict == "pass" and m.requests_needed is None for m in verdict.metrics)


def test_one_healthy_interval_does_not_erase_earlier_failures() -> None:
    stable = VersionSample(6000, 30, 0, 0, latencies(1024, seed=6))
    verdict, evidence = assess(SPEC, Evidence(), VersionSample(300, 30, 0, 0, latencies(270)), stable)
    assert verdict.outcome is Outcome.UNHEALTHY
    verdict, evidence = assess(SPEC, evidence, VersionSample(300, 0, 0, 0, latencies(300, seed=7)), stable)
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "error_rate"
    assert evidence.errors.canary_n == 600 and evidence.intervals == 2


def test_evidence_survives_the_store_as_json() -> None:
    _, evidence = assess(SPEC, Evidence(), VersionSample(60, 1, 2, 3, latencies(57)),
                         VersionSample(5940, 30, 0, 4, latencies(1024, seed=8)))
    assert Evidence.from_document(json.loads(json.dumps(evidence.document()))) == evidence
    assert Evidence.from_document({}) == Evidence()


def test_overload_answers_are_shown_and_never_judged() -> None:
    verdict, evidence = assess(SPEC, Evidence(), VersionSample(3000, 15, 0, 2000, latencies(1024, seed=9)),
                               VersionSample(30_000, 150, 0, 10, latencies(1024, seed=10)))
    assert verdict.outcome is Outcome.HEALTHY
    assert "overload answers (not judged): canary 2000, stable 10" in verdict.reason
    assert evidence.canary_overloads == 2000


def test_no_canary_traffic_this_interval_is_inconclusive_even_with_passing_evidence() -> None:
    _, evidence = assess(SPEC, Evidence(), VersionSample(3000, 15, 0, 0, latencies(1024, seed=11)),
                         VersionSample(30_000, 150, 0, 0, latencies(1024, seed=12)))
    verdict, _ = assess(SPEC, evidence, VersionSample(0), VersionSample(6000, 30, 0, 0, latencies(1024)))
    assert verdict.outcome is Outcome.INCONCLUSIVE and "no canary requests" in verdict.reason


def test_inconclusive_limit_pauses_the_rollout_with_the_reason() -> None:
    spec = SPEC.model_copy(update={"inconclusive_limit": 3})
    rollout = steps.begin("qc", spec, "2", now=0)
    evidence = Evidence()
    for i in range(3):
        verdict, evidence = assess(spec, evidence, VersionSample(5, 0, 0, 0, latencies(5)),
                                   VersionSample(500, 2, 0, 0, latencies(500)))
        rollout = steps.on_verdict(rollout, verdict, 30.0 * (i + 1), evidence.document())
    assert rollout.phase is Phase.PAUSED and "3 inconclusive intervals in a row" in rollout.reason
    assert "more canary requests needed" in rollout.reason
    assert Evidence.from_document(rollout.evidence) == evidence
    assert steps.Rollout.from_document(rollout.document()) == rollout


def test_a_check_that_alternates_error_and_ok_cannot_keep_an_undecided_rollout_going_for_ever() -> None:
    """ERROR (a check without a value) and INCONCLUSIVE (the judge undecided) used to reset each
    other's count, so neither error_limit nor inconclusive_limit was ever reached."""
    spec = SPEC.model_copy(update={"inconclusive_limit": 4, "error_limit": 3})
    rollout = steps.begin("qc", spec, "2", now=0)
    unreadable = Verdict(Outcome.ERROR, "check 'conversion': no value")
    undecided = Verdict(Outcome.INCONCLUSIVE, "latency undecided")
    for i, verdict in enumerate([unreadable, undecided, unreadable, undecided]):
        assert rollout.phase is Phase.PROGRESSING, (i, rollout.reason)
        rollout = steps.on_verdict(rollout, verdict, 30.0 * (i + 1))
    assert rollout.phase is Phase.PAUSED and "4 inconclusive intervals in a row" in rollout.reason
    healthy_again = steps.on_verdict(steps.on_command(rollout, "resume", 200, "sre"), undecided, 230)
    assert healthy_again.phase is Phase.PROGRESSING and healthy_again.consecutive_inconclusive == 1


def test_an_error_limit_pause_and_a_resume_start_the_inconclusive_count_again() -> None:
    """25 undecided intervals, then Prometheus down for 3: paused for the errors. Once the SRE
    fixed it and resumed, the rollout gets inconclusive_limit intervals again, not 2."""
    rollout = steps.begin("qc", SPEC, "2", now=0)
    for i in range(25):
        rollout = steps.on_verdict(rollout, Verdict(Outcome.INCONCLUSIVE, "undecided"), 30.0 * (i + 1))
    for i in range(3):
        rollout = steps.on_verdict(rollout, Verdict(Outcome.ERROR, "prometheus down"), 1000.0 + i)
    assert rollout.phase is Phase.PAUSED and "metrics unreadable for 3 intervals" in rollout.reason
    rollout = steps.on_command(rollout, "resume", 2000, "sre")
    for i in range(SPEC.inconclusive_limit - 1):
        rollout = steps.on_verdict(rollout, Verdict(Outcome.INCONCLUSIVE, "undecided"), 2000.0 + 30 * (i + 1))
    assert rollout.phase is Phase.PROGRESSING, rollout.reason


def test_bench_smoke_run_prints_the_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    module_spec = importlib.util.spec_from_file_location("bench_judge", ROOT / "bench" / "judge.py")
    assert module_spec is not None and module_spec.loader is not None
    bench = importlib.util.module_from_spec(module_spec)
    monkeypatch.setitem(sys.modules, "bench_judge", bench)  # dataclasses look their module up there
    module_spec.loader.exec_module(bench)
    assert bench.main(["--runs", "2", "--scenario", "4xx", "--rps", "400", "--max-intervals", "20"]) == 0
    out = capsys.readouterr().out
    assert "| statistical | 2% vs 0% 4xx | 2 |" in out and "| thresholds | 2% vs 0% 4xx | 2 |" in out


def test_a_canary_with_few_requests_per_interval_still_gathers_latency_evidence() -> None:
    """4 canary requests per interval: too few alone, judged together across intervals."""
    evidence = Evidence()
    for interval in range(3):
        verdict, evidence = assess(SPEC, evidence, VersionSample(4, 0, 0, 0, latencies(4, seed=interval)),
                                   VersionSample(400, 0, 0, 0, latencies(400, seed=100 + interval)))
        latency = next(m for m in verdict.metrics if m.name == "latency")
        if interval < 2:
            assert latency.verdict == "inconclusive" and latency.requests_needed == 10 - 4 * (interval + 1)
            assert Evidence.from_document(json.loads(json.dumps(evidence.document()))) == evidence  # with carry
    assert evidence.latency.canary_n == 12 and evidence.latency.carry_canary == ()
    assert Evidence.from_document(json.loads(json.dumps(evidence.document()))) == evidence


def test_latency_is_not_judged_while_the_canary_warms_up() -> None:
    """The default warm-up (30 s) skips the first 30 s interval's latencies, even a 2x slower canary's."""
    spec = SPEC.model_copy(update={"latency_warmup_s": 30.0})
    slow, stable = VersionSample(1000, 5, 0, 0, latencies(995, median_s=0.0012)), VersionSample(
        20_000, 100, 0, 0, latencies(1024, seed=2))
    verdict, evidence = assess(spec, Evidence(), slow, stable)
    latency = next(m for m in verdict.metrics if m.name == "latency")
    assert latency.verdict == "inconclusive" and "first 30 s" in latency.summary and evidence.latency.weight == 0
    verdict, evidence = assess(spec, evidence, slow, stable)
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "latency"
