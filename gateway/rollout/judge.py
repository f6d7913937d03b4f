"""The statistical judge (``judge: statistical``, the default): canary against stable over
the same seconds, with evidence that accumulates over the whole rollout. With a ``baseline`` in
the spec, "stable" below means that baseline: a copy of the stable at the canary's weight.

Each interval adds one :class:`VersionSample` per version to the rollout's :class:`Evidence`
and judges three metrics on everything gathered so far:

* ``error_rate``: 5xx and transport errors per answered request (Triton's BACKEND: the model);
* ``capacity_error_rate``: answers Triton's queue refused (full, or timed out: Triton's REJECTED)
  per answered request: the version's capacity, judged apart so that a rollout can pause on it
  (``failure_classes``) rather than throw a good model away for want of instances;
* ``client_error_rate``: 4xx per answered request (a canary that renamed an input fails here);
* ``latency``: the median shift of successful requests' latency, as a ratio;
* ``time_to_first_response`` and ``response_gap``, for streaming calls (HTTP generate_stream,
  gRPC ModelStreamInfer, decoupled models): the median shift, as a ratio, of the time from a
  request to its first response and of the gaps between its responses, judged like latency
  against the same floor. A metric without any sample of either version (a model nobody
  streams from) stays out of the verdict, so non-streaming rollouts are judged on three.

A metric FAILS only when the difference is significant (an anytime-valid test, see
:mod:`gateway.rollout.stats`, so looking every interval does not inflate false alarms) AND
larger than the spec's effect floor (the estimate is, not necessarily its whole interval: the
floor says which effects matter, the test whether the effect is real). It PASSES when a 95%
upper bound on the difference is below the floor. Otherwise it is INCONCLUSIVE, with the
canary requests a decision needs at the effect seen so far. The verdict is UNHEALTHY if any
metric fails, HEALTHY if all pass (and the canary had traffic this interval), INCONCLUSIVE
otherwise. The false-rollback budget ``false_rollback_rate`` is split evenly over every test
the spec lets run (Bonferroni, :func:`alpha_split`).

An UNHEALTHY verdict says which class of failure it is (``failure_class``): ``capacity`` when
only the capacity error rate failed, or latency did and Triton's own timings put the difference
in the queue (``rollout.attribution``); ``backend`` otherwise.

The gateway's own overload answers (HTTP 429, gRPC RESOURCE_EXHAUSTED: its admission control)
are counted and shown, never judged: they measure the gateway's load, not the canary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.rollout import stats
from gateway.rollout.analysis import BACKEND, CAPACITY, Outcome, Verdict
from gateway.rollout.attribution import QUEUE
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import Window

METRICS = ("error_rate", "capacity_error_rate", "client_error_rate", "latency")
STREAM_METRICS = ("time_to_first_response", "response_gap")
CEILING = "error_ceiling"  # the canary's own error rate against max_error_rate, whatever the reference
PASS_CONFIDENCE = 0.95  # one-sided: a canary at least as bad as the floor passes a look <= 5% of the time
Z_PASS = 1.6448536269514722  # its normal quantile
INTERVAL_CONFIDENCE = 0.95  # of the reported two-sided intervals
Z_INTERVAL = 1.959963984540054  # its normal quantile
MIN_LATENCIES = 10  # per version, below which an interval's latencies carry over to the next interval
MAX_CARRY = 512  # latencies per version carried over (kept with the rollout, so bounded)
MIN_SE = 1e-4  # floor on an interval's log-shift standard error (identical latencies would give 0)


@dataclass(frozen=True)
class VersionSample:
    """What one version did in one interval. ``requests`` counts answered requests
    (successes, upstream errors, rejections and client errors; never overloads or cancellations);
    ``latencies`` (seconds) is a uniform sample of its successful requests, e.g. a reservoir; a
    negative value -d is a request that ran out of a deadline its client set, after d seconds: a
    censored latency (at least d). ``clients``: the same answered requests per client (address),
    when the source knows them: the rates then count each client up to its share
    (:func:`stats.cap_clients`); without them (the Prometheus source) every request counts."""

    requests: int
    errors: int = 0
    client_errors: int = 0
    overloads: int = 0
    latencies: Sequence[float] = ()
    first_responses: Sequence[float] = ()  # seconds to the first response of streaming calls
    response_gaps: Sequence[float] = ()  # seconds between their consecutive responses
    clients: Mapping[str, stats.Counts] | None = None
    rejected: int = 0  # Triton's queue refused them (full, timed out): the capacity error rate's events

    @classmethod
    def of(cls, window: Window, latencies: Sequence[float],
           stream: tuple[Sequence[float], Sequence[float]] = ((), ()),
           clients: Mapping[str, stats.Counts] | None = None) -> VersionSample:
        """From a metrics window (whose ``requests`` leave out 4xx), a latency sample, the
        streaming samples (``Recorder.take_stream``: first responses, gaps) and the per-client
        counts (``Recorder.take_clients``)."""
        return cls(window.requests + window.client_errors + window.rejected, window.errors, window.client_errors,
                   window.overloads, latencies, *stream, clients=clients, rejected=window.rejected)


@dataclass(frozen=True)
class RateEvidence:
    """Totals and the accumulated log likelihood ratios (one per ``stats.ODDS_GRID`` odds)."""

    canary_n: int = 0
    canary_events: int = 0
    stable_n: int = 0
    stable_events: int = 0
    log_lr: tuple[float, ...] = (0.0,) * len(stats.ODDS_GRID)

    def add(self, canary_n: int, canary_events: int, stable_n: int, stable_events: int) -> RateEvidence:
        step = stats.log_conditional_lr(canary_events, canary_n, stable_events, stable_n)
        return RateEvidence(self.canary_n + canary_n, self.canary_events + canary_events,
                            self.stable_n + stable_n, self.stable_events + stable_events,
                            tuple(float(v) for v in np.asarray(self.log_lr) + step))


@dataclass(frozen=True)
class LatencyEvidence:
    """Inverse-variance sums of each interval's log Hodges-Lehmann shift. An interval with
    fewer than MIN_LATENCIES of either version (a canary at a few requests per interval)
    carries both samples over, so they are judged together with the next interval's."""

    weight: float = 0.0
    weighted_shift: float = 0.0
    canary_n: int = 0
    stable_n: int = 0
    last_p_value: float | None = None
    carry_canary: tuple[float, ...] = ()
    carry_stable: tuple[float, ...] = ()

    def add(self, canary: Sequence[float], stable: Sequence[float]) -> LatencyEvidence:
        canary, stable = (*self.carry_canary, *canary), (*self.carry_stable, *stable)
        judged_canary, judged_stable = uncensored(canary, stable)
        if len(judged_canary) < MIN_LATENCIES or len(judged_stable) < MIN_LATENCIES:
            return dataclasses.replace(self, carry_canary=tuple(canary[-MAX_CARRY:]),
                                       carry_stable=tuple(stable[-MAX_CARRY:]))
        canary, stable = judged_canary, judged_stable
        log_canary, log_stable = np.log(canary), np.log(stable)
        shift, low, high = stats.hodges_lehmann(log_canary, log_stable)
        weight = 1 / max((high - low) / (2 * Z_INTERVAL), MIN_SE) ** 2
        return LatencyEvidence(self.weight + weight, self.weighted_shift + weight * shift,
                               self.canary_n + len(canary), self.stable_n + len(stable),
                               stats.mann_whitney_p(log_canary, log_stable))


