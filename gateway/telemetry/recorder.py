"""The recorder: where the data plane leaves one sample per request for the control plane.

``record()`` is O(1) and allocation-light: a ring of one-second slots per (model, version),
each holding a request count, an upstream-error count, client-error, rejection and overload counts, and
for the last HIST_SECONDS a fixed-bucket latency histogram of the judged requests (successes
and upstream errors). Memory is bounded by series x (slots + HIST_SECONDS x buckets), ~20 KB
per version with steady traffic, never by request count. ``window()`` sums
the last N seconds for the rollout analysis; cumulative totals per label set feed
``/metrics`` at scrape time, so the hot path never touches prometheus-client. Streaming calls
(``record_stream``) add, per response, the time to the first response or the gap since the
previous one.

It is one of the two meeting points of the planes (the policy book is the other): writers
call methods (``record``, ``add_inflight``/``remove_inflight``, ``upstream_error``,
``set_rollout_state``, ``count_rollback``, ``shadow_stats``); readers (the Prometheus
collector, the analysis, the drain) get read-only views. Nothing outside mutates its dicts.
"""

from __future__ import annotations

import re
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

from gateway.telemetry.reservoir import Reservoir

# Upper bounds in seconds, 0.5 ms to 30 s: inference latencies span both ends.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
)
# The `code` label holds an HTTP status or a gRPC status name. Dashboards that split by code
# use these regexes; judging a version uses gateway_version_requests_total{outcome=...}, which
# also tells a queue-full 503 (rejected: the version's capacity) from a failing version.
UPSTREAM_ERROR_CODES = "5..|UNAVAILABLE|INTERNAL|UNKNOWN|DEADLINE_EXCEEDED"
JUDGED_CODES = "[23]..|OK|" + UPSTREAM_ERROR_CODES  # successes and upstream errors: never 4xx, 499, client codes
# Triton's answers when a version's queue is full, or a request waited in it past the queue policy's
# timeout (HTTP 503, gRPC UNAVAILABLE): that version's capacity, not its model failing (Triton's
# metrics count the timeout as REJECTED; the full queue it does not count at all).
QUEUE_FULL = "Exceeds maximum queue size"
QUEUE_TIMEOUT = "Request timeout expired"
UNKNOWN_MODEL = "_unknown"  # label for model names Triton does not know: bounded cardinality
# Hard cap on distinct label sets; beyond it samples fold into one overflow series. Model names
# reach a label only when Triton answered for them (gateway.pipeline), so the sets follow the
# repository: 5,000 models x 3 versions fit, a client inventing names does not grow them.
MAX_SERIES = 16384
# Per-second latency histograms are kept this long (a power of two); counts for the whole horizon.
# A window longer than this has the latency of its last HIST_SECONDS (the thresholds judge's p99
# over an interval_s above 64 s).
HIST_SECONDS = 64
# Why policy sync failed: an unreadable stored record (skipped), the store unreachable, or a
# sync loop that crashed (restarted by its supervisor).
SYNC_ERROR_REASONS = ("corrupt_record", "store_unreachable", "internal")
# Routes on which the client chose the version (gateway.routing.Reason: a version in the URL or
# the request, a header rule): in /metrics (with judged="false"), never in what the judge reads.
# They are not a sample of the policy's split, and a hostile client could aim bad requests at
# the canary to roll it back.
STEERED_ROUTES = frozenset(("pinned", "rule"))
MAX_CLIENTS = 4096  # clients per watched (model, version) per interval; past it, they share OVERFLOW_CLIENT
OVERFLOW_CLIENT = "*"


class Outcome(str, Enum):
    SUCCESS = "success"
    UPSTREAM_ERROR = "upstream_error"  # 5xx from Triton, transport errors, timeouts
    CLIENT_ERROR = "client_error"  # 4xx: judged apart, relative to the stable's rate
    CANCELLED = "cancelled"  # the client went away first
    OVERLOAD = "overload"  # 429, RESOURCE_EXHAUSTED (the gateway's own admission): shown, never held against a version
    # Triton refused it for the version's queue (full, or its timeout ran out): Triton's REJECTED,
    # the version's capacity; judged apart from its errors (a rollout may pause on it instead)
    REJECTED = "rejected"
    # the deadline the client set (gRPC grpc-timeout) ran out: not the version's error; its latency
    # (the elapsed time) is at least the deadline, a censored sample for the latency metric
    CLIENT_DEADLINE = "client_deadline"


