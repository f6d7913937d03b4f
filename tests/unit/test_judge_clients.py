"""No client weighs more than its share (issue 23, item 2), the error ceiling no reference can
lower (item 3), the pass rule that weighs the reference's uncertainty too (item 4), and a
client's own deadline as a censored latency (item 1): on the judge's own functions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.client_address import ClientAddresses, grpcio_peer
from gateway.rollout import stats
from gateway.rollout.analysis import Outcome
from gateway.rollout.check_spec import Check
from gateway.rollout.judge import (
    CEILING,
    METRICS,
    Evidence,
    VersionSample,
    alpha_split,
    assess,
    client_weighted,
    uncensored,
)
from gateway.rollout.rollback import critical_verdict
from gateway.rollout.spec import RolloutSpec
from gateway.settings import Settings, SettingsError
from gateway.telemetry.recorder import Window
from gateway.telemetry.sources import exact_increase

SPEC = RolloutSpec(canary="3", stable="2", steps=[1, 5, 20, 50, 100], interval_s=30, latency_warmup_s=0)
RNG = np.random.default_rng(0)


def latencies(n: int, median_s: float = 0.0006, seed: int = 0) -> list[float]:
    return [float(v) for v in np.random.default_rng(seed).lognormal(math.log(median_s), 0.35, n)]


honest = st.lists(st.integers(1, 60), min_size=1, max_size=60)  # requests per honest client
attacker = st.tuples(st.integers(1, 100_000), st.floats(0, 1))  # its requests, and the share that fail


@settings(max_examples=200, deadline=None)
@given(honest, attacker, st.booleans())
def test_one_client_moves_a_versions_rate_by_at_most_its_share(sizes: list[int], attack: tuple[int, float],
                                                                honest_fail: bool) -> None:
    """Honest clients that all succeed (or all fail), one client with any count and any mix:
    the counted rate is within 1/ceil(K/2) of the honest clients' rate, K clients in all."""
    n, failing = attack[0], round(attack[0] * attack[1])
    clients = {f"10.0.0.{i}": (size, size if honest_fail else 0, 0) for i, size in enumerate(sizes)}
    clients["203.0.113.9"] = (n, failing, 0)
    (answered, errors, _, _), history = stats.cap_clients(clients, {}, RNG)
    share = 1 / math.ceil(len(clients) / 2)
    rate = errors / answered
    assert abs(rate - (1.0 if honest_fail else 0.0)) <= share + 1e-12
    assert history["203.0.113.9"][1] <= stats.lower_median([c[0] for c in clients.values()])


@settings(max_examples=50, deadline=None)
@given(st.lists(honest, min_size=1, max_size=8), st.integers(1, 5000))
def test_over_a_rollout_a_clients_counted_requests_grow_only_up_to_the_median_client(intervals: list[list[int]],
                                                                                       flood: int) -> None:
    """(The median can fall when new clients come: what was counted stays counted.)"""
    history: stats.History = {}
    for sizes in intervals:
        clients = {f"c{i}": (size, 0, 0) for i, size in enumerate(sizes)}
        clients["attacker"] = (flood, flood, 0)
        before = dict(history)
        _, history = stats.cap_clients(clients, history, RNG)
        median = stats.lower_median([entry[0] for entry in history.values()])
        for client, (seen, kept, errors, _, _) in history.items():
            assert errors <= kept <= seen and kept <= max(before.get(client, (0, 0, 0, 0, 0))[1], median)


def test_the_client_table_is_bounded_and_the_overflow_is_one_client() -> None:
    clients = {f"c{i}": (1, 0, 0) for i in range(stats.MAX_CLIENTS + 500)}
    _, history = stats.cap_clients(clients, {}, RNG)
    assert len(history) == stats.MAX_CLIENTS + 1 and history[stats.OTHER_CLIENTS][0] == 500


