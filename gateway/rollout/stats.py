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

* *Is the canary's own error rate past the absolute ceiling* (``max_error_rate``), however the
  reference fares? H0 "rate <= ceiling" against a mixture of Bernoulli alternatives above it:
  the likelihood ratio (p/c)^x ((1-p)/(1-c))^(n-x) has expectation <= 1 for any rate <= c, so
  its mixture over a grid of p is an e-process (Ville 1939; the one-sided sequential
  probability ratio test of Wald 1945, mixed as in Robbins 1970). The same test, on
  disagreements, is the shadow gate (:mod:`gateway.rollout.checks`): anytime-valid, not a
  fixed-sample Clopper-Pearson test repeated every interval.

* *Is the canary good enough to go on?* A one-sided upper confidence bound on the effect
  below the spec's floor. For rates it uses both versions' uncertainty: Newcombe's hybrid
  interval for a difference of proportions (Newcombe, "Interval estimation for the difference
  between independent proportions: comparison of eleven methods", Statistics in Medicine 17,
  1998, method 10) with Clopper-Pearson bounds for each version, so a reference measured on
  few requests cannot vouch for a canary. For latency, a normal bound on the pooled shift,
  whose variance already has both samples in it. A bad canary slips through only if it looks
  at least as good as the floor, which the benchmark (bench/judge.py) measures.

**No client weighs more than its share** (:func:`cap_clients`). The unit of evidence is the
client (one address), not the request: per version, the requests a client has had counted over
the rollout grow only up to the median client's requests to that version (the lower median, over
every client seen, of the requests each sent it so far; what was counted stays counted if the
median later falls). In one window judged on its own (as
``critical_error_rate`` is) every client is counted up to that median, at least ceil(K/2) of K
clients reach it, so one client's share of a version's counted requests is at most
1/ceil(K/2), and it moves the version's rate by at most that share whatever keys or sequence
ids it sends, when the other clients have the same rate (``tests/unit/test_judge_clients.py``
checks both with generated clients). Over a rollout the cap grows with the median client, so a
client aiming failures at one version for many intervals gets no more counted than an ordinary
client. Which of a capped client's requests count is a uniform random draw among them
(multivariate hypergeometric over its successes, errors and 4xx), independent of outcomes.
Two guards on top: a client's counted errors (and 4xx) over the rollout are clipped at what an
ordinary client would plausibly have (the 1 - OUTLIER_TAIL binomial quantile of its counted
requests at the other clients' rate), and the judge (:mod:`gateway.rollout.judge`) fails a rate
only if the effect stays past the floor without the canary's worst client, and passes it only
if the bound stays below the floor without the reference's worst client: no single client
flips a verdict.

**Why the tests stay anytime-valid under it.** The rate e-process conditions on each interval's
counted totals: under H0 (the router's per-request draw decides the version, independently of
the outcome) every subset of the counted requests is equally likely to be the canary's, which
is the hypergeometric law the e-process's factors are likelihood ratios against, so each
factor has conditional expectation 1 and their product is a test martingale (Ville: crosses
1/alpha with probability <= alpha, whenever we look). Dropping requests by a rule that reads
only which client sent them and how many (never their outcome) keeps that conditional law for
the kept ones. The outlier clip does read outcomes, but only of a client far past every other
(an honest client is clipped at a look with probability ~OUTLIER_TAIL), and it only lowers
counts. What the cap and the clip buy is the other half: requests NOT drawn by the router
(sticky keys a client computed to land on one version) break H0's premise, and they bound how
many of those can enter the counts at all; the effect floor, without the worst client, then
has to be crossed on top. bench/judge.py measures the result ((a)-(e) in the README).

**The alpha budget** (:func:`gateway.rollout.judge.alpha_split`): ``false_rollback_rate`` is split once, at the
rollout's start, evenly over every test the spec lets run: the five metrics (streaming ones
included, whether or not anyone streams), the error ceiling, the shadow gate when set, and each
custom check (a threshold, not a test: its share is reserved, and the rollout's evidence that
it is met is what its query says). Bonferroni over e-processes: the union of crossings has
probability <= the sum of the shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

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


