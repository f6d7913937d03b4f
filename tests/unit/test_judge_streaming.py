"""The streaming metrics of the statistical judge: time to first response and the gap between
responses, judged like latency, and out of the verdict when nothing streams."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from rich.console import Console

from gateway.ctl.views import rollout_view
from gateway.rollout import steps
from gateway.rollout.analysis import Outcome, Verdict
from gateway.rollout.judge import CEILING, METRICS, Evidence, VersionSample, assess
from gateway.rollout.spec import RolloutSpec

SPEC = RolloutSpec(canary="2", stable="1", interval_s=30, latency_warmup_s=0)


def sample(n: int, median_s: float, seed: int) -> list[float]:
    return [float(v) for v in np.random.default_rng(seed).lognormal(math.log(median_s), 0.35, n)]


def versions(first_factor: float = 1.0, gap_factor: float = 1.0, seed: int = 0,
             streams: bool = True) -> tuple[VersionSample, VersionSample]:
    """One interval of a streaming model: 200 canary and 2000 stable requests, each with a
    whole-stream latency, a first response and (4 tokens) three gaps."""
    def version(n: int, first: float, gap: float, offset: int) -> VersionSample:
        return VersionSample(n, 0, 0, 0, sample(n, 0.05, seed + offset),
                             sample(n, 0.004 * first, seed + offset + 1) if streams else (),
                             sample(3 * n, 0.015 * gap, seed + offset + 2) if streams else ())
    return version(200, first_factor, gap_factor, 10), version(2000, 1.0, 1.0, 20)


def judged(spec: RolloutSpec, canary: VersionSample, stable: VersionSample,
           intervals: int = 3) -> list[tuple[Verdict, Evidence]]:
    evidence, verdicts = Evidence(), []
    for _ in range(intervals):
        verdict, evidence = assess(spec, evidence, canary, stable)
        verdicts.append((verdict, evidence))
    return verdicts


def test_a_slower_first_response_fails_on_time_to_first_response_alone() -> None:
    verdict, _ = judged(SPEC, *versions(first_factor=5.0))[0]
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "time_to_first_response"
    metrics = {m.name: m for m in verdict.metrics}
    assert metrics["time_to_first_response"].verdict == "fail"
    assert metrics["time_to_first_response"].effect is not None and metrics["time_to_first_response"].effect > 3
    assert "time to first response worse" in verdict.reason
    assert metrics["response_gap"].verdict == "pass" and metrics["latency"].verdict == "pass"


def test_slower_gaps_between_responses_fail_on_response_gap() -> None:
    verdict, _ = judged(SPEC, *versions(gap_factor=1.5))[0]
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "response_gap"
    assert "gap between responses worse" in verdict.reason
    assert {m.name: m.verdict for m in verdict.metrics}["time_to_first_response"] == "pass"


def test_equal_streams_pass_every_metric_and_the_budget_is_split_over_every_test() -> None:
    verdict, evidence = judged(SPEC, *versions())[-1]
    assert verdict.outcome is Outcome.HEALTHY, verdict.reason
    assert [m.name for m in verdict.metrics] == [*METRICS, "time_to_first_response", "response_gap", CEILING]
    assert all(m.verdict == "pass" for m in verdict.metrics)
    assert all(m.e_threshold == pytest.approx(7 / SPEC.false_rollback_rate) for m in verdict.metrics)
    assert evidence.first_response.canary_n == 600 and evidence.response_gap.stable_n > 0


def test_a_stream_metric_without_samples_stays_out_of_the_verdict() -> None:
    canary, stable = versions()
    verdict, _ = judged(SPEC, dataclasses.replace(canary, response_gaps=()),
                        dataclasses.replace(stable, response_gaps=()))[-1]
    assert [m.name for m in verdict.metrics] == [*METRICS, "time_to_first_response", CEILING]
    # the budget was fixed at the start over every test that can run: not re-split by what streamed
    assert verdict.outcome is Outcome.HEALTHY
    assert verdict.metrics[0].e_threshold == pytest.approx(7 / SPEC.false_rollback_rate)


def test_a_non_streaming_rollout_is_judged_exactly_as_before() -> None:
    """Four metrics and the ceiling, alpha split over every test the spec allows (seven), and the
    same verdicts whether the evidence is new or read back from a document stored before the
    streaming metrics existed."""
    plain = versions(streams=False)
    new = judged(SPEC, *plain)
    assert all([m.name for m in v.metrics] == [*METRICS, CEILING] for v, _ in new)
    assert all(m.e_threshold == pytest.approx(7 / SPEC.false_rollback_rate) for m in new[-1][0].metrics)
    assert new[-1][0].outcome is Outcome.HEALTHY
    old_doc = new[0][1].document()
    for key in ("first_response", "response_gap", "first_responses_seen", "response_gaps_seen"):
        del old_doc[key]
    verdict, evidence = assess(SPEC, Evidence.from_document(old_doc), *plain)
    assert verdict == new[1][0] and evidence == new[1][1]
    slow = dataclasses.replace(plain[0], latencies=[3 * v for v in plain[0].latencies])
    verdict, _ = assess(SPEC, Evidence(), slow, plain[1])
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "latency"


def test_streaming_evidence_survives_its_document() -> None:
    _, evidence = judged(SPEC, *versions(first_factor=1.1), intervals=2)[-1]
    assert Evidence.from_document(evidence.document()) == evidence
    assert evidence.first_responses_seen == 2 * (200 + 2000)


def test_streaming_samples_in_the_warm_up_are_shown_but_not_judged() -> None:
    spec = RolloutSpec(canary="2", stable="1", interval_s=30, latency_warmup_s=60)
    verdict, evidence = assess(spec, Evidence(), *versions(first_factor=5.0))
    metrics = {m.name: m for m in verdict.metrics}
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert metrics["time_to_first_response"].verdict == "inconclusive"
    assert "not judged in the rollout's first 60 s" in metrics["time_to_first_response"].summary
    assert evidence.first_response.canary_n == 0 and evidence.first_responses_seen > 0


def test_a_few_stream_samples_hold_the_verdict_until_there_are_enough() -> None:
    canary, stable = versions()
    few = dataclasses.replace(canary, first_responses=canary.first_responses[:4], response_gaps=())
    verdict, evidence = assess(SPEC, Evidence(), few, dataclasses.replace(stable, response_gaps=()))
    metric = {m.name: m for m in verdict.metrics}["time_to_first_response"]
    assert metric.verdict == "inconclusive" and "fewer than 10 samples" in metric.summary
    assert verdict.outcome is Outcome.INCONCLUSIVE and len(evidence.first_response.carry_canary) == 4


def test_ctl_rollout_status_shows_the_streaming_metrics_in_words() -> None:
    verdict, evidence = judged(SPEC, *versions(first_factor=5.0), intervals=1)[0]
    rollout = steps.on_verdict(steps.begin("tok", SPEC, "1", now=0), verdict, 30, evidence.document())
    console = Console(record=True, width=240)
    console.print(rollout_view(rollout.document()))
    shown = " ".join(console.export_text().split())
    assert "FAIL time to first response worse: canary median +" in shown
    assert "PASS gap between responses fine:" in shown