def uncensored(canary: Sequence[float], stable: Sequence[float]) -> tuple[list[float], list[float]]:
    """Both samples with their censored latencies (-d: a client's own deadline d ran out) placed.
    A deadline the reference (``stable``) answers within is past its slowest observed latency
    only if the request was slow: such a sample is ranked at the top (above every observed
    latency of either version), so a canary that hangs past its clients' deadlines still fails.
    A deadline no longer than the reference's slowest latency says nothing about the version (a
    1 ms deadline runs out on any of them): such samples are left out, whichever side."""
    observed = [v for v in (*canary, *stable) if v > 0]
    reference_top = max((v for v in stable if v > 0), default=0.0)
    top = max(observed, default=0.0)

    def placed(sample: Sequence[float]) -> list[float]:
        return [v if v > 0 else max(-v, top) for v in sample if v > 0 or -v > reference_top]

    if all(v > 0 for v in canary) and all(v > 0 for v in stable):
        return list(canary), list(stable)
    return placed(canary), placed(stable)


ClientHistory = stats.History  # client -> requests seen, counted; errors, 4xx and rejected counted, over the rollout


@dataclass(frozen=True)
class Evidence:
    """Everything the judge has seen of this rollout; persisted with it (``document``)."""

    errors: RateEvidence = field(default_factory=RateEvidence)
    client_errors: RateEvidence = field(default_factory=RateEvidence)
    latency: LatencyEvidence = field(default_factory=LatencyEvidence)
    canary_overloads: int = 0
    stable_overloads: int = 0
    intervals: int = 0
    first_response: LatencyEvidence = field(default_factory=LatencyEvidence)
    response_gap: LatencyEvidence = field(default_factory=LatencyEvidence)
    # streaming samples seen of either version, warm-up included: a metric with none stays out of the verdict
    first_responses_seen: int = 0
    response_gaps_seen: int = 0
    # per client, over the rollout (stats.cap_clients): empty when the source has no clients
    canary_clients: ClientHistory = field(default_factory=dict)
    stable_clients: ClientHistory = field(default_factory=dict)
    capacity: RateEvidence = field(default_factory=RateEvidence)  # rejected per answered request

    def add(self, canary: VersionSample, stable: VersionSample, latency: bool = True) -> Evidence:
        """This interval's samples; ``latency=False`` leaves its latencies (streaming ones too) out (warm-up).
        Rates count what :func:`counted` keeps of each version's requests."""
        first, gaps = self.first_response, self.response_gap
        rng = np.random.default_rng([self.intervals, canary.requests, stable.requests])  # reproducible draws
        (c_n, c_x, c_y, c_z), canary_clients = counted(canary, self.canary_clients, rng)
        (s_n, s_x, s_y, s_z), stable_clients = counted(stable, self.stable_clients, rng)
        return Evidence(
            self.errors.add(c_n, c_x, s_n, s_x),
            self.client_errors.add(c_n, c_y, s_n, s_y),
            self.latency.add(canary.latencies, stable.latencies) if latency else self.latency,
            self.canary_overloads + canary.overloads, self.stable_overloads + stable.overloads, self.intervals + 1,
            first.add(canary.first_responses, stable.first_responses) if latency else first,
            gaps.add(canary.response_gaps, stable.response_gaps) if latency else gaps,
            self.first_responses_seen + len(canary.first_responses) + len(stable.first_responses),
            self.response_gaps_seen + len(canary.response_gaps) + len(stable.response_gaps),
            canary_clients, stable_clients, self.capacity.add(c_n, c_z, s_n, s_z))

    def document(self) -> dict[str, Any]:
        """As JSON types: one level of dicts (dataclasses.asdict deep-copied every float of the
        carried latencies and the client tables, a third of a bench interval's time)."""
        doc: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if dataclasses.is_dataclass(value):
                value = {part.name: getattr(value, part.name) for part in dataclasses.fields(value)}
            elif isinstance(value, dict):
                value = dict(value)
            doc[item.name] = value
        return doc

    def worst(self, column: int) -> Worst:
        """Each side's client with the most counted errors (column 2), 4xx (3) or rejections (4)."""
        return stats.worst_client(self.canary_clients, column), stats.worst_client(self.stable_clients, column)

    @classmethod
    def from_document(cls, doc: dict[str, Any] | None) -> Evidence:
        if not doc:
            return cls()
        return cls(RateEvidence(**{**doc["errors"], "log_lr": tuple(doc["errors"]["log_lr"])}),
                   RateEvidence(**{**doc["client_errors"], "log_lr": tuple(doc["client_errors"]["log_lr"])}),
                   _latency_evidence(doc["latency"]), doc["canary_overloads"], doc["stable_overloads"],
                   doc["intervals"],
                   # documents stored before streaming metrics have none of these
                   _latency_evidence(doc.get("first_response") or {}), _latency_evidence(doc.get("response_gap") or {}),
                   doc.get("first_responses_seen", 0), doc.get("response_gaps_seen", 0),
                   _history(doc.get("canary_clients")), _history(doc.get("stable_clients")),
                   _rates(doc.get("capacity")))  # documents stored before capacity was judged have none