OUTCOMES = tuple(Outcome)
ZERO_HIST = array("I", [0]) * (len(LATENCY_BOUNDS) + 1)
_QUEUE_WORDS = (QUEUE_FULL.encode(), QUEUE_TIMEOUT.encode())
# Triton's own words for a request it could not accept, found by sending malformed requests to
# the real Triton (tests/integration/test_client_errors_classified.py). Some come with HTTP 500
# or gRPC INTERNAL (a body it could not parse, JSON of the wrong shape), and a ModelStreamInfer
# reply carries only the words: whatever the status, an error that starts with one of them is
# the client's, not the version's. The one table; both protocols and streams use it.
CLIENT_ERROR_MESSAGES = (
    "failed to parse the request JSON buffer",  # HTTP 500: the body is not JSON
    "Unable to parse '",  # HTTP 500: 'inputs', 'data', 'shape' missing or of the wrong type
    "unexpected inference input ",
    "unexpected inference output ",
    "unexpected shape for input ",
    "input byte size mismatch for input ",
    r"expected \d+ inputs but got \d+ inputs",
    "inference request batch-size must be <= ",
    "unable to find data for input tensor ",
    "invalid datatype for input ",
    "inference input '[^']*' data-type is ",
)
_CLIENT_ERROR = re.compile("|".join(f"(?:{pattern})" for pattern in CLIENT_ERROR_MESSAGES).encode())  # regexes
_REQUEST_ID = b"[request id: "
_JSON_ERROR = re.compile(rb'\{\s*"error"\s*:\s*"')  # Triton writes {"error":"..."}; others may space it


def _triton_words(message: bytes) -> bytes:
    """Triton's error ``message`` (or an HTTP error body) without the JSON wrapper and the
    ``[request id: <id>] `` Triton starts some of them with: the id is the client's own, so
    dressing a message up that way can only relabel the errors of the client's own requests."""
    wrapped = _JSON_ERROR.match(message)
    if wrapped is not None:
        message = message[wrapped.end():]
    if message.startswith(_REQUEST_ID):
        end = message.find(b"] ")
        if end >= 0:
            message = message[end + 2:]
    return message


def client_caused(message: bytes) -> bool:
    """Triton's error ``message`` says the request could not be accepted (:data:`CLIENT_ERROR_MESSAGES`)."""
    return _CLIENT_ERROR.match(_triton_words(message)) is not None


def queue_refused(message: bytes) -> bool:
    """Triton's error ``message`` says the version's queue refused the request (full, or timed out)."""
    return _triton_words(message).startswith(_QUEUE_WORDS)


def http_outcome(status: int, body: bytes = b"") -> Outcome:
    """Whose fault an HTTP answer was. ``body`` (a short error body) matters only for a 503
    (Triton's full or timed-out queue) and a 500 (Triton's words for a body it could not parse)."""
    if status < 400:
        return Outcome.SUCCESS
    if status == 429:
        return Outcome.OVERLOAD
    if status == 503 and queue_refused(body):
        return Outcome.REJECTED
    if status < 500 or (status == 500 and client_caused(body)):
        return Outcome.CLIENT_ERROR
    return Outcome.UPSTREAM_ERROR


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
    overloads: int = 0  # overload answers: not judged, but shown
    rejected: int = 0  # Triton's queue refused them (Outcome.REJECTED): judged apart, never timed

    @property
    def client_error_rate(self) -> float | None:
        """Client errors over every answered request (judged + client errors)."""
        answered = self.requests + self.client_errors
        return self.client_errors / answered if answered else None

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