def population(per_client: int, errors: int, clients: int = 200) -> dict[str, tuple[int, int, int]]:
    """``clients`` addresses with ``per_client`` requests each, ``errors`` of them spread one a client."""
    return {f"10.1.{i // 250}.{i % 250}": (per_client, int(i < errors), 0) for i in range(clients)}


def sample(clients: dict[str, tuple[int, int, int]], seed: int) -> VersionSample:
    answered = sum(c[0] for c in clients.values())
    errors = sum(c[1] for c in clients.values())
    return VersionSample(answered, errors, 0, 0, latencies(min(answered - errors, 1024), seed=seed), clients=clients)


def test_a_bad_canary_does_not_pass_behind_one_client_failing_the_stable() -> None:
    """Issue 23, tried: a canary at 3% errors against a stable at 0.5%, and one client sending
    1,500 failing requests per interval that land on the stable. Judged on every request (main
    at 8c86ecb, which had no client in its samples) the stable's rate rose to ~34% and the
    canary was healthy in all five intervals; counted per client, it is unhealthy."""
    canary = population(15, 90)  # 3,000 requests, 3%
    stable = {**population(15, 15), "198.51.100.7": (1500, 1500, 0)}  # 0.5%, and the attacker
    evidence, outcomes = Evidence(), []
    for interval in range(5):
        verdict, evidence = assess(SPEC, evidence, sample(canary, interval), sample(stable, 100 + interval))
        outcomes.append(verdict.outcome)
    assert outcomes[-1] is Outcome.UNHEALTHY and Outcome.HEALTHY not in outcomes, outcomes
    assert verdict.metric == "error_rate"
    shown = verdict.clients
    assert shown is not None and shown["stable"]["clients"] == 201 and shown["canary"]["clients"] == 200
    assert shown["stable"]["capped_clients"] == 1 and shown["stable"]["down_weighted"] > 0.3
    assert shown["canary"]["down_weighted"] == 0


def test_one_client_aiming_failures_at_an_identical_canary_does_not_roll_it_back() -> None:
    """1% step: ~60 canary requests an interval from ~50 clients, and one client with 600
    failing requests an interval aimed at the canary (sticky keys): over 40 intervals the canary
    is never judged unhealthy (counted as all of them, its rate would be ~90%)."""
    rng = np.random.default_rng(3)
    evidence = Evidence()
    for interval in range(40):
        canary_n = rng.poisson(0.3, 200)
        stable_n = rng.poisson(29.7, 200)
        canary = {f"c{i}": (int(n), int(rng.binomial(n, 0.005)), 0) for i, n in enumerate(canary_n) if n}
        stable = {f"c{i}": (int(n), int(rng.binomial(n, 0.005)), 0) for i, n in enumerate(stable_n) if n}
        canary["attacker"] = (600, 600, 0)
        verdict, evidence = assess(SPEC, evidence, sample(canary, interval), sample(stable, 1000 + interval))
        assert verdict.outcome is not Outcome.UNHEALTHY, (interval, verdict.reason)
    assert verdict.clients is not None and verdict.clients["canary"]["down_weighted"] > 0.9


def test_critical_error_rate_reads_counted_clients_so_a_handful_cannot_trigger_it() -> None:
    """Five clients failing every request they aim at the canary (300 requests), 55 others
    succeeding: 300 of 355 failing trips critical_error_rate on raw counts, not counted per client."""
    clients = {**{f"bad{i}": (60, 60, 0) for i in range(5)}, **{f"ok{i}": (1, 0, 0) for i in range(55)}}
    window = Window("m", "3", 30, 355, 300, 0, (0,) * 31)
    stable = Window("m", "2", 30, 6000, 30, 0, (0,) * 31)
    assert critical_verdict(SPEC, window, stable) is not None  # raw counts: rolled back at once
    weighted = client_weighted(window, clients)
    assert weighted.requests == 60 and weighted.errors == 5
    assert critical_verdict(SPEC, weighted, stable) is None


