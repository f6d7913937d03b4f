"""The recorder: where the data plane leaves one sample per request for the control plane.

``record()`` is O(1) and allocation-light: a ring of one-second slots per (model, version),
each holding a request count, an upstream-error count and a fixed-bucket latency histogram.
Memory is bounded by (series x slots x buckets), never by request count. ``window()`` sums
the last N seconds for the rollout analysis; cumulative totals per label set feed
``/metrics`` at scrape time, so the hot path never touches prometheus-client.

It is one of the two meeting points of the planes (the policy book is the other): writers
call methods (``record``, ``add_inflight``/``remove_inflight``, ``upstream_error``,
``set_rollout_state``, ``count_rollback``, ``shadow_stats``); readers (the Prometheus
collector, the analysis, the drain) get read-only views. Nothing outside mutates its dicts.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

# Upper bounds in seconds, 0.5 ms to 30 s: inference latencies span both ends.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
)
# The `code` label holds an HTTP status or a gRPC status name. PromQL that judges versions
# (PrometheusSource, alert rules, the dashboard) uses these two regexes.
UPSTREAM_ERROR_CODES = "5..|UNAVAILABLE|INTERNAL|UNKNOWN|DEADLINE_EXCEEDED"  # not 429/RESOURCE_EXHAUSTED: overload
JUDGED_CODES = "[23]..|OK|" + UPSTREAM_ERROR_CODES  # successes and upstream errors: never 4xx, 499, client codes
UNKNOWN_MODEL = "_unknown"  # label for model names Triton does not know: bounded cardinality
MAX_SERIES = 4096  # hard cap on distinct label sets; beyond it samples fold into one overflow series


class Outcome(str, Enum):
    SUCCESS = "success"
    UPSTREAM_ERROR = "upstream_error"  # 5xx from Triton, transport errors, timeouts
    CLIENT_ERROR = "client_error"  # 4xx: never counted against a version
    CANCELLED = "cancelled"  # the client went away first
    OVERLOAD = "overload"  # 429, Triton's queue-full 503, RESOURCE_EXHAUSTED: shown, never held against a version


@dataclass(frozen=True)
class Window:
    """What one (model, version) did over the last ``seconds``."""

    model: str
    version: str
    seconds: float
    requests: int  # success + upstream errors: the requests a version is judged on
    errors: int
    client_errors: int
    histogram: tuple[int, ...]  # counts per LATENCY_BOUNDS bucket (+1 overflow) of judged requests

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile in seconds, interpolated inside its bucket as Prometheus'
        histogram_quantile() does, so both report the same value; None without data."""
        total = sum(self.histogram)
        if not total:
            return None
        rank, seen = q * total, 0
        for index, count in enumerate(self.histogram):
            if count and seen + count >= rank:
                if index >= len(LATENCY_BOUNDS):
                    return LATENCY_BOUNDS[-1]
                lower = LATENCY_BOUNDS[index - 1] if index else 0.0
                return lower + (LATENCY_BOUNDS[index] - lower) * (rank - seen) / count
            seen += count
        return LATENCY_BOUNDS[-1]


@dataclass
class ShadowStats:
    """What the mirrored requests of one (model, shadow version) did, cumulatively."""

    requests: int = 0
    errors: int = 0
    compared: int = 0
    agreed: int = 0
    dropped: int = 0
    latency_sum: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))

    def document(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "dropped": self.dropped,
                "compared": self.compared, "agreement_rate": self.agreed / self.compared if self.compared else None,
                "error_rate": self.errors / self.requests if self.requests else None,
                "mean_latency_ms": round(self.latency_sum / self.requests * 1000, 3) if self.requests else None}


class _Series:
    __slots__ = ("stamp", "requests", "errors", "client_errors", "hist")

    def __init__(self, slots: int) -> None:
        buckets = len(LATENCY_BOUNDS) + 1
        self.stamp = [-1] * slots
        self.requests = [0] * slots
        self.errors = [0] * slots
        self.client_errors = [0] * slots
        self.hist = [[0] * buckets for _ in range(slots)]