# Rates above an absolute ceiling c that its e-process mixes over, as multiples of c's odds.
CEILING_ODDS: tuple[float, ...] = (1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0)


def ceiling_log_e(events: int, n: int, ceiling: float, above: bool = True) -> float:
    """log e-value against H0 "the rate is at most ``ceiling``" after ``events`` in ``n``
    Bernoulli trials: the mixture, over alternatives p above the ceiling (its odds times
    CEILING_ODDS), of prod (p/c)^x ((1-p)/(1-c))^(1-x). A function of the totals only, so
    evaluating it on cumulative counts each interval IS the e-process at that time. With
    ``above`` False, the mirror image: against H0 "the rate is at least ``ceiling``"."""
    if n == 0 or ceiling >= 1 or ceiling <= 0:
        if ceiling >= 1 and not above:
            return math.inf if events < n else 0.0
        if ceiling <= 0 and above:
            return math.inf if events else 0.0
        return 0.0
    multiples = np.asarray(CEILING_ODDS)
    odds = ceiling / (1 - ceiling) * (multiples if above else 1 / multiples)
    rates = odds / (1 + odds)
    log_lr = events * np.log(rates / ceiling) + (n - events) * np.log((1 - rates) / (1 - ceiling))
    return log_mixture(log_lr)


def difference_upper(events_a: int, n_a: int, events_b: int, n_b: int, confidence: float) -> float:
    """Newcombe's hybrid upper bound on rate_a - rate_b (1998, method 10), with one-sided
    Clopper-Pearson bounds at ``confidence`` for each rate: both samples' uncertainty counts."""
    rate_a, rate_b = events_a / n_a, events_b / n_b
    upper_a = rate_upper(events_a, n_a, confidence)
    lower_b = rate_lower(events_b, n_b, confidence)
    return rate_a - rate_b + math.hypot(upper_a - rate_a, rate_b - lower_b)


# -- one client, one share ---------------------------------------------------------------------
MAX_CLIENTS = 1024  # clients remembered per version over a rollout; past it, new ones fold into one
OTHER_CLIENTS = "*"  # the folded entry (and the recorder's overflow client)
# answered requests, then its events: upstream errors, client errors (4xx), rejected (Triton's queue
# refused them); counts read before rejections were counted have three entries (none rejected)
Counts = tuple[int, ...]
EVENTS = 3  # event columns after the answered requests