class Series:
    """One (model, version)'s judged requests per second: counts over the recorder's horizon,
    latency histograms over the last HIST_SECONDS (allocated per second as it is used).

    Compact on purpose: a Triton serves thousands of models, and every version with traffic has
    one. Lists of 300 histograms of 31 buckets took 107 KB per version (660 MB at 5,000 models
    with traffic); arrays of counts and 64 s of histograms take ~20 KB."""

    __slots__ = ("slots", "stamp", "requests", "errors", "client_errors", "overloads", "rejected", "hist_slots",
                 "hist_stamp", "hist", "outcomes")

    def __init__(self, slots: int, hist_slots: int = HIST_SECONDS) -> None:
        self.slots = slots
        self.stamp = array("q", [-1]) * slots
        self.requests = array("I", [0]) * slots
        self.errors = array("I", [0]) * slots
        self.client_errors = array("I", [0]) * slots
        self.overloads = array("I", [0]) * slots
        self.rejected = array("I", [0]) * slots
        self.hist_slots = hist_slots
        self.hist_stamp = array("q", [-1]) * hist_slots
        self.hist: list[array[int] | None] = [None] * hist_slots
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # cumulative, for gateway_version_requests_total

    def histogram(self, second: int) -> array[int] | None:
        """The latency histogram of ``second``, if it is still kept."""
        at = second % self.hist_slots
        return self.hist[at] if self.hist_stamp[at] == second else None

    def histogram_for(self, second: int) -> array[int]:
        """The histogram of ``second`` to add to (a slot of an older second starts over)."""
        at = second % self.hist_slots
        hist = self.hist[at]
        if self.hist_stamp[at] != second:
            self.hist_stamp[at] = second
            if hist is None:
                hist = self.hist[at] = array("I", ZERO_HIST)
            else:
                hist[:] = ZERO_HIST
        assert hist is not None
        return hist


