"""Two more gates on the verdict, each giving :class:`judge.MetricVerdict` results that
:func:`judge.fold` adds to either judge's verdict.

**Custom checks** (``checks: [{name, query, max | min}]``): each interval every query is
evaluated as one instant query against Prometheus (``prometheus_url``), its placeholders
replaced (:mod:`gateway.rollout.check_spec`). The answer must be one number: a scalar or a
one-element vector. A finite value past a limit FAILS the check: the verdict is UNHEALTHY and
the rollout rolls back after ``failure_limit`` such intervals in a row, like any metric (a
check is a threshold, not a test: ``failure_limit`` is what absorbs one noisy interval).
Anything else is no value at all, never a failure (Flagger's #1035 and #1689: a missing value
that rolls back is an outage the canary did not cause): an empty result, several series, NaN
or infinity (a ratio over zero requests), a query error, Prometheus down or slow. The check is
then an ``error``, and the verdict ERROR: after ``error_limit`` such intervals in a row the
rollout pauses, and says which check and why.

**Shadow agreement** (``min_shadow_agreement``): when the canary has been the model's shadow
(this process mirrored requests to it, before or during the rollout) its outputs were compared
with the primary's (:mod:`gateway.proxy.shadow`). The share that agreed must be at least the
limit. It is judged every interval on the comparisons so far, so it is anytime-valid, not a
fixed-sample test repeated: it FAILS when the e-process against "the disagreement rate is at
most 1 - limit" (:func:`stats.ceiling_log_e`, a one-sided mixture of Bernoulli likelihood
ratios) reaches 1/alpha, alpha being the gate's share of ``false_rollback_rate``
(:func:`judge.alpha_split`); it PASSES when the mirror e-process, against "the disagreement rate
is at least 1 - limit", reaches 20 (the one-sided 95% anytime-valid bound clears the limit),
and is INCONCLUSIVE in between or below MIN_COMPARISONS. Without a shadow of the canary it is
``not_judged`` and says so: it never blocks a rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from gateway.rollout import stats
from gateway.rollout.check_spec import Check, render
from gateway.rollout.judge import INTERVAL_CONFIDENCE, PASS_CONFIDENCE, MetricVerdict, alpha_split
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import ShadowStats

MIN_COMPARISONS = 20  # compared shadow responses below which the gate does not judge at all


class CheckError(Exception):
    """The check has no usable value this interval (not a failure)."""


def read_value(body: Any) -> float:
    """The single finite number in a Prometheus instant-query answer, or CheckError saying why not."""
    if not isinstance(body, dict):
        raise CheckError("prometheus answered something that is not a query result")
    if body.get("status") != "success":
        raise CheckError(f"query failed ({body.get('errorType', 'error')}): {body.get('error', body)}")
    data = body.get("data")
    if not isinstance(data, dict):
        raise CheckError("prometheus answered success without a query result")
    kind, result = data.get("resultType"), data.get("result")
    if result is None:
        raise CheckError(f"a {kind} answer without a result")
    try:
        if kind == "scalar":
            value = float(result[1])
        elif kind == "vector":
            if not result:
                raise CheckError("no data (the query returned no series)")
            if len(result) > 1:
                raise CheckError(f"{len(result)} series, needs one (aggregate them, e.g. with sum or max)")
            value = float(result[0]["value"][1])
        else:
            raise CheckError(f"a {kind} result, needs a scalar or a one-element vector")
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise CheckError(f"unreadable {kind} result: {exc!r}") from None
    if not math.isfinite(value):
        raise CheckError(f"the value is {value} (e.g. a ratio over zero requests)")
    return value


def check_verdict(check: Check, value: float | None, why: str = "") -> MetricVerdict:
    """A check's value (or why it has none) as a MetricVerdict. A check is no test: its
    e-value is 1 (no evidence) against a threshold of 1; ``effect`` is the value and
    ``floor`` the limit (the max when there are both)."""
    limit = check.max if check.max is not None else check.min
    assert limit is not None  # the spec requires one
    name = f"check:{check.name}"
    if value is None:
        return MetricVerdict(name, "error", None, None, None, limit, 1.0, 1.0, None, None,
                             f"check {check.name}: no value ({why}), limit {check.limit_words()}")
    if check.breached(value):
        floor = check.max if check.max is not None and value > check.max else limit
        floor = check.min if check.min is not None and value < check.min else floor
        return MetricVerdict(name, "fail", value, None, None, floor, 1.0, 1.0, None, None,
                             f"check {check.name} failed: {value:g}, limit {check.limit_words()}")
    return MetricVerdict(name, "pass", value, None, None, limit, 1.0, 1.0, None, None,
                         f"check {check.name} fine: {value:g}, limit {check.limit_words()}")


class Checks:
    """Evaluates a rollout's checks and shadow gate each interval (in the controller's tick)."""

    def __init__(self, prometheus_url: str | None, timeout_s: float,
                 shadow_stats: Mapping[tuple[str, str], ShadowStats] | None = None,
                 shadow_of: Callable[[str], str | None] = lambda model: None) -> None:
        self.prometheus_url = prometheus_url.rstrip("/") if prometheus_url else None
        self.timeout_s = timeout_s
        self.shadow_stats = shadow_stats if shadow_stats is not None else {}
        self.shadow_of = shadow_of  # the model's current shadow version, from the policy book

    def refusal(self, spec: RolloutSpec) -> str | None:
        """Why a rollout with this spec cannot start here, or None."""
        if spec.checks and self.prometheus_url is None:
            return ("the rollout has checks but the gateway has no prometheus_url to evaluate them "
                    "(set GATEWAY_PROMETHEUS_URL)")
        return None

    async def evaluate(self, model: str, spec: RolloutSpec, stable: str) -> tuple[MetricVerdict, ...]:
        results: list[MetricVerdict] = []
        if spec.checks:
            results.extend(await self._checks(model, spec, stable))
        if spec.min_shadow_agreement is not None:
            results.append(shadow_verdict(spec, spec.canary, self.shadow_stats.get((model, spec.canary)),
                                          self.shadow_of(model) == spec.canary))
        return tuple(results)

    async def _checks(self, model: str, spec: RolloutSpec, stable: str) -> list[MetricVerdict]:
        if self.prometheus_url is None:  # refused at start; a gateway restarted without it lands here
            return [check_verdict(check, None, "no prometheus_url configured") for check in spec.checks]
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            return list(await asyncio.gather(*(self._one(client, check, model, spec, stable)
                                               for check in spec.checks)))

    async def _one(self, client: httpx.AsyncClient, check: Check, model: str, spec: RolloutSpec,
                   stable: str) -> MetricVerdict:
        promql = render(check.query, model, spec.canary, stable, spec.interval_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                # POST: a query of a few KiB would not fit every proxy's URL limit
                response = await client.post(f"{self.prometheus_url}/api/v1/query", data={"query": promql})
            body = response.json()  # Prometheus answers errors (400, 422, 503) with the same JSON shape
        except (httpx.HTTPError, TimeoutError) as exc:
            return check_verdict(check, None, f"prometheus at {self.prometheus_url} did not answer: "
                                 f"{type(exc).__name__} {exc}".strip())
        except json.JSONDecodeError:
            return check_verdict(check, None, f"prometheus answered {response.status_code} without JSON")
        try:
            return check_verdict(check, read_value(body))
        except CheckError as exc:
            return check_verdict(check, None, str(exc))


def agreement_bounds(agreed: int, compared: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds at ``confidence`` (each side on its own)."""
    return stats.rate_lower(agreed, compared, confidence), stats.rate_upper(agreed, compared, confidence)