def lower_median(values: Sequence[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0


OUTLIER_TAIL = 1e-4  # a client's errors past this binomial tail of the other clients' rate are clipped to it
OUTLIER_CLIENTS = 10  # with fewer clients on a version, none is anyone's outlier
# client -> requests seen, counted; errors, 4xx, rejected counted (a history stored before
# rejections were counted has four entries: read through _entry)
History = dict[str, tuple[int, ...]]


def _counts(counts: Sequence[int]) -> tuple[int, ...]:
    """``counts`` as (answered, *EVENTS events), a missing rejected column read as 0."""
    return (*counts, *(0,) * (1 + EVENTS - len(counts)))


def _entry(entry: Sequence[int]) -> tuple[int, ...]:
    """A history entry as (seen, counted, *EVENTS events counted)."""
    return (*entry, *(0,) * (2 + EVENTS - len(entry)))


def cap_clients(interval: Mapping[str, Counts], history: Mapping[str, tuple[int, ...]],
                rng: np.random.Generator) -> tuple[Counts, History]:
    """This interval's counted (answered, errors, 4xx, rejected) of one version, and the new history.

    ``interval`` holds each client's raw counts this interval; ``history`` each client's
    (requests seen, requests counted, errors counted, 4xx counted, rejected counted) over the
    rollout so far. A
    client is counted up to the cap, the lower median of every known client's requests seen
    (this interval's included), minus what it already had counted; which of its requests count
    is a uniform draw. Then its counted errors (and 4xx, and rejections) over the rollout are clipped at the
    1 - OUTLIER_TAIL quantile of a binomial of its counted requests at the other clients' rate
    over the rollout: a client failing far beyond everyone else (its own bad input, or an
    attacker) counts as the worst an ordinary client would plausibly be; an honest client is
    clipped at a look with probability ~1e-4, and a version failing for everyone is never
    clipped (the others fail too). Past MAX_CLIENTS known
    clients, new ones share the OTHER_CLIENTS entry (counted as one). (Clipping needs OUTLIER_CLIENTS
    clients known on the version: among fewer, nobody is an outlier.)"""
    merged = {client: _entry(entry) for client, entry in history.items()}
    raw: dict[str, Counts] = {}
    known = len(merged)
    nothing = (0,) * (1 + EVENTS)
    for client, counts in interval.items():
        if client not in merged and client not in raw:
            if known >= MAX_CLIENTS:
                client = OTHER_CLIENTS
            else:
                known += 1
        raw[client] = tuple(a + b for a, b in zip(raw.get(client, nothing), _counts(counts)))
    for client, counts in raw.items():
        seen, counted, *events = merged.get(client, (0,) * (2 + EVENTS))
        merged[client] = (seen + counts[0], counted, *events)
    cap = lower_median([entry[0] for entry in merged.values()])
    kept: dict[str, Counts] = {}
    for client, (n, *events) in raw.items():
        keep = max(0, min(n, cap - merged[client][1]))
        if keep == n:
            kept[client] = (n, *events)
        elif keep == 0:
            kept[client] = nothing
        else:
            drawn = rng.multivariate_hypergeometric([*events, n - sum(events)], keep)
            kept[client] = (keep, *(int(v) for v in drawn[:EVENTS]))
    kept = _clip_outliers(kept, merged)
    for client, (n, *events) in kept.items():
        seen, counted, *before = merged[client]
        merged[client] = (seen, counted + n, *(a + b for a, b in zip(before, events)))
    totals = np.asarray(list(kept.values()), dtype=np.int64).reshape(-1, 1 + EVENTS).sum(axis=0)
    return tuple(int(total) for total in totals), merged


def _clip_outliers(kept: dict[str, Counts], history: Mapping[str, tuple[int, ...]]) -> dict[str, Counts]:
    """This interval's counted errors, 4xx and rejections of each client, clipped so that its counted events
    over the rollout stay within the 1 - OUTLIER_TAIL binomial quantile of its counted requests
    at the other clients' rate over the rollout (half an event of prior): see :func:`cap_clients`."""
    if len(history) < OUTLIER_CLIENTS or not kept:
        return kept
    names = list(kept)
    now = np.asarray([kept[name] for name in names], dtype=np.int64)
    before = np.asarray([history[name][1:] for name in names], dtype=np.int64)  # counted, events so far
    totals = np.asarray([entry[1:] for entry in history.values()], dtype=np.int64).sum(axis=0) + now.sum(axis=0)
    n = before[:, 0] + now[:, 0]
    clipped = now.copy()
    for column in range(1, 1 + EVENTS):
        events = before[:, column] + now[:, column]
        others = (totals[column] - events + 0.5) / (totals[0] - n + 1)
        allowed = stats.binom.ppf(1 - OUTLIER_TAIL, n, np.clip(others, 0.0, 1.0)).astype(np.int64)
        clipped[:, column] = np.clip(allowed - before[:, column], 0, now[:, column])
    return {name: tuple(int(v) for v in row) for name, row in zip(names, clipped)}


def worst_client(history: Mapping[str, tuple[int, ...]], column: int) -> tuple[int, int]:
    """(counted requests, counted events) of the client with the most counted events (column 2:
    errors, 3: 4xx, 4: rejected) over the rollout; (0, 0) without clients."""
    if not history:
        return 0, 0
    entry = max((_entry(e) for e in history.values()), key=lambda e: (e[column], e[1]))
    return entry[1], entry[column]
