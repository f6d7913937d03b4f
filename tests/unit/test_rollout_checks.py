"""Custom PromQL checks and the shadow agreement gate: validation, placeholders, every shape of
a Prometheus answer, the binomial bounds, and how both fold into either judge's verdict."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from rich.console import Console
from scipy import stats as scipy_stats

from gateway.ctl.views import rollout_view
from gateway.devtools.local_triton import free_port
from gateway.rollout import steps
from gateway.rollout.analysis import Outcome, Verdict, judge
from gateway.rollout.check_spec import Check, promql_string, render
from gateway.rollout.checks import (
    MIN_COMPARISONS,
    CheckError,
    Checks,
    _decide,
    agreement_bounds,
    check_verdict,
    read_value,
    shadow_verdict,
)
from gateway.rollout.judge import Evidence, VersionSample, assess, fold
from gateway.rollout.spec import RolloutSpec
from gateway.settings import Settings, SettingsError
from gateway.telemetry.recorder import ShadowStats, Window

CHECK = {"name": "orders", "query": 'sum(rate(orders_total{version="{canary}"}[{interval}]))', "min": 1}


def spec(**values: Any) -> RolloutSpec:
    return RolloutSpec.model_validate({"canary": "3", "stable": "2", **values})


@pytest.mark.parametrize(("checks", "message"), [
    ([{**CHECK, "min": None}], "needs a limit: max, min or both"),
    ([{**CHECK, "min": 5, "max": 1}], "min 5 is above max 1"),
    ([CHECK, {**CHECK, "max": 3}], "check names must be unique: orders repeated"),
    ([{**CHECK, "name": f"c{i}"} for i in range(11)], "at most 10 items"),
    ([{**CHECK, "query": ""}], "at least 1 character"),
    ([{**CHECK, "query": "   "}], "the query is blank"),
    ([{**CHECK, "query": "x" * 4097}], "at most 4096 characters"),
    ([{**CHECK, "name": "bad name"}], "should match pattern"),
    ([{**CHECK, "name": "-x"}], "should match pattern"),
    ([{**CHECK, "query": 'up{job="{modle}"}'}], "unknown placeholder {modle}"),
    ([{**CHECK, "max": math.inf}], "finite number"),
    ([{**CHECK, "limit": 3}], "Extra inputs are not permitted"),
])
def test_bad_checks_are_refused(checks: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(checks=checks)


@pytest.mark.parametrize("value", [-0.1, 1.01, "high"])
def test_min_shadow_agreement_is_a_share(value: object) -> None:
    with pytest.raises(ValidationError, match="min_shadow_agreement"):
        spec(min_shadow_agreement=value)


def test_a_band_and_the_limits_are_kept() -> None:
    band = spec(checks=[{**CHECK, "min": 1, "max": 5}], min_shadow_agreement=0.99)
    check = band.checks[0]
    assert (check.min, check.max, band.min_shadow_agreement) == (1, 5, 0.99)
    assert [check.breached(v) for v in (0.5, 1, 3, 5, 5.5)] == [True, False, False, False, True]
    assert check.limit_words() == "between 1 and 5"
    assert RolloutSpec.model_validate(band.document()) == band  # stored and read back


def test_placeholders_are_escaped_for_a_promql_string_and_never_rescanned() -> None:
    assert promql_string('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    query = 'x{model="{model}",version="{canary}"} / x{version="{stable}"}[{interval}] {job="keep"}'
    assert render(query, 'q"c', "{stable}", "2", 29.2) == \
        'x{model="q\\"c",version="{stable}"} / x{version="2"}[30s] {job="keep"}'
    assert render("[{interval}]", "m", "3", "2", 0.2) == "[1s]"


@pytest.mark.parametrize(("body", "value"), [
    ({"status": "success", "data": {"resultType": "scalar", "result": [1.5, "0.25"]}}, 0.25),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1.5, "7"]}]}}, 7.0),
    ({"status": "success", "data": {"resultType": "vector",
                                    "result": [{"metric": {"a": "b"}, "value": [1.5, "-3e2"]}]}}, -300.0),
])
def test_one_number_is_read(body: dict[str, Any], value: float) -> None:
    assert read_value(body) == value


@pytest.mark.parametrize(("body", "why"), [
    ({"status": "success", "data": {"resultType": "vector", "result": []}}, "no data"),
    ({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"v": "2"}, "value": [1, "1"]}, {"metric": {"v": "3"}, "value": [1, "2"]}]}}, "2 series, needs one"),
    ({"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}}, "the value is nan"),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "+Inf"]}]}},
     "the value is inf"),
    ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "a matrix result"),
    ({"status": "success", "data": {"resultType": "string", "result": [1, "x"]}}, "a string result"),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}}, "unreadable vector"),
    ({"status": "success", "data": {"resultType": "scalar", "result": [1, "lots"]}}, "unreadable scalar"),
    ({"status": "success", "data": {"resultType": "vector"}}, "without a result"),
    ({"status": "error", "errorType": "bad_data", "error": "parse error"}, r"query failed \(bad_data\): parse error"),
    (["not", "an", "answer"], "not a query result"),
    ({"status": "success", "data": [1]}, "without a query result"),  # raised AttributeError, stopping every tick
    ({"status": "success", "data": "x"}, "without a query result"),
    ({"status": "success", "data": {"resultType": "vector", "result": 7}}, "unreadable vector"),
])
def test_anything_but_one_finite_number_is_no_value(body: Any, why: str) -> None:
    with pytest.raises(CheckError, match=why):
        read_value(body)


def test_a_check_fails_only_past_its_limit_and_says_which() -> None:
    check = Check(name="p95", query="q", max=0.5, min=0.1)
    assert [check_verdict(check, v).verdict for v in (0.05, 0.1, 0.5, 0.51)] == ["fail", "pass", "pass", "fail"]
    low, high = check_verdict(check, 0.05), check_verdict(check, 0.51)
    assert (low.name, low.effect, low.floor, high.floor) == ("check:p95", 0.05, 0.1, 0.5)
    assert high.summary == "check p95 failed: 0.51, limit between 0.1 and 0.5"
    missing = check_verdict(check, None, "no data")
    assert (missing.verdict, missing.effect) == ("error", None) and "no value (no data)" in missing.summary


def test_prometheus_unreachable_is_no_value_never_a_failure() -> None:
    checks = Checks(f"http://127.0.0.1:{free_port()}", 10.0)  # nothing listens: refused at once (10 s: load)
    results = asyncio.run(checks.evaluate("qc", spec(checks=[CHECK]), "2"))
    assert [(m.name, m.verdict) for m in results] == [("check:orders", "error")]
    assert "did not answer" in results[0].summary and "ConnectError" in results[0].summary


def test_a_prometheus_that_never_answers_is_no_value_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        checks = Checks(f"http://127.0.0.1:{silent.getsockname()[1]}", 1.0)
        started = time.monotonic()
        three = [CHECK, {**CHECK, "name": "other"}, {**CHECK, "name": "third"}]
        results = asyncio.run(checks.evaluate("qc", spec(checks=three), "2"))
        elapsed = time.monotonic() - started
    assert [m.verdict for m in results] == ["error", "error", "error"]
    assert all("did not answer" in m.summary and "Timeout" in m.summary for m in results), results
    # asked one after another, three 1 s timeouts take 3 s at least; together, about 1 s (the rest
    # is room for a loaded machine: the old 0.3 s timeouts under a 1.5 s bound could not tell)
    assert elapsed < 3.0, "the checks are asked together, each within the timeout"


def test_checks_without_prometheus_are_refused_at_start() -> None:
    assert Checks(None, 1.0).refusal(spec(checks=[CHECK])) == (
        "the rollout has checks but the gateway has no prometheus_url to evaluate them (set GATEWAY_PROMETHEUS_URL)")
    assert Checks(None, 1.0).refusal(spec(min_shadow_agreement=0.9)) is None
    assert Checks("http://prometheus:9090", 1.0).refusal(spec(checks=[CHECK])) is None


def test_metrics_source_prometheus_needs_a_url() -> None:
    with pytest.raises(SettingsError, match="metrics_source prometheus needs prometheus_url"):
        Settings.load(None, metrics_source="prometheus")
    assert Settings.load(None).prometheus_url is None
    assert Settings.load(None, metrics_source="prometheus", prometheus_url="http://p:9090").prometheus_url


def test_the_agreement_bounds_are_clopper_pearsons() -> None:
    """Each one-sided bound at 97.5% is one end of scipy's exact two-sided 95% interval."""
    for agreed, compared in ((0, 20), (7, 20), (19, 20), (20, 20), (480, 500)):
        exact = scipy_stats.binomtest(agreed, compared).proportion_ci(0.95, method="exact")
        low, high = agreement_bounds(agreed, compared, 0.975)
        assert (low, high) == pytest.approx((exact.low, exact.high), abs=1e-9)


