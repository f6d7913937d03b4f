"""The statistical judge's statistics against published values and exact computations."""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats as scipy_stats

from gateway.rollout import stats

# Hollander & Wolfe (1973), p. 69: permeability constants of the human chorioamnion at term (x)
# and at 12-26 weeks (y); the example of R's wilcox.test documentation.
TERM = [0.80, 0.83, 1.89, 1.04, 1.45, 1.38, 1.91, 1.64, 0.73, 1.46]
EARLY = [1.15, 0.88, 0.90, 0.74, 1.21]


def test_mann_whitney_on_hollander_wolfe() -> None:
    assert scipy_stats.mannwhitneyu(TERM, EARLY, alternative="greater").statistic == 35  # R: W = 35
    assert stats.mann_whitney_p(TERM, EARLY) == pytest.approx(0.1272, abs=5e-5)  # R: p-value = 0.1272


def test_hodges_lehmann_on_hollander_wolfe() -> None:
    shift, low, high = stats.hodges_lehmann(TERM, EARLY)
    assert shift == pytest.approx(0.305)  # R: difference in location 0.305
    assert low < shift < high


def test_hodges_lehmann_interval_is_the_mann_whitney_order_statistics_with_exact_coverage() -> None:
    """The interval is [D(C), D(mn+1-C)] of the sorted pairwise differences (H&W 4.3); its
    exact coverage is 1 - 2 P(U <= C-1), computed here over all C(15, 5) rank sets."""
    m, n = len(TERM), len(EARLY)
    diffs = sorted(x - y for x in TERM for y in EARLY)
    _, low, high = stats.hodges_lehmann(TERM, EARLY, confidence=0.95)
    rank = diffs.index(low) + 1
    assert high == diffs[m * n - rank]
    u_values = [sum(rank_set) - n * (n + 1) // 2 for rank_set in itertools.combinations(range(1, m + n + 1), n)]
    below = sum(u <= rank - 1 for u in u_values) / len(u_values)
    assert 1 - 2 * below >= 0.95


def test_fisher_tea_tasting_and_the_conditional_likelihood_ratio() -> None:
    """Fisher's lady tasting tea: 3 of 4 milk-first cups found. One-sided p = 17/70; the
    noncentral hypergeometric ratio at odds 2 is (16*8/321) / (16/70) = 560/321 by hand."""
    assert scipy_stats.fisher_exact([[3, 1], [1, 3]], alternative="greater").pvalue == pytest.approx(17 / 70)
    (log_lr,) = stats.log_conditional_lr(3, 4, 1, 4, odds=[2.0])
    assert math.exp(log_lr) == pytest.approx(560 / 321)
    reference = scipy_stats.nchypergeom_fisher.pmf(3, 8, 4, 4, 2.0) / scipy_stats.hypergeom.pmf(3, 8, 4, 4)
    assert math.exp(log_lr) == pytest.approx(reference)


def _table_law(canary_n: int, stable_n: int, events: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    support = np.arange(max(0, events - stable_n), min(events, canary_n) + 1)
    return support, scipy_stats.hypergeom.pmf(support, canary_n + stable_n, canary_n, events)


def test_the_rate_e_value_has_mean_one_under_the_null() -> None:
    support, pmf = _table_law(60, 5940, 30)
    e_values = [math.exp(stats.log_mixture(stats.log_conditional_lr(int(x), 60, 30 - int(x), 5940)))
                for x in support]
    assert float(np.dot(pmf, e_values)) == pytest.approx(1.0, rel=1e-9)


def test_looking_every_interval_keeps_the_false_alarm_rate_below_alpha() -> None:
    """Exact: two intervals of a 1% canary with 30 then 25 errors in all, same rate on both
    versions; stopping at the first look whose evidence reaches 1/alpha."""
    alpha = 0.01
    first_support, first_pmf = _table_law(60, 5940, 30)
    second_support, second_pmf = _table_law(300, 5700, 25)
    alarm = 0.0
    for x1, p1 in zip(first_support, first_pmf):
        log_lr = stats.log_conditional_lr(int(x1), 60, 30 - int(x1), 5940)
        if stats.log_mixture(log_lr) >= math.log(1 / alpha):
            alarm += p1
            continue
        for x2, p2 in zip(second_support, second_pmf):
            total = log_lr + stats.log_conditional_lr(int(x2), 300, 25 - int(x2), 5700)
            alarm += p1 * p2 * (stats.log_mixture(total) >= math.log(1 / alpha))
    assert 0 < alarm <= alpha


def test_clopper_pearson_upper_bound_for_zero_events_is_closed_form() -> None:
    assert stats.rate_upper(0, 300, 0.95) == pytest.approx(1 - 0.05 ** (1 / 300))  # the "rule of three": ~3/n
    assert stats.rate_upper(5, 5, 0.95) == 1.0 and stats.rate_upper(0, 0, 0.95) == 1.0


def test_normal_mixture_boundary_is_where_the_e_value_reaches_one_over_alpha() -> None:
    variance, tau, alpha = 0.001, math.log(1.2), 0.0033
    radius = stats.normal_mixture_radius(variance, tau, alpha)
    assert stats.normal_mixture_log_e(radius, variance, tau) == pytest.approx(math.log(1 / alpha))
    assert stats.normal_mixture_log_e(0.0, variance, tau) < 0  # no shift: evidence below 1