def _rates(doc: dict[str, Any] | None) -> RateEvidence:
    return RateEvidence(**{**doc, "log_lr": tuple(doc["log_lr"])}) if doc else RateEvidence()


def _history(doc: dict[str, Any] | None) -> ClientHistory:
    return {client: tuple(int(v) for v in entry) for client, entry in (doc or {}).items()}


def counted(sample: VersionSample, history: ClientHistory,
            rng: np.random.Generator) -> tuple[stats.Counts, ClientHistory]:
    """The (answered, errors, 4xx, rejected) of ``sample`` that count, and the new client history:
    every request when the source knows no clients, else each client up to its share (stats.cap_clients)."""
    if sample.clients is None:
        return (sample.requests, sample.errors, sample.client_errors, sample.rejected), history
    return stats.cap_clients(sample.clients, history, rng)


def client_weighted(window: Window, clients: Mapping[str, stats.Counts] | None) -> Window:
    """One interval's window with its rates counted per client (each up to the interval's median
    client): what ``critical_error_rate`` reads, so that a handful of clients cannot trigger it."""
    if clients is None:
        return window
    (answered, errors, client_errors, rejected), _ = stats.cap_clients(clients, {},
                                                                         np.random.default_rng(window.requests))
    return dataclasses.replace(window, requests=answered - client_errors - rejected, errors=errors,
                               client_errors=client_errors, rejected=rejected)


