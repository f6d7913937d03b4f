"""The statistics behind the statistical judge: pure functions over counts and samples.

Two kinds of question, asked every interval of a rollout:

* *Is the canary worse?* This must stay valid although we look every interval, so it uses
  anytime-valid tests (e-processes): the probability that a canary as good as the stable EVER
  crosses the boundary, over the whole rollout, is at most ``alpha`` (Ville's inequality).

  - Rates (errors, client errors): per interval, conditional on the interval's total number
    of errors, the canary's share of them is hypergeometric when both versions have the same
    rate (the distribution behind Fisher's exact test) and Fisher's noncentral
    hypergeometric with odds ratio psi otherwise. The product over intervals of the mixture
    (over a grid of psi > 1) of these conditional likelihood ratios is an e-process: the
    sequential form of Fisher's exact test. It is exact for small counts (no normal
    approximation: one canary error among 60 requests is judged as what it is), and
    conditioning on each interval's totals makes a Triton-wide error burst cancel out.
    References: Turner, Ly & Grünwald, "Generic E-variables for exact sequential k-sample
    tests that allow for optional stopping" (Stat. Planning & Inference, 2024) for safe
    2x2 tests; Lindon, Sanden & Shirikian, "Rapid regression detection in software
    deployments through sequential testing" (KDD 2022), Netflix's canary tests on counts.
  - Latency: per interval, the Hodges-Lehmann shift of log latencies (a ratio, since sub-
    millisecond models make absolute floors meaningless) with its distribution-free interval
    from the Mann-Whitney order statistics (as Kayenta reports it). The intervals' estimates
    are pooled by inverse variance and tested with the normal-mixture sequential probability
    ratio test (Robbins 1970; Johari, Koomen, Pekelis & Walsh, "Always valid inference",
    Operations Research 2022), valid as the sample grows (Waudby-Smith et al., "Time-uniform
    central limit theory and asymptotic confidence sequences", 2021).

* *Is the canary good enough to go on?* A one-sided upper confidence bound on the effect
  below the spec's floor (Clopper-Pearson for rates, normal for the pooled shift). A bad
  canary slips through only if it looks at least as good as the floor, which the benchmark
  (bench/judge.py) measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
from scipy import special, stats

Floats = npt.NDArray[np.float64]
Sample = Sequence[float] | Floats

# Odds ratios the rate e-process mixes over, equally weighted: from a modest 1.5x up to a
# canary whose every error is its own (the stable has none), so both a 3%-vs-0.5% canary
# (odds ~6) and a 2%-vs-0% one (odds unbounded) gather evidence quickly.
ODDS_GRID: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 35.0, 60.0, 100.0, 300.0, 1000.0)


def log_conditional_lr(canary_events: int, canary_n: int, stable_events: int, stable_n: int,
                       odds: Sequence[float] = ODDS_GRID) -> Floats:
    """log of P_psi(X = canary_events | total events) / P_1(X = canary_events | total events)
    for each odds ratio psi: one 2x2 table's contribution to the rate e-process. Zero when
    the table carries no information (no events, or one version without requests)."""
    total = canary_events + stable_events
    log_odds = np.log(np.asarray(odds, dtype=float))
    if total == 0 or canary_n == 0 or stable_n == 0:
        return np.zeros(len(log_odds))
    support = np.arange(max(0, total - stable_n), min(total, canary_n) + 1)
    log_weights = (_log_choose(canary_n, support) + _log_choose(stable_n, total - support))
    central = log_weights[canary_events - support[0]] - special.logsumexp(log_weights)
    tilted = log_weights[None, :] + log_odds[:, None] * support[None, :]
    noncentral = (log_weights[canary_events - support[0]] + log_odds * canary_events
                  - special.logsumexp(tilted, axis=1))
    result: Floats = noncentral - central
    return result


def _log_choose(n: int, k: npt.NDArray[np.int64]) -> Floats:
    result: Floats = special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
    return result


def log_mixture(log_lrs: Floats) -> float:
    """log of the equally weighted mixture of accumulated likelihood ratios: the log e-value."""
    return float(special.logsumexp(log_lrs) - math.log(len(log_lrs)))


def rate_upper(events: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound on a rate (exact for any count, 1.0 without data)."""
    if n == 0 or events >= n:
        return 1.0
    return float(stats.beta.ppf(confidence, events + 1, n - events))


def rate_lower(events: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson lower bound on a rate (0.0 without events)."""
    if n == 0 or events <= 0:
        return 0.0
    return float(stats.beta.ppf(1 - confidence, events, n - events + 1))


MAX_NEEDED = 10_000_000  # beyond this, "cannot tell at this effect size"


def more_needed(decides: Callable[[int], bool], have: int) -> int | None:
    """Smallest extra count (>= 1) for which ``decides(have + extra)`` holds, or None beyond
    MAX_NEEDED: doubling, then bisection (the criteria are monotone in the sample size up to
    rounding)."""
    high = max(2 * have, have + 10)
    while not decides(high):
        if high > MAX_NEEDED:
            return None
        high *= 2
    low = have
    while high - low > max(1, low // 100):
        middle = (low + high) // 2
        if decides(middle):
            high = middle
        else:
            low = middle
    return max(1, high - have)


def hodges_lehmann(canary: Sample, stable: Sample,
                   confidence: float = 0.95) -> tuple[float, float, float]:
    """Hodges-Lehmann shift of canary over stable (the median of all pairwise differences)
    and its two-sided distribution-free interval: the order statistics of those differences
    at the Mann-Whitney critical rank (Hollander & Wolfe, Nonparametric Statistical Methods,
    section 4.3), with the normal approximation to U's distribution."""
    diffs = np.subtract.outer(np.asarray(canary, dtype=float), np.asarray(stable, dtype=float)).ravel()
    m, n = len(canary), len(stable)
    z = stats.norm.ppf(0.5 + confidence / 2)
    rank = int(math.floor(m * n / 2 - z * math.sqrt(m * n * (m + n + 1) / 12)))  # C_alpha, 1-based
    rank = min(max(rank, 1), (m * n + 1) // 2)
    middle = (m * n - 1) // 2, m * n // 2
    picks = sorted({rank - 1, m * n - rank, *middle})
    part = np.partition(diffs, picks)
    shift = float((part[middle[0]] + part[middle[1]]) / 2)
    return shift, float(part[rank - 1]), float(part[m * n - rank])


def mann_whitney_p(canary: Sample, stable: Sample) -> float:
    """One-sided p-value of 'the canary tends to be larger' (scipy's Mann-Whitney U)."""
    return float(stats.mannwhitneyu(canary, stable, alternative="greater").pvalue)


def normal_mixture_log_e(estimate: float, variance: float, tau: float) -> float:
    """log of the normal-mixture likelihood ratio for H0 'no shift' with a N(0, tau^2)
    mixing distribution (Robbins; Johari et al. 2022, eq. 11)."""
    if variance <= 0:
        return 0.0
    ratio = variance / (variance + tau * tau)
    return 0.5 * math.log(ratio) + tau * tau * estimate * estimate / (2 * variance * (variance + tau * tau))


def normal_mixture_radius(variance: float, tau: float, alpha: float) -> float:
    """Half-width of the normal-mixture confidence sequence: the e-value reaches 1/alpha
    exactly when |estimate - shift| equals this radius."""
    if variance <= 0:
        return 0.0
    spread = variance + tau * tau
    return math.sqrt(variance * spread / (tau * tau) * (2 * math.log(1 / alpha) + math.log(spread / variance)))