def stats(agreed: int, compared: int) -> ShadowStats:
    return ShadowStats(requests=compared, compared=compared, agreed=agreed)


@pytest.mark.parametrize(("agreed", "compared", "verdict"), [
    (5, 5, "inconclusive"),  # below MIN_COMPARISONS, whatever the share
    (0, MIN_COMPARISONS - 1, "inconclusive"),
    (0, MIN_COMPARISONS, "fail"),  # the upper bound is far below 0.9
    (75, 100, "fail"),  # anytime-valid evidence past 1/alpha (alpha: the gate's share of the budget)
    (80, 100, "inconclusive"),  # a fixed-sample 99% bound (~0.88) failed it; looked at every interval, not yet
    (88, 100, "inconclusive"),  # 0.88 raw, but the bound cannot tell at 100
    (92, 100, "inconclusive"),  # 0.92 raw, lower bound ~0.86: not yet a pass
    (100, 100, "pass"),  # lower 95% bound ~0.971
    (970, 1000, "pass"),
])
def test_the_shadow_gate_judges_the_bound_not_the_raw_share(agreed: int, compared: int, verdict: str) -> None:
    result = shadow_verdict(spec(min_shadow_agreement=0.9), "3", stats(agreed, compared), shadowed=True)
    assert result.verdict == verdict, result.summary
    assert result.effect == agreed / compared and result.floor == 0.9
    if verdict == "inconclusive" and compared >= MIN_COMPARISONS:
        assert result.requests_needed and f"about {result.requests_needed} more comparisons" in result.summary