def alpha_split(spec: RolloutSpec) -> tuple[tuple[str, ...], float]:
    """Every test the spec lets run and the false-rollback budget each gets: fixed at the start
    (the spec decides it, not what traffic came), Bonferroni over the union of crossings."""
    tests = (*METRICS, *STREAM_METRICS, CEILING,
             *(("shadow_agreement",) if spec.min_shadow_agreement is not None else ()),
             *(f"check:{check.name}" for check in spec.checks))
    return tests, spec.false_rollback_rate / len(tests)


def _latency_evidence(doc: dict[str, Any]) -> LatencyEvidence:
    return LatencyEvidence(**{**doc, "carry_canary": tuple(doc.get("carry_canary", ())),
                              "carry_stable": tuple(doc.get("carry_stable", ()))})


@dataclass(frozen=True)
class MetricVerdict:
    """One metric's verdict and the numbers behind it, for the status and ``gateway ctl``."""

    name: str
    verdict: str  # "pass" | "fail" | "inconclusive"; the extra gates (checks.py) also "error" | "not_judged"
    effect: float | None  # rate: canary minus stable; latency: canary/stable - 1
    low: float | None  # 95% interval on the effect
    high: float | None
    floor: float
    e_value: float  # evidence against "canary no worse"; FAIL needs >= 1/alpha
    e_threshold: float
    p_value: float | None  # latency: the last interval's Mann-Whitney p-value
    requests_needed: int | None  # more canary requests a decision needs (inconclusive only)
    summary: str


