"""Judging a canary: pure functions from metric windows to a verdict.

Four outcomes, kept apart (argo-rollouts' lesson): HEALTHY, UNHEALTHY (a threshold was
crossed: which metric, observed value, threshold), INCONCLUSIVE (too few requests: holds
the step, never success and never failure) and ERROR (the metrics could not be read: its
own counter, never a threshold breach).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import Window

CAPACITY, BACKEND = "capacity", "backend"  # classes of failure (spec.failure_classes, judge.failure_class)
CAPACITY_Z = 3.0  # thresholds judge: a REJECTED share counts past the ceiling only beyond this many standard errors


class Outcome(str, Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    metric: str | None = None
    observed: float | None = None
    threshold: float | None = None
    canary_requests: int = 0
    canary_errors: int = 0
    canary_error_rate: float | None = None
    canary_p99_ms: float | None = None
    stable_requests: int = 0
    stable_error_rate: float | None = None
    stable_p99_ms: float | None = None
    metrics: tuple[Any, ...] = ()  # the statistical judge's per-metric evidence (judge.MetricVerdict)
    canary_client_errors: int = 0
    canary_client_error_rate: float | None = None
    stable_client_error_rate: float | None = None
    canary_overloads: int = 0  # shown, never judged: load is nobody's version's fault
    stable_overloads: int = 0
    alpha: dict[str, Any] | None = None  # statistical: the false-rollback budget, each test's share of it
    clients: dict[str, Any] | None = None  # statistical: per version, clients seen and how much was capped
    canary_rejected: int = 0  # answers Triton's queue refused (full, timed out): the version's capacity
    stable_rejected: int = 0
    failure_class: str | None = None  # UNHEALTHY: "capacity" (its queue) or "backend" (the model): judge.failure_class
    attribution: dict[str, Any] | None = None  # where Triton puts the difference (rollout.attribution.Attribution)
    replicas: dict[str, Any] | None = None  # the replicas whose published windows the verdict covers

    def document(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["outcome"] = self.outcome.value
        return doc


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def judge(spec: RolloutSpec, canary: Window | None, stable: Window | None) -> Verdict:
    """The verdict on one interval. ``None`` windows mean the metrics could not be read. Answers
    Triton's queue refused (``rejected``) are the capacity error rate: its rise over the stable's
    against the same ceiling (a queue both versions fill is nobody's version's fault)."""
    if canary is None:
        return Verdict(Outcome.ERROR, "canary metrics unavailable")
    numbers: dict[str, Any] = {
        "canary_requests": canary.requests, "canary_errors": canary.errors, "canary_error_rate": canary.error_rate,
        "canary_p99_ms": _ms(canary.quantile(0.99)),
        "stable_requests": stable.requests if stable else 0,
        "stable_error_rate": stable.error_rate if stable else None,
        "stable_p99_ms": _ms(stable.quantile(0.99)) if stable else None,
        "canary_client_errors": canary.client_errors, "canary_client_error_rate": canary.client_error_rate,
        "stable_client_error_rate": stable.client_error_rate if stable else None,
        "canary_overloads": canary.overloads, "stable_overloads": stable.overloads if stable else 0,
        "canary_rejected": canary.rejected, "stable_rejected": stable.rejected if stable else 0,
    }
    answered = canary.requests + canary.client_errors  # a canary refusing every request is not "no data"
    if answered < spec.min_requests:
        return Verdict(Outcome.INCONCLUSIVE, f"{answered} canary requests, fewer than {spec.min_requests}",
                       **numbers)
    client = _client_error_breach(spec, canary, stable)
    if client is not None:
        return Verdict(Outcome.UNHEALTHY, client[0], "client_error_rate_increase", client[1],
                       spec.client_error_floor(), **numbers)
    rate, ceiling = canary.error_rate or 0.0, spec.error_rate_ceiling()
    if rate > ceiling:
        return Verdict(Outcome.UNHEALTHY, f"error rate {rate:.2%} above {ceiling:.2%}",
                       "error_rate", rate, ceiling, **numbers)
    capacity = _capacity_breach(spec, canary, stable)
    if capacity is not None:
        return Verdict(Outcome.UNHEALTHY, capacity[0], "capacity_error_rate", capacity[1], ceiling,
                       failure_class=CAPACITY, **numbers)
    p99 = numbers["canary_p99_ms"]
    if spec.max_p99_ms is not None and p99 is not None and p99 > spec.max_p99_ms:
        return Verdict(Outcome.UNHEALTHY, f"p99 {p99:.1f} ms above {spec.max_p99_ms:.1f} ms",
                       "p99_ms", p99, spec.max_p99_ms, **numbers)
    stable_p99 = numbers["stable_p99_ms"]
    if (spec.max_p99_ratio is not None and p99 is not None and stable_p99
            and stable is not None and stable.requests >= spec.min_requests):
        ratio = p99 / stable_p99
        if ratio > spec.max_p99_ratio and p99 - stable_p99 > spec.min_p99_delta_ms:
            return Verdict(Outcome.UNHEALTHY, f"p99 {p99:.1f} ms is {ratio:.2f}x the stable's {stable_p99:.1f} ms "
                           f"(limit {spec.max_p99_ratio}x)", "p99_ratio", ratio, spec.max_p99_ratio, **numbers)
    return Verdict(Outcome.HEALTHY, "within every threshold", **numbers)


def _capacity_breach(spec: RolloutSpec, canary: Window, stable: Window | None) -> tuple[str, float] | None:
    """The canary's REJECTED share over the stable's, past the error ceiling by more than the
    interval's noise (CAPACITY_Z standard errors of the difference: this judge decides each
    interval on its own, and two versions sharing a full queue differ by several points at a
    hundred requests). Not judged when the stable has too few answers to tell (the 100% step): a
    version's queue fills with its load, and the one taking all of it has nothing to compare with."""
    if stable is None or stable.requests + stable.rejected < spec.min_requests:
        return None
    n_canary, n_stable = canary.requests + canary.rejected, stable.requests + stable.rejected
    rate = canary.rejected / n_canary if canary.rejected else 0.0
    base = stable.rejected / n_stable
    pooled = (canary.rejected + stable.rejected) / (n_canary + n_stable)
    noise = CAPACITY_Z * math.sqrt(pooled * (1 - pooled) * (1 / n_canary + 1 / n_stable))
    if rate - base <= spec.error_rate_ceiling() + noise:
        return None
    return (f"REJECTED rate (queue full or timed out) {rate:.2%} is {rate - base:.2%} above the stable's {base:.2%} "
            f"(limit {spec.error_rate_ceiling():.2%})", rate - base)


def _client_error_breach(spec: RolloutSpec, canary: Window, stable: Window | None) -> tuple[str, float] | None:
    """4xx judged relative to the stable over the same window (0 when the stable has too few
    answers to tell, e.g. at the 100% step)."""
    limit = spec.client_error_floor()
    rate = canary.client_error_rate
    if limit >= 1 or rate is None:
        return None
    base = 0.0
    if stable is not None and stable.requests + stable.client_errors >= spec.min_requests:
        base = stable.client_error_rate or 0.0
    if rate - base <= limit:
        return None
    return (f"client error rate {rate:.2%} is {rate - base:.2%} above the stable's {base:.2%} "
            f"(limit {limit:.2%})", rate - base)
