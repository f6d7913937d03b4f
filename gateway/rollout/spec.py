"""What an SRE asks for when starting a rollout (``POST /admin/models/{model}/rollout``)."""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.policy import Percent, TargetKey, parse_target, target_order
from gateway.rollout.check_spec import Check, unique_names
from gateway.rollout.hook_spec import Gate, Webhook
from gateway.rollout.rollback_spec import FailureClasses, RollbackSpec
from gateway.rollout.warmup import WarmupSpec

# Fields only one judge reads (the reference, the console and the API's warnings say so): a
# statistical rollout given min_requests would otherwise take it for a setting that mattered.
THRESHOLDS_ONLY = frozenset({"max_p99_ms", "max_p99_ratio", "min_p99_delta_ms", "min_requests"})
STATISTICAL_ONLY = frozenset({"baseline", "max_error_rate_increase", "max_latency_increase", "latency_warmup_s",
                              "false_rollback_rate", "inconclusive_limit"})


class RolloutSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    canary: TargetKey = Field("", description="the new target: a version, fleet:version, another model or "
                              "model@version (left out with composing: the gateway names the ensemble's variant)")
    composing: TargetKey | None = Field(
        None, description="an ensemble's rollout of one of its composing models: model@version (qc@3). The gateway "
        "loads a variant of the ensemble whose steps running that model pin that version, splits the ensemble "
        "between itself and the variant, and on promotion pins the version in the ensemble itself")
    stable: TargetKey | None = Field(None, description="default: the version now taking most traffic")
    baseline: TargetKey | None = Field(
        None, description="a copy of the stable model loaded as a version of its own, older than the canary: it "
        "takes as much traffic as the canary (taken from the stable's share; up to 50% each) and the judge "
        "compares the canary with it instead of the stable (Kayenta's baseline). Needed where a version's "
        "latency depends on its traffic share: on Triton's Python backend a version at 5% of 150 req/s measured "
        "10-30% slower than the same code at 95% (bench/canary_share.py)")
    steps: list[Percent] = Field(default_factory=lambda: [Decimal(5), Decimal(20), Decimal(50), Decimal(100)],
                                 min_length=1, max_length=20, description="canary percent per step, ascending")
    interval_s: float = Field(30.0, ge=1, le=86_400, description="seconds per analysis interval")
    max_error_rate: float | None = Field(
        None, ge=0, le=1, description="upstream errors / requests: an absolute ceiling. thresholds: on each "
        "interval (default 0.01); statistical: the canary fails once its own rate is shown past it (an "
        "anytime-valid test), however the stable or baseline fares (default 0.05); 1 switches it off")
    max_p99_ms: float | None = Field(None, gt=0, description="absolute p99 latency limit")
    max_p99_ratio: float | None = Field(1.5, gt=1, description="canary p99 / stable p99 over the same window")
    min_p99_delta_ms: float = Field(10.0, ge=0, description="p99 ratio breaches count only past this many ms "
                                    "(histogram buckets make tiny latencies jumpy)")
    min_requests: int = Field(50, ge=1, description="canary requests per interval below which there is no verdict")
    failure_limit: int = Field(2, ge=1, le=100, description="consecutive unhealthy verdicts before rollback")
    error_limit: int = Field(3, ge=1, le=100, description="consecutive metric read errors before the rollout pauses")
    manual_gates: bool = Field(False, description="wait for a promote after every healthy step")
    unload_previous: bool = Field(False, description="after promotion, drain and unload previous versions that "
                                  "no longer take traffic")
    keep_previous: int = Field(0, ge=0, le=10, description="with unload_previous: keep this many of the newest "
                               "previous versions loaded, for an instant rollback")
    # The statistical judge (gateway/rollout/judge.py); the thresholds judge uses max_error_rate .. min_requests.
    judge: Literal["statistical", "thresholds"] = Field(
        "statistical", description="statistical: canary vs stable with sequential tests and effect floors; "
        "thresholds: absolute limits on each interval")
    max_error_rate_increase: float = Field(0.01, ge=0, le=1, description="statistical: largest tolerated rise of "
                                           "the canary's 5xx/transport error rate over the stable's (absolute)")
    max_client_error_rate_increase: float | None = Field(
        None, ge=0, le=1, description="largest tolerated rise of the canary's 4xx share over the stable's over the "
        "same window (the same clients reach both, so bad requests are shared evenly; a canary that rejects valid "
        "input is not); 1 switches the check off. Default: 0.01 with the statistical judge (its sequential test "
        "handles the noise), 0.05 with the thresholds judge (one interval, no test: one more request in 20 "
        "refused, beyond ~2.5 standard errors at 50 requests)")
    max_latency_increase: float = Field(0.2, gt=0, le=10, description="statistical: largest tolerated latency "
                                        "increase as a ratio (0.2 = canary 20% slower than the stable)")
    latency_warmup_s: float = Field(30.0, ge=0, le=3600, description="statistical: latency in the rollout's "
                                    "first seconds is not judged (a version that just started taking traffic is "
                                    "slower while it warms up: +20-60% for several seconds, measured on Triton); "
                                    "not applied after a warmup whose test passed")
    warmup: WarmupSpec | None = Field(None, description="warm before weight: mirror a share of live traffic to the "
                                      "canary (answers dropped) until its latency is steady, then its first step "
                                      "(gateway/rollout/warmup.py)")
    false_rollback_rate: float = Field(0.01, gt=0, le=0.2, description="statistical: chance that a canary as "
                                       "good as the stable is ever judged unhealthy during the whole rollout")
    retry: bool = Field(False, description="roll out a canary that the model's last rollout rolled back")
    inconclusive_limit: int = Field(30, ge=1, le=10_000, description="statistical: intervals in a row without a "
                                    "decision (inconclusive, or metrics unreadable) before the rollout pauses (with "
                                    "the requests a decision still needs)")
    webhooks: list[Webhook] = Field(default_factory=list, max_length=10, description="told of every transition "
                                    "(gateway/rollout/hooks.py)")
    gates: list[Gate] = Field(default_factory=list, max_length=10, description="asked before the rollout starts, "
                              "steps or is promoted")
    # Gentle rollback (gateway/rollout/rollback.py).
    rollback: RollbackSpec = Field(default_factory=RollbackSpec, description="how an unhealthy canary goes back to "
                                   "the stable: immediate, or gradual through rollback steps, one per interval")
    failure_classes: FailureClasses = Field(
        default_factory=FailureClasses, description="per class of failure (backend: the model; capacity: its queue, "
        "Triton's REJECTED), whether failure_limit unhealthy intervals roll back (the default for both) or pause")
    critical_error_rate: float | None = Field(
        0.5, gt=0, lt=1, description="a canary whose error rate in one interval is past this (with 99.9% "
        "confidence, while the stable's is not) is rolled back at once, whatever the judge, failure_limit or "
        "rollback mode; null switches it off. 0.5: a canary failing more requests than it serves is broken "
        "beyond anything the statistics need to weigh")
    checks: list[Check] = Field(default_factory=list, max_length=10, description="PromQL queries with limits, "
                                "judged each interval (gateway/rollout/checks.py): past its limit a check fails "
                                "like a metric; no usable value is a metric read error, never a failure")
    min_shadow_agreement: float | None = Field(None, ge=0, le=1, description="when the canary is (or was) the "
                                               "model's shadow: the least share of its compared outputs that "
                                               "agree with the primary's (a binomial bound decides)")

    def error_rate_ceiling(self) -> float:
        """max_error_rate, or the selected judge's default for it."""
        if self.max_error_rate is not None:
            return self.max_error_rate
        return 0.05 if self.judge == "statistical" else 0.01

    def client_error_floor(self) -> float:
        """max_client_error_rate_increase, or the selected judge's default for it."""
        if self.max_client_error_rate_increase is not None:
            return self.max_client_error_rate_increase
        return 0.01 if self.judge == "statistical" else 0.05

    _unique_checks = field_validator("checks")(unique_names)

    @field_validator("steps")
    @classmethod
    def _ascending(cls, steps: list[Decimal]) -> list[Decimal]:
        if any(step <= 0 for step in steps):
            raise ValueError("steps must be above 0 percent")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError("steps must be strictly ascending")
        return steps

    @model_validator(mode="after")
    def _a_canary(self) -> RolloutSpec:
        if self.composing is not None:
            target = parse_target(self.composing)
            if target.model is None or target.version is None or target.fleet is not None:
                raise ValueError("composing is a composing model's version: model@version (qc@3), no fleet")
            if self.baseline is not None:
                raise ValueError("a canary inside an ensemble is judged against the ensemble itself: no baseline")
        elif not self.canary:
            raise ValueError("canary: the target to roll out (or composing, for a model inside an ensemble)")
        return self

    @model_validator(mode="after")
    def _distinct_versions(self) -> RolloutSpec:
        if self.stable is not None and self.stable == self.canary:
            raise ValueError("stable and canary must be different versions")
        if self.baseline is not None:
            if self.baseline in (self.stable, self.canary):
                raise ValueError("the baseline must be a version of its own, neither the stable nor the canary")
            if self.judge != "statistical":
                raise ValueError("a baseline is for the statistical judge (judge: thresholds compares each "
                                 "interval's p99 and 4xx with min_requests of the other version, which a "
                                 "baseline at the canary's weight seldom has)")
            if self.stable is not None:
                newest_first(self.canary, self.stable)
            # Sticky users are laid out newest version first: an older baseline sits after the
            # canary, so raising the canary's weight still only moves users into it.
            if target_order(self.baseline) >= target_order(self.canary):
                raise ValueError(f"the baseline ({self.baseline}) must be an older version than the canary "
                                 f"({self.canary}), or sticky users would move out of the canary as it grows")
        return self

    def document(self) -> dict[str, object]:
        doc = self.model_dump(mode="json")
        doc["steps"] = [float(s) if s != int(s) else int(s) for s in self.steps]
        doc["rollback"]["steps"] = [float(s) if s != int(s) else int(s) for s in self.rollback.steps]
        return doc


def newest_first(canary: str, stable: str) -> None:
    """With a baseline, the canary must be the newest of the three versions: sticky users are
    laid out newest version first, so only then does raising its weight only move users into it
    (with two versions either order works: the canary's range grows from one end)."""
    if target_order(stable) >= target_order(canary):
        raise ValueError(f"with a baseline the canary ({canary}) must be newer than the stable ({stable}), "
                         "or sticky users would move out of the canary as it grows")