def assess(spec: RolloutSpec, evidence: Evidence, canary: VersionSample, stable: VersionSample,
           extra: Sequence[MetricVerdict] = (), cause: str | None = None) -> tuple[Verdict, Evidence]:
    """The verdict on everything seen so far, this interval included, and the new evidence;
    ``extra`` (custom checks, the shadow gate: gateway/rollout/checks.py) is folded in; ``cause``:
    where Triton's own timings put this interval's latency difference (``attribution.latency_cause``)."""
    if extra:
        verdict, evidence = assess(spec, evidence, canary, stable, cause=cause)
        return fold(verdict, extra), evidence
    warming = evidence.intervals * spec.interval_s < spec.latency_warmup_s
    evidence = evidence.add(canary, stable, latency=not warming)
    streams = [(name, label, judged) for name, label, judged, seen in (
        ("time_to_first_response", "time to first response", evidence.first_response, evidence.first_responses_seen),
        ("response_gap", "gap between responses", evidence.response_gap, evidence.response_gaps_seen)) if seen]
    tests, alpha = alpha_split(spec)
    warmup_s = spec.latency_warmup_s if warming else 0
    versus = "stable" if spec.baseline is None else "baseline"  # the words for what the canary is judged against
    metrics = (
        _judge_rate("error_rate", "error rate", evidence.errors, spec.max_error_rate_increase, alpha, versus,
                    evidence.worst(2)),
        _judge_rate("capacity_error_rate", "REJECTED rate (queue full or timed out)", evidence.capacity,
                    spec.max_error_rate_increase, alpha, versus, evidence.worst(4)),
        _judge_rate("client_error_rate", "4xx rate", evidence.client_errors, spec.client_error_floor(),
                    alpha, versus, evidence.worst(3)),
        _judge_latency(evidence.latency, spec.max_latency_increase, alpha, warmup_s, versus=versus),
        *(_judge_latency(judged, spec.max_latency_increase, alpha, warmup_s, name, label, versus)
          for name, label, judged in streams),
        _judge_ceiling(evidence.errors, spec.error_rate_ceiling(), alpha),
    )
    numbers: dict[str, Any] = {
        "canary_requests": canary.requests, "canary_errors": canary.errors,
        "canary_error_rate": canary.errors / canary.requests if canary.requests else None,
        "stable_requests": stable.requests,
        "stable_error_rate": stable.errors / stable.requests if stable.requests else None,
        "canary_rejected": canary.rejected, "stable_rejected": stable.rejected,
        "metrics": metrics, "alpha": {"false_rollback_rate": spec.false_rollback_rate, "tests": list(tests),
                                      "per_test": alpha},
        "clients": {"canary": _client_numbers(evidence.canary_clients),
                    "stable": _client_numbers(evidence.stable_clients)},
    }
    overloads = (f"; overload answers (not judged): canary {evidence.canary_overloads}, stable "
                 f"{evidence.stable_overloads}" if evidence.canary_overloads or evidence.stable_overloads else "")
    failed = [m for m in metrics if m.verdict == "fail"]
    if failed:
        first = failed[0]
        return Verdict(Outcome.UNHEALTHY, "; ".join(m.summary for m in failed) + overloads, first.name,
                       first.effect, first.floor, failure_class=failure_class(failed, cause), **numbers), evidence
    if canary.requests == 0:
        return Verdict(Outcome.INCONCLUSIVE, "no canary requests this interval" + overloads, **numbers), evidence
    waiting = [m for m in metrics if m.verdict != "pass"]
    if waiting:
        return Verdict(Outcome.INCONCLUSIVE, "; ".join(m.summary for m in waiting) + overloads,
                       **numbers), evidence
    return Verdict(Outcome.HEALTHY, "every metric within its floor" + overloads, **numbers), evidence