def test_a_canary_past_the_ceiling_fails_however_bad_the_reference() -> None:
    """8% errors on both versions: nothing relative to see, but the canary's own rate is past
    max_error_rate (0.05): it fails on the ceiling; at 3% on both it never does."""
    stable = VersionSample(6000, 480, 0, 0, latencies(1024, seed=1))
    bad = VersionSample(600, 48, 0, 0, latencies(552, seed=2))
    evidence, failed_at = Evidence(), None
    for interval in range(30):
        verdict, evidence = assess(SPEC, evidence, bad, stable)
        if verdict.outcome is Outcome.UNHEALTHY:
            failed_at = interval
            break
    assert failed_at is not None and verdict.metric == CEILING, verdict.reason
    assert "past the ceiling" in verdict.reason
    fine, evidence = VersionSample(600, 18, 0, 0, latencies(582, seed=2)), Evidence()
    for _ in range(60):
        verdict, evidence = assess(SPEC, evidence, fine, VersionSample(6000, 180, 0, 0, latencies(1024, seed=1)))
        assert next(m for m in verdict.metrics if m.name == CEILING).verdict == "pass"


def test_the_ceiling_is_anytime_valid_at_the_ceiling() -> None:
    """A rate exactly at the ceiling, looked at after every 60 more requests for 100 looks: the
    e-process ever reaches 1/alpha in at most alpha of 2,000 paths."""
    alpha, rng = 0.01 / 6, np.random.default_rng(5)
    events = np.cumsum(rng.random((2000, 6000)) < 0.05, axis=1)[:, 59::60]
    # the fewest events that cross at each look (crossing is monotone in events), then every path at once
    least = [_least_crossing(60 * look, math.log(1 / alpha)) for look in range(1, 101)]
    crossed = int(np.sum((events >= np.asarray(least)).any(axis=1)))
    assert crossed <= 2000 * alpha * 2  # 6 at most (expected <= 3.3)


def _least_crossing(n: int, threshold: float) -> int:
    low, high = 0, n + 1  # n + 1: never crosses
    while low < high:
        middle = (low + high) // 2
        if middle <= n and stats.ceiling_log_e(middle, n, 0.05) >= threshold:
            high = middle
        else:
            low = middle + 1
    return low


def test_the_pass_rule_weighs_the_references_uncertainty() -> None:
    """A reference measured high by chance (2 errors in 20) cannot vouch for a canary at 6%:
    the canary's bound alone (6.9%) is below the reference's 10%, Newcombe's is not."""
    assert stats.rate_upper(60, 1000, 0.95) - 2 / 20 < 0.01  # what the old rule passed
    assert stats.difference_upper(60, 1000, 2, 20, 0.95) > 0.01
    canary, reference = VersionSample(1000, 60, 0, 0, latencies(940)), VersionSample(20, 2, 0, 0, latencies(18))
    verdict, _ = assess(SPEC, Evidence(), canary, reference)
    assert next(m for m in verdict.metrics if m.name == "error_rate").verdict != "pass"


def test_a_1ms_client_deadline_moves_nothing_and_a_hanging_canary_still_fails() -> None:
    stable = latencies(1000, seed=1)
    canary = latencies(700, seed=2)
    one_ms = [-0.001] * 300  # a client whose own 1 ms deadline ran out: censored at 1 ms
    placed_canary, placed_stable = uncensored([*canary, *one_ms], stable)
    assert placed_canary == canary and placed_stable == stable  # below the stable's slowest: says nothing
    verdict, _ = assess(SPEC, Evidence(), VersionSample(700, 0, 0, 0, [*canary, *one_ms]),
                        VersionSample(1000, 0, 0, 0, stable))
    plain, _ = assess(SPEC, Evidence(), VersionSample(700, 0, 0, 0, canary), VersionSample(1000, 0, 0, 0, stable))
    assert [m.verdict for m in verdict.metrics] == [m.verdict for m in plain.metrics]
    hanging = [-2.0] * 500  # every canary request ran out of its client's 2 s deadline
    verdict, _ = assess(SPEC, Evidence(), VersionSample(0, 0, 0, 0, hanging), VersionSample(1000, 0, 0, 0, stable))
    assert verdict.outcome is Outcome.UNHEALTHY and verdict.metric == "latency", verdict.reason