def test_the_shadow_gate_needs_a_shadow_of_the_canary() -> None:
    gate = spec(min_shadow_agreement=0.9)
    absent = shadow_verdict(gate, "3", None, shadowed=False)
    assert absent.verdict == "not_judged" and "not judged, version 3 is not the model's shadow" in absent.summary
    waiting = shadow_verdict(gate, "3", ShadowStats(), shadowed=True)
    assert waiting.verdict == "inconclusive" and "no compared responses yet" in waiting.summary
    exact = spec(min_shadow_agreement=1)  # no bound ever reaches 1: all must agree
    assert shadow_verdict(exact, "3", stats(200, 200), True).verdict == "pass"
    assert shadow_verdict(exact, "3", stats(199, 200), True).verdict == "fail"
    checks = Checks(None, 1.0, {("qc", "3"): stats(0, 50)}, lambda model: None)
    result = asyncio.run(checks.evaluate("qc", gate, "2"))  # shadowed before, not now: judged on what it did
    assert [(m.name, m.verdict) for m in result] == [("shadow_agreement", "fail")]


def healthy() -> Verdict:
    return Verdict(Outcome.HEALTHY, "within every threshold", canary_requests=100)


PASS, FAIL = check_verdict(Check(name="a", query="q", max=1), 0.5), check_verdict(Check(name="b", query="q", max=1), 2)
ERROR = check_verdict(Check(name="c", query="q", max=1), None, "no data")
WAIT = shadow_verdict(spec(min_shadow_agreement=0.9), "3", stats(3, 3), True)
SKIP = shadow_verdict(spec(min_shadow_agreement=0.9), "3", None, False)