def failure_class(failed: Sequence[MetricVerdict], cause: str | None) -> str:
    """CAPACITY when every failed metric is the version's capacity: its REJECTED rate, or a latency
    that Triton's timings put in the queue (``cause``); BACKEND otherwise (the model)."""
    return CAPACITY if all(capacity_metric(m.name, cause) for m in failed) else BACKEND


def capacity_metric(name: str, cause: str | None) -> bool:
    """A failure of metric ``name`` is the version's capacity (module docstring)."""
    return name == "capacity_error_rate" or (name in ("latency", "p99_ms", "p99_ratio") and cause == QUEUE)


def _client_numbers(history: ClientHistory) -> dict[str, Any] | None:
    """How many clients a version had over the rollout and how much of their traffic was not
    counted (capped at the median client's): None when the source knows no clients."""
    if not history:
        return None
    seen = sum(entry[0] for entry in history.values())
    kept = sum(entry[1] for entry in history.values())
    return {"clients": len(history), "requests": seen, "counted": kept,
            "down_weighted": 1 - kept / seen if seen else 0.0,
            "capped_clients": sum(1 for entry in history.values() if entry[1] < entry[0])}


def _judge_ceiling(rates: RateEvidence, ceiling: float, alpha: float) -> MetricVerdict:
    """The canary's own (counted) error rate against the absolute ``max_error_rate``, whatever
    the reference's: fails when the anytime-valid evidence that it is above reaches 1/alpha."""
    n, x = rates.canary_n, rates.canary_events
    e_value = math.exp(min(stats.ceiling_log_e(x, n, ceiling), 700.0))
    rate = x / n if n else None
    seen = f"canary {rate:.2%} of {n}" if rate is not None else "no canary requests yet"
    if rate is not None and e_value >= 1 / alpha:
        return MetricVerdict(CEILING, "fail", rate, None, None, ceiling, e_value, 1 / alpha, None, None,
                             f"error rate past the ceiling: {seen}, max_error_rate {ceiling:.2%} "
                             f"(evidence {_times(e_value)}, needed {_times(1 / alpha)})")
    # a guard, not a gate: short of a failure it never holds a step (the relative test does that)
    return MetricVerdict(CEILING, "pass", rate, None, None, ceiling, e_value, 1 / alpha, None, None,
                         f"error rate not shown past the ceiling: {seen}, max_error_rate {ceiling:.2%}")


Worst = tuple[tuple[int, int], tuple[int, int]]  # (counted requests, events) of the canary's and the reference's


def _judge_rate(name: str, label: str, rates: RateEvidence, floor: float, alpha: float,
                versus: str = "stable", worst: Worst = ((0, 0), (0, 0))) -> MetricVerdict:
    """``worst``: the client with the most counted events on each side. No single client can
    flip the verdict: FAIL needs the effect past the floor without the canary's worst client
    too, PASS the bound below it without the reference's worst client."""
    n_c, x_c, n_s, x_s = rates.canary_n, rates.canary_events, rates.stable_n, rates.stable_events
    e_value = math.exp(min(stats.log_mixture(np.asarray(rates.log_lr)), 700.0))
    if n_c == 0 or n_s == 0:
        who = "canary" if n_c == 0 else versus
        return MetricVerdict(name, "inconclusive", None, None, None, floor, e_value, 1 / alpha, None, None,
                             f"{label}: no {who} requests yet")
    rate_c, rate_s = x_c / n_c, x_s / n_s
    effect = rate_c - rate_s
    low = stats.rate_lower(x_c, n_c, 0.5 + INTERVAL_CONFIDENCE / 2) - rate_s
    high = stats.rate_upper(x_c, n_c, 0.5 + INTERVAL_CONFIDENCE / 2) - rate_s
    seen = f"canary {rate_c:.2%} of {n_c} vs {versus} {rate_s:.2%} of {n_s}"
    (worst_cn, worst_cx), (worst_sn, worst_sx) = worst
    robust = (x_c - worst_cx) / (n_c - worst_cn) - rate_s if 0 < worst_cn < n_c else effect
    if e_value >= 1 / alpha and effect > floor and robust > floor:
        return MetricVerdict(name, "fail", effect, low, high, floor, e_value, 1 / alpha, None, None,
                             f"{label} worse: {seen} (+{effect:.2%}, beyond the +{floor:.2%} floor; "
                             f"evidence {_times(e_value)}, needed {_times(1 / alpha)})")
    without = (x_s - worst_sx, n_s - worst_sn) if 0 < worst_sn < n_s else (x_s, n_s)
    bound = stats.difference_upper(x_c, n_c, *without, PASS_CONFIDENCE)  # the reference's uncertainty too
    if bound < floor:
        return MetricVerdict(name, "pass", effect, low, high, floor, e_value, 1 / alpha, None, None,
                             f"{label} fine: {seen} (at most +{max(bound, 0):.2%}, floor +{floor:.2%})")
    needed = _rate_needed(rates, floor, alpha)
    return MetricVerdict(name, "inconclusive", effect, low, high, floor, e_value, 1 / alpha, None, needed,
                         f"{label} undecided: {seen}; {_needed_words(needed)}")