def test_the_client_is_the_peer_unless_a_trusted_proxy_forwarded_it() -> None:
    forwarded = [(b"x-forwarded-for", b"198.51.100.4, 10.0.0.7")]
    assert ClientAddresses().of("10.0.0.9", forwarded) == "10.0.0.9"  # no trusted proxies: the header is ignored
    addresses = ClientAddresses(["10.0.0.0/8"])
    assert addresses.of("10.0.0.9", forwarded) == "198.51.100.4"  # rightmost address not itself trusted
    assert addresses.of("203.0.113.5", forwarded) == "203.0.113.5"  # an untrusted peer's header is not believed
    assert addresses.of("10.0.0.9", [(b"x-forwarded-for", b"not-an-address")]) == "10.0.0.9"
    assert addresses.of("10.0.0.9", [(b"x-forwarded-for", b"10.1.1.1")]) == "10.0.0.9"  # only proxies: the peer
    assert addresses.of("10.0.0.9", [(b"x-forwarded-for", b"192.0.2.1"), (b"x-forwarded-for", b"10.0.0.3")]) \
        == "192.0.2.1"  # several header lines read as one list
    assert addresses.of(None) == ""
    assert grpcio_peer("ipv4:127.0.0.5:51234") == "127.0.0.5" and grpcio_peer("ipv6:[::1]:5555") == "::1"
    assert grpcio_peer("unix:/tmp/socket") == "unix:/tmp/socket" and grpcio_peer(None) == ""


def test_trusted_proxies_must_be_networks(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("trusted_proxies: [10.0.0.0/8, proxy.internal]\n")
    with pytest.raises(SettingsError, match="trusted_proxies"):
        Settings.load(config)
    config.write_text("trusted_proxies: [10.0.0.0/8, 192.0.2.1]\n")
    assert Settings.load(config).trusted_proxies == ["10.0.0.0/8", "192.0.2.1"]


def test_the_alpha_budget_is_split_once_over_every_test_the_spec_allows_and_shown() -> None:
    spec = SPEC.model_copy(update={"min_shadow_agreement": 0.99, "checks": [
        Check(name="a", query="q", max=1.0), Check(name="b", query="q", max=1.0)]})
    tests, alpha = alpha_split(spec)
    assert tests == (*METRICS, "time_to_first_response", "response_gap", CEILING, "shadow_agreement",
                     "check:a", "check:b")
    assert alpha == pytest.approx(spec.false_rollback_rate / 10)
    verdict, _ = assess(spec, Evidence(), VersionSample(100, 0, 0, 0, latencies(100)),
                        VersionSample(1000, 0, 0, 0, latencies(1000)))
    assert verdict.alpha == {"false_rollback_rate": 0.01, "tests": list(tests), "per_test": alpha}
    assert all(m.e_threshold == pytest.approx(1 / alpha) for m in verdict.metrics)


def test_prometheus_counts_are_exact_increases_of_the_raw_samples_with_resets() -> None:
    """From the last scrape at or before the window's start; a drop is a restart (counted from
    0); a series first scraped inside the window counts from 0; nothing is extrapolated."""
    samples = [(0.0, 100.0), (5.0, 110.0), (10.0, 130.0), (15.0, 4.0), (20.0, 10.0)]
    assert exact_increase(samples, 5.0) == 20 + 4 + 6
    assert exact_increase(samples, 20.0) == 0
    assert exact_increase([(12.0, 7.0), (17.0, 9.0)], 10.0) == 9  # born in the window
    assert exact_increase([(2.0, 7.0), (8.0, 7.0)], 5.0) == 0