class _Totals:
    """Cumulative counters of one label set, for Prometheus."""

    __slots__ = ("count", "hist", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.hist = [0] * (len(LATENCY_BOUNDS) + 1)


class _Stream:
    """The response timings of one (model, version)'s streaming calls: cumulative, for
    Prometheus, and while a rollout watches the version a uniform sample of each since the
    controller last took them (``samples``: first responses, gaps)."""

    __slots__ = ("first", "gap", "samples")

    def __init__(self) -> None:
        self.first = _Totals()
        self.gap = _Totals()
        self.samples: tuple[Reservoir, Reservoir] | None = None


_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def _bounded(table: dict[_Key, _Value], key: _Key, make: Callable[[], _Value], overflow: _Key) -> _Value:
    """A new entry of ``table`` for ``key``; past MAX_SERIES entries, the one shared ``overflow``
    entry instead, so that label sets clients control cannot grow memory without bound."""
    if len(table) >= MAX_SERIES:
        existing = table.get(overflow)
        if existing is not None:
            return existing
        key = overflow
    value = table[key] = make()
    return value


def _zero_outcomes() -> dict[Outcome, int]:
    return dict.fromkeys(OUTCOMES, 0)


class Recorder:
    def __init__(self, horizon_s: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        self._slots = horizon_s
        self._clock = clock
        self._series: dict[tuple[str, str], Series] = {}
        self._steered: dict[tuple[str, str], dict[Outcome, int]] = {}  # outcomes of requests never judged
        # (model, version, route, protocol, code) -> totals
        self._totals: dict[tuple[str, str, str, str, str], _Totals] = {}
        self._upstream_errors: dict[tuple[str, str, str], int] = {}  # (model, version, kind) -> count
        self._inflight: dict[tuple[str, str], int] = {}
        self._rollout_states: dict[str, tuple[str, tuple[str, ...]]] = {}  # model -> (current, every state)
        self._rollbacks: dict[tuple[str, str], int] = {}  # (model, reason) -> count
        self._shadow: dict[tuple[str, str], ShadowStats] = {}
        self._reservoirs: dict[tuple[str, str], Reservoir] = {}  # (model, version) -> latency sample
        self._streams: dict[tuple[str, str], _Stream] = {}  # (model, version) -> streaming response timings
        # (model, version) -> client -> [answered, upstream errors, 4xx, rejected] since the last take, while watched
        self._clients: dict[tuple[str, str], dict[str, list[int]]] = {}
        self._sync_errors: dict[str, int] = dict.fromkeys(SYNC_ERROR_REASONS, 0)  # reason -> count
        self._loop_restarts: dict[str, int] = {}  # background loop -> restarts after a crash
        self.store_up = True  # the state store answered the last time state sync asked
        self._rollback_blocked: dict[str, int] = {}  # model -> 1 while its rollback waits for a READY stable
        # read-only views, built once: readers never copy and never write
        self.totals: Mapping[tuple[str, str, str, str, str], _Totals] = MappingProxyType(self._totals)
        self.upstream_errors: Mapping[tuple[str, str, str], int] = MappingProxyType(self._upstream_errors)
        self.inflight: Mapping[tuple[str, str], int] = MappingProxyType(self._inflight)
        self.rollout_states: Mapping[str, tuple[str, tuple[str, ...]]] = MappingProxyType(self._rollout_states)
        self.rollbacks: Mapping[tuple[str, str], int] = MappingProxyType(self._rollbacks)
        self.shadow: Mapping[tuple[str, str], ShadowStats] = MappingProxyType(self._shadow)
        self.sync_errors: Mapping[str, int] = MappingProxyType(self._sync_errors)
        self.loop_restarts: Mapping[str, int] = MappingProxyType(self._loop_restarts)
        self.rollback_blocked: Mapping[str, int] = MappingProxyType(self._rollback_blocked)
        self.streams: Mapping[tuple[str, str], _Stream] = MappingProxyType(self._streams)

    def record(self, model: str, version: str, outcome: Outcome, latency_s: float,
               route: str = "", protocol: str = "http", code: str = "200", client: str = "") -> None:
        """One finished request. O(1); the series is created on first use. ``client`` (its
        address) matters only while a rollout watches the version: the judge counts each client
        up to its share (gateway.rollout.stats.cap_clients)."""
        label = (model, version, route, protocol, code)
        totals = self._totals.get(label)
        if totals is None:
            totals = self._new_totals(label)
        totals.count += 1
        timed = outcome is Outcome.SUCCESS or outcome is Outcome.UPSTREAM_ERROR
        if timed:
            # Latency only of successes and upstream errors, here and in what the judge reads, so
            # that Prometheus' p99 and the recorder's are of the same requests.
            bucket = bisect_left(LATENCY_BOUNDS, latency_s)
            totals.sum += latency_s
            totals.hist[bucket] += 1
        key = (model, version)
        if route in STEERED_ROUTES:  # the client chose the version: /metrics only (judged="false")
            counts = self._steered.get(key) or _bounded(self._steered, key, _zero_outcomes, (UNKNOWN_MODEL, ""))
            counts[outcome] += 1
            return
        series = self._series.get(key)
        if series is None:
            series = self._new_series(key)
        second = int(self._clock())
        slot = second % series.slots
        if series.stamp[slot] != second:  # once per series and second
            series.stamp[slot] = second
            series.requests[slot] = series.errors[slot] = series.client_errors[slot] = series.overloads[slot] = 0
            series.rejected[slot] = 0
        series.outcomes[outcome] += 1
        if timed:
            series.requests[slot] += 1
            at = second % series.hist_slots
            hist = series.hist[at]
            if hist is None or series.hist_stamp[at] != second:
                hist = series.histogram_for(second)
            hist[bucket] += 1
            if outcome is Outcome.UPSTREAM_ERROR:
                series.errors[slot] += 1
        elif outcome is Outcome.CLIENT_ERROR:
            series.client_errors[slot] += 1
        elif outcome is Outcome.OVERLOAD:
            series.overloads[slot] += 1
        elif outcome is Outcome.REJECTED:
            series.rejected[slot] += 1
        if self._reservoirs:  # only while a rollout watches some version: a few dict lookups then
            self._watched(key, outcome, latency_s, client)

    def _watched(self, key: tuple[str, str], outcome: Outcome, latency_s: float, client: str) -> None:
        """What the statistical judge reads of a watched version: the latency sample (a client's
        own deadline as a censored latency, stored negative) and the per-client counts."""
        reservoir = self._reservoirs.get(key)
        if reservoir is None:
            return
        if outcome is Outcome.SUCCESS:
            reservoir.add(latency_s)
        elif outcome is Outcome.CLIENT_DEADLINE:
            reservoir.add(-max(latency_s, 1e-9))
            return
        elif outcome is not Outcome.UPSTREAM_ERROR and outcome is not Outcome.CLIENT_ERROR \
                and outcome is not Outcome.REJECTED:
            return  # cancellations and overloads: nobody's version's fault, not counted
        table = self._clients[key]
        counts = table.get(client)
        if counts is None:
            if len(table) >= MAX_CLIENTS:
                client = OVERFLOW_CLIENT
            counts = table.get(client)
            if counts is None:
                counts = table[client] = [0, 0, 0, 0]
        counts[0] += 1
        if outcome is Outcome.UPSTREAM_ERROR:
            counts[1] += 1
        elif outcome is Outcome.CLIENT_ERROR:
            counts[2] += 1
        elif outcome is Outcome.REJECTED:
            counts[3] += 1

    def stream_response(self, model: str, version: str, started: float, previous: float, judged: bool = True) -> float:
        """A successful streaming response goes to the client now (``time.perf_counter``): timed
        from ``started``, its request, when it is the first one (``previous`` 0.0), else from
        ``previous``. Returns now: the next response's ``previous``."""
        now = time.perf_counter()
        self.record_stream(model, version, not previous, now - (previous or started), judged)
        return now

    def record_stream(self, model: str, version: str, first: bool, seconds: float, judged: bool = True) -> None:
        """One successful response of a streaming call, as it goes to the client: ``first``
        with the seconds since the request arrived, else the seconds since the previous
        response to the same request. O(1): one lookup, one histogram bump, and a reservoir
        add while a rollout watches the version (unless the client chose it: not ``judged``)."""
        stream = self._streams.get((model, version))
        if stream is None:
            stream = self._new_stream((model, version))
        totals = stream.first if first else stream.gap
        totals.count += 1
        totals.sum += seconds
        totals.hist[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        samples = stream.samples
        if samples is not None and judged:
            samples[0 if first else 1].add(seconds)

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

    def count_sync_error(self, reason: str) -> None:
        """State sync failed: ``reason`` is one of SYNC_ERROR_REASONS."""
        self._sync_errors[reason] += 1

    def count_loop_restart(self, loop: str) -> None:
        self._loop_restarts[loop] = self._loop_restarts.get(loop, 0) + 1

    def set_rollback_blocked(self, model: str, blocked: bool) -> None:
        """A rollback of ``model`` waits (or no longer waits) for a stable version that is not READY."""
        self._rollback_blocked[model] = int(blocked)

    def shadow_stats(self, model: str, version: str) -> ShadowStats:
        """The shadow counters of (model, version), for the shadow worker to bump."""
        key = (model, version)
        stats = self._shadow.get(key)
        if stats is None:
            stats = self._shadow[key] = ShadowStats()
        return stats

    def now(self) -> float:
        """The recorder's clock (its seconds are this clock's whole seconds)."""
        return self._clock()

    def second_counts(self, model: str, version: str, second: int
                      ) -> tuple[int, int, int, int, int, array[int] | None] | None:
        """(requests, errors, client errors, overloads, rejected, latency histogram if still kept) of one
        second of (model, version), or None when the recorder holds nothing of that second
        (gateway.services.replica_windows publishes these)."""
        series = self._series.get((model, version))
        if series is None:
            return None
        slot = second % series.slots
        if series.stamp[slot] != second:
            return None
        return (series.requests[slot], series.errors[slot], series.client_errors[slot], series.overloads[slot],
                series.rejected[slot], series.histogram(second))

    def window(self, model: str, version: str, seconds: float) -> Window:
        """Sum of the last ``seconds`` (whole seconds, the current one included)."""
        span = max(1, min(int(seconds), self._slots))
        now = int(self._clock())
        requests = errors = client_errors = overloads = rejected = 0
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
                overloads += series.overloads[slot]
                rejected += series.rejected[slot]
                kept = series.histogram(second) if now - second < HIST_SECONDS else None
                if kept is not None:
                    for index, count in enumerate(kept):
                        if count:
                            hist[index] += count
        return Window(model, version, float(span), requests, errors, client_errors, tuple(hist), overloads, rejected)

    # -- latency reservoirs, for the statistical rollout judge ----------------------------------
    def watch_latencies(self, model: str, version: str) -> None:
        """Keep a uniform sample of (model, version)'s successful latencies from now on
        (idempotent). The rollout controller watches its canary and stable only."""
        if (model, version) not in self._reservoirs and len(self._reservoirs) < MAX_SERIES:
            self._reservoirs[(model, version)] = Reservoir()
            self._clients[(model, version)] = {}
            # and of its streaming calls' timings (kept apart from the capped overflow series)
            stream = self._streams.setdefault((model, version), _Stream())
            if stream.samples is None:
                stream.samples = (Reservoir(), Reservoir())

    def take_latencies(self, model: str, version: str) -> list[float]:
        """The latencies sampled since the previous take (at most ``reservoir.DEFAULT_SIZE``);
        the sample starts over. Empty when (model, version) is not watched. A negative value -d
        is a request whose client's own deadline ran out after d seconds (a censored latency)."""
        reservoir = self._reservoirs.get((model, version))
        return reservoir.take() if reservoir is not None else []

    def take_clients(self, model: str, version: str) -> dict[str, tuple[int, int, int, int]] | None:
        """Each client's (answered, upstream errors, 4xx, rejected) requests to (model, version) since the
        previous take (at most MAX_CLIENTS clients, the rest under OVERFLOW_CLIENT); the table
        starts over. None when (model, version) is not watched."""
        table = self._clients.get((model, version))
        if table is None:
            return None
        self._clients[(model, version)] = {}
        return {client: (counts[0], counts[1], counts[2], counts[3]) for client, counts in table.items()}

    def take_stream(self, model: str, version: str) -> tuple[list[float], list[float]]:
        """The times to first response and the gaps between responses of (model, version)'s
        streaming calls sampled since the previous take, like :meth:`take_latencies`."""
        stream = self._streams.get((model, version))
        if stream is None or stream.samples is None:
            return [], []
        return stream.samples[0].take(), stream.samples[1].take()

    def unwatch_latencies(self, model: str, version: str) -> None:
        self._reservoirs.pop((model, version), None)
        self._clients.pop((model, version), None)
        stream = self._streams.get((model, version))
        if stream is not None:
            stream.samples = None

    def watched(self) -> list[tuple[str, str]]:
        return list(self._reservoirs)

    def series(self) -> list[tuple[str, str]]:
        return list(self._series)

    def outcome_totals(self) -> dict[tuple[str, str], dict[Outcome, int]]:
        """Cumulative judged requests per (model, version) and outcome, every outcome present (from 0)."""
        return {key: dict(series.outcomes) for key, series in list(self._series.items())}

    def steered_outcome_totals(self) -> dict[tuple[str, str], dict[Outcome, int]]:
        """The same for requests whose client chose the version (never judged)."""
        return {key: dict(counts) for key, counts in list(self._steered.items())}

    def _new_series(self, key: tuple[str, str]) -> Series:
        return _bounded(self._series, key, self._make_series, (UNKNOWN_MODEL, ""))

    def _make_series(self) -> Series:
        return Series(self._slots)

    def _new_stream(self, key: tuple[str, str]) -> _Stream:
        return _bounded(self._streams, key, _Stream, (UNKNOWN_MODEL, ""))

    def _new_totals(self, label: tuple[str, str, str, str, str]) -> _Totals:
        return _bounded(self._totals, label, _Totals, (UNKNOWN_MODEL, "", "", label[3], ""))