def _rate_needed(rates: RateEvidence, floor: float, alpha: float) -> int | None:
    """More canary requests until a decision, if the rates stayed as observed and the
    traffic split too: to pass, the upper bound must drop below the floor; to fail, the
    evidence of the pooled table must reach 1/alpha."""
    n_c, x_c, n_s, x_s = rates.canary_n, rates.canary_events, rates.stable_n, rates.stable_events
    rate_c, rate_s = x_c / n_c, x_s / n_s
    if rate_c - rate_s < floor:
        def passes(total: int) -> bool:
            scale = total / n_c
            return stats.difference_upper(round(rate_c * total), total, round(x_s * scale),
                                          max(1, round(n_s * scale)), PASS_CONFIDENCE) < floor
        return stats.more_needed(passes, n_c)
    if rate_c - rate_s > floor:
        def fails(total: int) -> bool:
            scale = total / n_c
            log_lr = stats.log_conditional_lr(round(x_c * scale), total, round(x_s * scale), round(n_s * scale))
            return stats.log_mixture(log_lr) >= math.log(1 / alpha)
        return stats.more_needed(fails, n_c)
    return None


def _judge_latency(latency: LatencyEvidence, floor: float, alpha: float, warmup_s: float, name: str = "latency",
                   label: str = "latency", versus: str = "stable") -> MetricVerdict:
    """A latency-like metric (``name``, in words ``label``): end-to-end latency, or a streaming time."""
    if warmup_s:
        return MetricVerdict(name, "inconclusive", None, None, None, floor, 1.0, 1 / alpha, None, None,
                             f"{label}: not judged in the rollout's first {warmup_s:g} s (the canary warms up)")
    if latency.weight == 0:
        return MetricVerdict(name, "inconclusive", None, None, None, floor, 1.0, 1 / alpha, None,
                             max(1, MIN_LATENCIES - len(latency.carry_canary)),
                             f"{label}: fewer than {MIN_LATENCIES} samples of each version yet")
    shift, variance = latency.weighted_shift / latency.weight, 1 / latency.weight
    tau = math.log1p(floor)  # the mixture is tuned to effects of the floor's size
    radius = stats.normal_mixture_radius(variance, tau, alpha)
    e_value = math.exp(min(stats.normal_mixture_log_e(shift, variance, tau), 700.0))
    effect, spread = math.expm1(shift), Z_INTERVAL * math.sqrt(variance)
    low, high = math.expm1(shift - spread), math.expm1(shift + spread)
    seen = (f"canary median {_percent(effect)} vs {versus} ({_percent(low)} to {_percent(high)}) over "
            f"{latency.canary_n} vs {latency.stable_n} samples")
    args = (name, floor, e_value, 1 / alpha, latency.last_p_value)
    if shift - radius > 0 and shift > tau:
        return _metric(*args, "fail", effect, low, high, None,
                       f"{label} worse: {seen}, beyond the +{floor:.0%} floor (evidence {_times(e_value)}, "
                       f"needed {_times(1 / alpha)})")
    if shift + Z_PASS * math.sqrt(variance) < tau:
        return _metric(*args, "pass", effect, low, high, None, f"{label} fine: {seen} (floor +{floor:.0%})")
    n = latency.canary_n
    if shift < tau:
        needed: int | None = max(1, math.ceil(variance * n * (Z_PASS / (tau - shift)) ** 2) - n)
    elif shift > tau:
        needed = stats.more_needed(lambda total: stats.normal_mixture_radius(variance * n / total, tau, alpha) < shift,
                                   n)
    else:
        needed = None
    return _metric(*args, "inconclusive", effect, low, high, needed,
                   f"{label} undecided: {seen}; {_needed_words(needed)}")