def shadow_verdict(spec: RolloutSpec, canary: str, counts: ShadowStats | None, shadowed: bool) -> MetricVerdict:
    """The shadow agreement gate on the canary's cumulative comparisons."""
    limit = spec.min_shadow_agreement
    assert limit is not None
    name = "shadow_agreement"
    if counts is None or counts.compared == 0:
        if shadowed:
            return MetricVerdict(name, "inconclusive", None, None, None, limit, 1.0, 1.0, None, MIN_COMPARISONS,
                                 f"shadow agreement: version {canary} is the shadow, no compared responses yet")
        return MetricVerdict(name, "not_judged", None, None, None, limit, 1.0, 1.0, None, None,
                             f"shadow agreement: not judged, version {canary} is not the model's shadow "
                             f"(min {limit:.0%} set)")
    agreed, compared = counts.agreed, counts.compared
    share = agreed / compared
    interval = agreement_bounds(agreed, compared, 0.5 + INTERVAL_CONFIDENCE / 2)
    seen = f"{agreed} of {compared} compared outputs agree ({share:.1%}, 95% {interval[0]:.1%} to {interval[1]:.1%})"
    if compared < MIN_COMPARISONS:
        return MetricVerdict(name, "inconclusive", share, *interval, limit, 1.0, 1.0, None, MIN_COMPARISONS - compared,
                             f"shadow agreement undecided: {seen}; {MIN_COMPARISONS} needed to judge")
    alpha = alpha_split(spec)[1]
    e_value = math.exp(min(stats.ceiling_log_e(compared - agreed, compared, 1 - limit), 700.0))
    verdict = _decide(agreed, compared, limit, alpha)
    if verdict == "fail":
        return MetricVerdict(name, "fail", share, *interval, limit, e_value, 1 / alpha, None, None,
                             f"shadow agreement too low: {seen}, below the min {limit:.1%} "
                             f"(evidence {e_value:.0f}x, needed {1 / alpha:.0f}x)")
    if verdict == "pass":
        return MetricVerdict(name, "pass", share, *interval, limit, e_value, 1 / alpha, None, None,
                             f"shadow agreement fine: {seen}, min {limit:.1%}")
    needed = _needed(share, compared, limit, alpha)
    words = "no sample size will tell" if needed is None else f"about {needed} more comparisons needed"
    return MetricVerdict(name, "inconclusive", share, *interval, limit, e_value, 1 / alpha, None, needed,
                         f"shadow agreement undecided: {seen}, min {limit:.1%}; {words}")


def _decide(agreed: int, compared: int, limit: float, alpha: float) -> str:
    """Anytime-valid on the cumulative comparisons: fail on evidence 1/alpha that disagreement
    is above 1 - limit; pass on evidence 1/(1 - PASS_CONFIDENCE) that it is below."""
    disagreed = compared - agreed
    if stats.ceiling_log_e(disagreed, compared, 1 - limit) >= math.log(1 / alpha):
        return "fail"
    if limit >= 1:  # no bound ever reaches 1: every comparison agreeing is the only pass
        return "pass" if agreed == compared else "fail"
    if limit <= 0:
        return "pass"
    pass_log_e = stats.ceiling_log_e(disagreed, compared, 1 - limit, above=False)
    return "pass" if pass_log_e >= math.log(1 / (1 - PASS_CONFIDENCE)) else "inconclusive"


def _needed(share: float, compared: int, limit: float, alpha: float) -> int | None:
    """More comparisons until a decision, if the share stayed as observed."""
    return stats.more_needed(lambda total: _decide(round(share * total), total, limit, alpha) != "inconclusive",
                             compared)