class _Totals:
    """Cumulative counters of one label set, for Prometheus."""

    __slots__ = ("count", "hist", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.hist = [0] * (len(LATENCY_BOUNDS) + 1)


class Recorder:
    def __init__(self, horizon_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        self._slots = horizon_s
        self._clock = clock
        self._series: dict[tuple[str, str], _Series] = {}
        # (model, version, route, protocol, code) -> totals
        self._totals: dict[tuple[str, str, str, str, str], _Totals] = {}
        self._upstream_errors: dict[tuple[str, str, str], int] = {}  # (model, version, kind) -> count
        self._inflight: dict[tuple[str, str], int] = {}
        self._rollout_states: dict[str, tuple[str, tuple[str, ...]]] = {}  # model -> (current, every state)
        self._rollbacks: dict[tuple[str, str], int] = {}  # (model, reason) -> count
        self._shadow: dict[tuple[str, str], ShadowStats] = {}
        # read-only views, built once: readers never copy and never write
        self.totals: Mapping[tuple[str, str, str, str, str], _Totals] = MappingProxyType(self._totals)
        self.upstream_errors: Mapping[tuple[str, str, str], int] = MappingProxyType(self._upstream_errors)
        self.inflight: Mapping[tuple[str, str], int] = MappingProxyType(self._inflight)
        self.rollout_states: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType(self._rollout_states)
        self.rollbacks: Mapping[tuple[str, str], int] = MappingProxyType(self._rollbacks)
        self.shadow: Mapping[tuple[str, str], ShadowStats] = MappingProxyType(self._shadow)

    def record(self, model: str, version: str, outcome: Outcome, latency_s: float,
               route: str = "", protocol: str = "http", code: str = "200") -> None:
        """One finished request. O(1); the series is created on first use."""
        key = (model, version)
        series = self._series.get(key)
        if series is None:
            series = self._new_series(key)
        second = int(self._clock())
        slot = second % self._slots
        if series.stamp[slot] != second:
            series.stamp[slot] = second
            series.requests[slot] = series.errors[slot] = series.client_errors[slot] = 0
            hist = series.hist[slot]
            for index in range(len(hist)):
                hist[index] = 0
        bucket = bisect_left(LATENCY_BOUNDS, latency_s)
        if outcome is Outcome.SUCCESS or outcome is Outcome.UPSTREAM_ERROR:
            series.requests[slot] += 1
            series.hist[slot][bucket] += 1
            if outcome is Outcome.UPSTREAM_ERROR:
                series.errors[slot] += 1
        elif outcome is Outcome.CLIENT_ERROR:
            series.client_errors[slot] += 1
        label = (model, version, route, protocol, code)
        totals = self._totals.get(label)
        if totals is None:
            totals = self._new_totals(label)
        totals.count += 1
        totals.sum += latency_s
        totals.hist[bucket] += 1

    def upstream_error(self, model: str, version: str, kind: str) -> None:
        key = (model, version, kind)
        errors = self._upstream_errors
        if key in errors or len(errors) < MAX_SERIES:
            errors[key] = errors.get(key, 0) + 1

    def add_inflight(self, key: tuple[str, str]) -> None:
        """A request to (model, version) went upstream; the drain before an unload waits for it.
        Callers pass only versions a policy names, so the keys stay bounded."""
        inflight = self._inflight
        inflight[key] = inflight.get(key, 0) + 1

    def remove_inflight(self, key: tuple[str, str]) -> None:
        self._inflight[key] -= 1

    def set_rollout_state(self, model: str, state: str, states: tuple[str, ...]) -> None:
        """The rollout of ``model`` is in ``state``, one of ``states`` (every state is exported, 0 or 1)."""
        self._rollout_states[model] = (state, states)

    def count_rollback(self, model: str, reason: str) -> None:
        key = (model, reason)
        self._rollbacks[key] = self._rollbacks.get(key, 0) + 1

    def shadow_stats(self, model: str, version: str) -> ShadowStats:
        """The shadow counters of (model, version), for the shadow worker to bump."""
        key = (model, version)
        stats = self._shadow.get(key)
        if stats is None:
            stats = self._shadow[key] = ShadowStats()
        return stats

    def window(self, model: str, version: str, seconds: float) -> Window:
        """Sum of the last ``seconds`` (whole seconds, the current one included)."""
        span = max(1, min(int(seconds), self._slots))
        now = int(self._clock())
        requests = errors = client_errors = 0
        hist = [0] * (len(LATENCY_BOUNDS) + 1)
        series = self._series.get((model, version))
        if series is not None:
            for second in range(now - span + 1, now + 1):
                slot = second % self._slots
                if series.stamp[slot] != second:
                    continue
                requests += series.requests[slot]
                errors += series.errors[slot]
                client_errors += series.client_errors[slot]
                for index, count in enumerate(series.hist[slot]):
                    hist[index] += count
        return Window(model, version, float(span), requests, errors, client_errors, tuple(hist))

    def series(self) -> list[tuple[str, str]]:
        return list(self._series)

    def _new_series(self, key: tuple[str, str]) -> _Series:
        if len(self._series) >= MAX_SERIES:
            key = (UNKNOWN_MODEL, "")
            existing = self._series.get(key)
            if existing is not None:
                return existing
        series = self._series[key] = _Series(self._slots)
        return series

    def _new_totals(self, label: tuple[str, str, str, str, str]) -> _Totals:
        if len(self._totals) >= MAX_SERIES:
            label = (UNKNOWN_MODEL, "", "", label[3], "")
            existing = self._totals.get(label)
            if existing is not None:
                return existing
        totals = self._totals[label] = _Totals()
        return totals