def _metric(name: str, floor: float, e_value: float, threshold: float, p_value: float | None, verdict: str,
            effect: float, low: float, high: float, needed: int | None, summary: str) -> MetricVerdict:
    return MetricVerdict(name, verdict, effect, low, high, floor, e_value, threshold, p_value, needed, summary)


def _percent(ratio: float) -> str:
    return f"{ratio:+.1%}"


def _times(e_value: float) -> str:
    return f"{e_value:.0f}x" if e_value < 1e6 else "over 1,000,000x"


def _needed_words(needed: int | None) -> str:
    if needed is None:
        return "the effect sits on the floor: no sample size will tell"
    return f"about {needed} more canary requests needed"


def fold(verdict: Verdict, extra: Sequence[MetricVerdict]) -> Verdict:
    """Either judge's verdict with the extra gates' results added: any failure makes it
    UNHEALTHY (the judge's own failure named first); an ``error`` (a check without a usable
    value) makes it ERROR, counted against ``error_limit``, unless something failed; an
    ``inconclusive`` makes a HEALTHY verdict INCONCLUSIVE. ``pass`` and ``not_judged`` change
    nothing but the metrics shown."""
    metrics = (*verdict.metrics, *extra)
    failed = [m for m in extra if m.verdict == "fail"]
    errors = [m for m in extra if m.verdict == "error"]
    waiting = [m for m in extra if m.verdict == "inconclusive"]
    own = verdict.outcome
    if failed and own is not Outcome.UNHEALTHY:
        first = failed[0]
        metric = "check" if first.name.startswith("check:") else first.name  # a bounded label for /metrics
        return dataclasses.replace(verdict, outcome=Outcome.UNHEALTHY, reason=_joined(failed),
                                   metric=metric, observed=first.effect, threshold=first.floor, metrics=metrics)
    if failed:
        return dataclasses.replace(verdict, reason=f"{verdict.reason}; {_joined(failed)}", metrics=metrics)
    if errors and own is not Outcome.UNHEALTHY:
        reason = _joined(errors) if own is not Outcome.ERROR else f"{verdict.reason}; {_joined(errors)}"
        return dataclasses.replace(verdict, outcome=Outcome.ERROR, reason=reason, metrics=metrics)
    if waiting and own in (Outcome.HEALTHY, Outcome.INCONCLUSIVE):
        reason = _joined(waiting) if own is Outcome.HEALTHY else f"{verdict.reason}; {_joined(waiting)}"
        return dataclasses.replace(verdict, outcome=Outcome.INCONCLUSIVE, reason=reason, metrics=metrics)
    return dataclasses.replace(verdict, metrics=metrics)


def _joined(metrics: Sequence[MetricVerdict]) -> str:
    return "; ".join(m.summary for m in metrics)
