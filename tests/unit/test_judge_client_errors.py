"""The threshold judge on 4xx and overload: client errors relative to the stable, overload never."""

from __future__ import annotations

from gateway.rollout.analysis import Outcome, judge
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import LATENCY_BOUNDS, Window

SPEC = RolloutSpec(canary="3", min_requests=50, judge="thresholds")


def window(version: str, requests: int, client_errors: int = 0, overloads: int = 0) -> Window:
    hist = [0] * (len(LATENCY_BOUNDS) + 1)
    hist[LATENCY_BOUNDS.index(0.005)] = requests
    return Window("qc", version, 10, requests, 0, client_errors, tuple(hist), overloads)


def test_a_canary_refusing_30_percent_of_requests_is_unhealthy() -> None:
    verdict = judge(SPEC, window("3", 70, client_errors=30), window("2", 990, client_errors=10))
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "client_error_rate_increase"
    assert verdict.observed is not None and abs(verdict.observed - 0.29) < 1e-9
    assert verdict.canary_client_errors == 30 and verdict.stable_client_error_rate == 0.01


def test_a_canary_refusing_everything_is_not_inconclusive() -> None:
    verdict = judge(SPEC, window("3", 0, client_errors=100), window("2", 1000))
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "client_error_rate_increase"


def test_bad_clients_shared_by_both_versions_are_not_the_canarys_fault() -> None:
    verdict = judge(SPEC, window("3", 80, client_errors=20), window("2", 800, client_errors=200))
    assert verdict.outcome is Outcome.HEALTHY


def test_without_a_stable_to_compare_the_increase_is_over_zero() -> None:
    assert judge(SPEC, window("3", 97, client_errors=3), window("2", 0)).outcome is Outcome.HEALTHY
    assert judge(SPEC, window("3", 90, client_errors=10), None).outcome is Outcome.UNHEALTHY


def test_overload_on_both_versions_is_shown_and_never_judged() -> None:
    verdict = judge(SPEC, window("3", 60, overloads=400), window("2", 600, overloads=4000))
    assert verdict.outcome is Outcome.HEALTHY
    assert (verdict.canary_overloads, verdict.stable_overloads) == (400, 4000)
    only_overload = judge(SPEC, window("3", 0, overloads=500), window("2", 0, overloads=5000))
    assert only_overload.outcome is Outcome.INCONCLUSIVE, "no answered request: no verdict either way"


def test_the_check_can_be_switched_off() -> None:
    spec = RolloutSpec(canary="3", min_requests=50, judge="thresholds", max_client_error_rate_increase=1)
    assert judge(spec, window("3", 70, client_errors=30), window("2", 1000)).outcome is Outcome.HEALTHY