@pytest.mark.parametrize(("own", "extra", "outcome"), [
    (Outcome.HEALTHY, (PASS, SKIP), Outcome.HEALTHY),
    (Outcome.HEALTHY, (PASS, WAIT), Outcome.INCONCLUSIVE),
    (Outcome.HEALTHY, (WAIT, ERROR), Outcome.ERROR),
    (Outcome.HEALTHY, (ERROR, FAIL), Outcome.UNHEALTHY),
    (Outcome.INCONCLUSIVE, (ERROR,), Outcome.ERROR),  # or an error would never count against error_limit
    (Outcome.INCONCLUSIVE, (FAIL,), Outcome.UNHEALTHY),
    (Outcome.ERROR, (PASS,), Outcome.ERROR),
    (Outcome.ERROR, (FAIL,), Outcome.UNHEALTHY),
    (Outcome.UNHEALTHY, (ERROR, WAIT), Outcome.UNHEALTHY),
])
def test_fold(own: Outcome, extra: tuple[Any, ...], outcome: Outcome) -> None:
    folded = fold(Verdict(own, "own reason", metric="error_rate" if own is Outcome.UNHEALTHY else None), extra)
    assert folded.outcome is outcome and folded.metrics == extra
    if outcome is Outcome.UNHEALTHY and own is not Outcome.UNHEALTHY:
        assert (folded.metric, folded.observed, folded.threshold) == ("check", 2, 1)
        assert folded.reason == "check b failed: 2, limit max 1"
    if own is Outcome.UNHEALTHY:
        assert folded.metric == "error_rate" and folded.reason == "own reason"


def test_a_failing_check_rolls_back_after_failure_limit_intervals_like_any_metric() -> None:
    gate = spec(judge="thresholds", failure_limit=2, checks=[{**CHECK, "name": "b"}])
    window = Window("qc", "3", 30, 100, 0, 0, (100,))
    rollout = steps.begin("qc", gate, "2", now=0)
    for now, phase in ((30, "progressing"), (60, "rolled_back")):
        rollout = steps.on_verdict(rollout, fold(judge(gate, window, window), (FAIL,)), now)
        assert rollout.phase.value == phase
    assert "check b failed: 2, limit max 1" in rollout.reason and "2 unhealthy intervals" in rollout.reason


def test_the_statistical_judge_folds_the_checks_in_and_keeps_its_evidence() -> None:
    gate = spec(latency_warmup_s=0)
    canary, stable = VersionSample(3000, 15, 0, 0, [0.001] * 500), VersionSample(30_000, 150, 0, 0, [0.001] * 500)
    plain, evidence = assess(gate, Evidence(), canary, stable)
    folded, same = assess(gate, Evidence(), canary, stable, (PASS, ERROR))
    assert plain.outcome is Outcome.HEALTHY and folded.outcome is Outcome.ERROR and same == evidence
    assert folded.metrics == (*plain.metrics, PASS, ERROR)


def test_rollout_status_shows_each_checks_name_value_limit_and_verdict() -> None:
    gate = spec(judge="thresholds", checks=[CHECK], min_shadow_agreement=0.9)
    verdict = fold(healthy(), (check_verdict(gate.checks[0], 0.25), ERROR, SKIP))
    doc = steps.on_verdict(steps.begin("qc", gate, "2", now=0), verdict, 30).document()
    console = Console(record=True, width=240)
    console.print(rollout_view(doc))
    shown = " ".join(console.export_text().split())
    assert "FAIL check orders failed: 0.25, limit min 1" in shown
    assert "ERROR check c: no value (no data), limit max 1" in shown
    assert "NOT_JUDGED shadow agreement: not judged, version 3 is not the model's shadow (min 90% set)" in shown


def test_the_shadow_gate_is_anytime_valid_over_sixty_looks() -> None:
    """An agreement rate exactly at the limit, looked at every interval (20 more comparisons a
    look, 60 looks): the gate ever fails at most alpha of the time. A fixed-sample
    Clopper-Pearson bound at 1 - alpha, repeated every look, failed ~1.2% of such paths (8x alpha)."""
    alpha, looks, paths = 0.01 / 7, 60, 5_000
    sizes = np.arange(1, looks + 1) * 20
    # at each look, the fewest agreements that do not fail (failing is monotone in agreements)
    least = np.array([_least_passing(int(n), alpha) for n in sizes])
    agreed = np.cumsum(np.random.default_rng(7).random((paths, looks * 20)) < 0.9, axis=1)[:, sizes - 1]
    ever_failed = float(np.mean((agreed < least).any(axis=1)))
    assert ever_failed <= alpha * 2, ever_failed  # 14 of 5,000 at most (expected <= 7; the old test ~60)


def _least_passing(n: int, alpha: float) -> int:
    low, high = 0, n  # _decide(high) does not fail
    while low < high:
        middle = (low + high) // 2
        if _decide(middle, n, 0.9, alpha) == "fail":
            low = middle + 1
        else:
            high = middle
    return low
