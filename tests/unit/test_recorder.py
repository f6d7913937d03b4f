from __future__ import annotations

import sys
from typing import Any

import pytest

from gateway.telemetry import recorder as recorder_module
from gateway.telemetry.recorder import (
    LATENCY_BOUNDS,
    MAX_SERIES,
    UNKNOWN_MODEL,
    Outcome,
    Recorder,
    Window,
    http_outcome,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def deep_size(obj: Any, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        size += sum(deep_size(item, seen) for item in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, name), seen) for name in obj.__slots__)
    return size


def test_memory_stays_flat_over_a_million_samples() -> None:
    clock = Clock()
    recorder = Recorder(horizon_s=60, clock=clock)
    sizes = []
    for i in range(1_000_000):
        clock.now = i / 1000.0
        recorder.record("qc", str(1 + i % 3), Outcome.SUCCESS if i % 10 else Outcome.UPSTREAM_ERROR,
                        0.001 * (1 + i % 37), "weighted", "http", "200" if i % 10 else "500")
        if i in (400_000, 999_999):  # the 60 s ring is full (and warm) long before 400,000
            sizes.append(deep_size(recorder.__dict__))
    # Bounded by ring slots x buckets: 600,000 more samples add nothing (one byte per sample
    # would be +600 KB).
    assert sizes[1] <= sizes[0] * 1.01, sizes
    assert sizes[1] < 200_000, sizes


def test_window_counts_errors_and_quantiles() -> None:
    clock = Clock()
    recorder = Recorder(clock=clock)
    for i in range(100):
        clock.now = 100 + i / 100
        recorder.record("qc", "3", Outcome.UPSTREAM_ERROR if i < 10 else Outcome.SUCCESS, 0.004)
    recorder.record("qc", "3", Outcome.CLIENT_ERROR, 0.001)
    recorder.record("qc", "3", Outcome.CANCELLED, 0.001)
    window = recorder.window("qc", "3", 10)
    assert (window.requests, window.errors, window.client_errors) == (100, 10, 1)
    assert window.error_rate == 0.1
    p50 = window.quantile(0.5)
    assert p50 is not None and 0.003 < p50 <= 0.005


@pytest.mark.parametrize("route", ["pinned", "rule"])
def test_requests_whose_client_chose_the_version_are_counted_but_never_judged(route: str) -> None:
    """A version in the URL or a header rule: not a sample of the policy's split, and a hostile
    client's way to aim bad requests at a canary (tests/integration/test_hostile_judge.py)."""
    recorder = Recorder(clock=Clock())
    recorder.watch_latencies("qc", "3")
    for outcome, code in ((Outcome.SUCCESS, "200"), (Outcome.UPSTREAM_ERROR, "500"), (Outcome.CLIENT_ERROR, "400"),
                          (Outcome.OVERLOAD, "429")):
        recorder.record("qc", "3", outcome, 0.004, route, "http", code)
    window = recorder.window("qc", "3", 10)
    assert (window.requests, window.errors, window.client_errors, window.overloads) == (0, 0, 0, 0)
    assert recorder.take_latencies("qc", "3") == []
    assert {label[4]: totals.count for label, totals in recorder.totals.items()} == \
        {"200": 1, "500": 1, "400": 1, "429": 1}
    recorder.record("qc", "3", Outcome.CLIENT_ERROR, 0.004, "weighted", "http", "400")
    assert recorder.window("qc", "3", 10).client_errors == 1


def test_old_seconds_fall_out_of_the_window() -> None:
    clock = Clock()
    recorder = Recorder(horizon_s=60, clock=clock)
    clock.now = 10
    recorder.record("qc", "2", Outcome.SUCCESS, 0.01)
    clock.now = 15
    assert recorder.window("qc", "2", 10).requests == 1
    clock.now = 25
    assert recorder.window("qc", "2", 10).requests == 0
    clock.now = 70  # the same ring slot as second 10, reused
    recorder.record("qc", "2", Outcome.SUCCESS, 0.01)
    assert recorder.window("qc", "2", 60).requests == 1


def test_quantile_interpolates_like_prometheus() -> None:
    hist = [0] * (len(LATENCY_BOUNDS) + 1)
    hist[LATENCY_BOUNDS.index(0.01)] = 100  # every sample in (0.0075, 0.01]
    window = Window("qc", "2", 10, 100, 0, 0, tuple(hist))
    assert window.quantile(0.5) == pytest.approx(0.00875)
    assert Window("qc", "2", 10, 0, 0, 0, tuple([0] * len(hist))).quantile(0.99) is None


def test_series_are_capped() -> None:
    recorder = Recorder(horizon_s=5)
    for i in range(MAX_SERIES + 50):
        recorder.record(f"m{i}", "1", Outcome.SUCCESS, 0.001)
    assert len(recorder.series()) <= MAX_SERIES + 1
    assert (UNKNOWN_MODEL, "") in recorder.series()


def test_overload_answers_are_their_own_count_and_never_judged() -> None:
    clock = Clock()
    recorder = Recorder(clock=clock)
    recorder.record("qc", "2", Outcome.OVERLOAD, 0.001, code="429")
    recorder.record("qc", "2", Outcome.SUCCESS, 0.001)
    window = recorder.window("qc", "2", 10)
    assert window.overloads == 1 and window.requests == 1 and window.errors == 0 and window.client_errors == 0


def test_latency_reservoirs_sample_watched_versions_successes_only() -> None:
    clock = Clock()
    recorder = Recorder(clock=clock)
    recorder.record("qc", "2", Outcome.SUCCESS, 0.5)
    assert recorder.take_latencies("qc", "2") == [] and recorder.watched() == []
    recorder.watch_latencies("qc", "2")
    recorder.watch_latencies("qc", "2")  # idempotent: the sample so far is kept
    recorder.record("qc", "2", Outcome.SUCCESS, 0.001)
    recorder.record("qc", "2", Outcome.UPSTREAM_ERROR, 0.002)
    recorder.record("qc", "2", Outcome.OVERLOAD, 0.003)
    recorder.record("qc", "3", Outcome.SUCCESS, 0.004)
    assert recorder.take_latencies("qc", "2") == [0.001]
    assert recorder.take_latencies("qc", "2") == [], "a take starts the sample over"
    recorder.unwatch_latencies("qc", "2")
    recorder.record("qc", "2", Outcome.SUCCESS, 0.001)
    assert recorder.take_latencies("qc", "2") == [] and recorder.watched() == []


@pytest.mark.parametrize(("status", "body", "outcome"), [
    (200, b"", Outcome.SUCCESS), (400, b"", Outcome.CLIENT_ERROR), (404, b"", Outcome.CLIENT_ERROR),
    (429, b"", Outcome.OVERLOAD),
    # Triton's full or timed-out queue: the version's capacity (issue 34; overload before it)
    (503, b'{"error":"[request id: <id_unknown>] Exceeds maximum queue size"}', Outcome.REJECTED),
    (503, b'{"error":"Request timeout expired"}', Outcome.REJECTED),
    # the words in a request id the client chose relabel nothing
    (503, b'{"error":"[request id: Exceeds maximum queue size] injected fault"}', Outcome.UPSTREAM_ERROR),
    (503, b'{"error":"connection refused"}', Outcome.UPSTREAM_ERROR), (500, b"", Outcome.UPSTREAM_ERROR),
])
def test_http_answers_are_classified_by_whose_fault_they_are(status: int, body: bytes, outcome: Outcome) -> None:
    assert http_outcome(status, body) is outcome


def test_overload_and_client_errors_are_counted_apart_from_judged_requests() -> None:
    clock = Clock()
    clock.now = 50
    recorder = Recorder(clock=clock)
    for outcome in (Outcome.SUCCESS, Outcome.SUCCESS, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ERROR, Outcome.OVERLOAD,
                    Outcome.OVERLOAD, Outcome.CANCELLED, Outcome.REJECTED):
        slow = outcome in (Outcome.OVERLOAD, Outcome.REJECTED)
        recorder.record("qc", "3", outcome, 2.0 if slow else 0.004, "weighted", "http", "x")
    window = recorder.window("qc", "3", 10)
    assert (window.requests, window.errors, window.client_errors, window.overloads, window.rejected) == (3, 1, 1, 2, 1)
    assert window.client_error_rate == 0.25
    assert sum(window.histogram) == 3, "the latency histogram holds the judged requests only"
    totals = recorder.totals[("qc", "3", "weighted", "http", "x")]
    assert totals.count == 8 and sum(totals.hist) == 3, "exported latency covers the same requests as the window"
    assert recorder.outcome_totals()[("qc", "3")] == {Outcome.SUCCESS: 2, Outcome.UPSTREAM_ERROR: 1,
                                                      Outcome.CLIENT_ERROR: 1, Outcome.OVERLOAD: 2,
                                                      Outcome.CANCELLED: 1, Outcome.CLIENT_DEADLINE: 0,
                                                      Outcome.REJECTED: 1}


def test_a_routed_version_exports_every_outcome_from_zero() -> None:
    from gateway.policy import PolicySpec
    from gateway.policy_book import PolicyBook
    from gateway.telemetry.prometheus import GatewayCollector, make_registry

    book, recorder = PolicyBook(), Recorder()
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 95, "3": 5}}), 1)
    registry = make_registry(GatewayCollector(recorder, book))
    judged = {"model": "qc", "version": "3", "judged": "true"}
    for outcome in Outcome:  # before the canary's first request: present, at 0
        assert registry.get_sample_value("gateway_version_requests_total", {**judged, "outcome": outcome.value}) == 0
    # its latency histogram (33 series per protocol) only once a rollout watches it, or it has traffic
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {**judged, "protocol": "http"}) is None
    recorder.watch_latencies("qc", "3")
    for protocol in ("http", "grpc"):
        assert registry.get_sample_value("gateway_request_duration_seconds_count",
                                         {**judged, "protocol": protocol}) == 0
    recorder.record("qc", "3", Outcome.UPSTREAM_ERROR, 0.01, "weighted", "http", "500")
    assert registry.get_sample_value("gateway_version_requests_total",
                                     {**judged, "outcome": "upstream_error"}) == 1
    recorder.unwatch_latencies("qc", "3")
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {**judged, "protocol": "http"}) == 1
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {**judged, "protocol": "grpc"}) is None


def test_requests_whose_client_chose_the_version_are_exported_as_not_judged() -> None:
    """Dashboards and alerts that sum over the label still see all traffic; what the judge reads
    (PrometheusSource: judged!="false") does not include it."""
    from gateway.policy_book import PolicyBook
    from gateway.telemetry.prometheus import GatewayCollector, make_registry

    recorder = Recorder()
    registry = make_registry(GatewayCollector(recorder, PolicyBook()))
    recorder.record("qc", "3", Outcome.SUCCESS, 0.01, "weighted", "http", "200")
    for route in ("pinned", "rule"):
        recorder.record("qc", "3", Outcome.CLIENT_ERROR, 0.01, route, "http", "400")
        recorder.record("qc", "3", Outcome.SUCCESS, 0.02, route, "grpc", "OK")
    steered = {"model": "qc", "version": "3", "judged": "false"}
    assert registry.get_sample_value("gateway_version_requests_total", {**steered, "outcome": "client_error"}) == 2
    assert registry.get_sample_value("gateway_version_requests_total", {**steered, "outcome": "success"}) == 2
    assert registry.get_sample_value("gateway_version_requests_total",
                                     {"model": "qc", "version": "3", "judged": "true", "outcome": "client_error"}) == 0
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {**steered, "protocol": "grpc"}) == 2
    assert registry.get_sample_value("gateway_request_duration_seconds_count",
                                     {"model": "qc", "version": "3", "judged": "true", "protocol": "http"}) == 1


def test_a_watched_versions_requests_are_counted_per_client_and_the_table_is_bounded() -> None:
    recorder = Recorder(clock=Clock())
    recorder.record("m", "3", Outcome.SUCCESS, 0.01, client="10.0.0.1")  # not watched yet: no table
    assert recorder.take_clients("m", "3") is None
    recorder.watch_latencies("m", "3")
    for outcome in (Outcome.SUCCESS, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ERROR, Outcome.OVERLOAD,
                    Outcome.CANCELLED, Outcome.CLIENT_DEADLINE, Outcome.REJECTED):
        recorder.record("m", "3", outcome, 0.01, client="10.0.0.1")
    recorder.record("m", "3", Outcome.SUCCESS, 0.01, route="pinned", client="10.0.0.2")  # the client chose: never
    recorder.record("m", "3", Outcome.SUCCESS, 0.01)
    assert recorder.take_clients("m", "3") == {"10.0.0.1": (4, 1, 1, 1), "": (1, 0, 0, 0)}
    assert recorder.take_clients("m", "3") == {}  # taken: the next interval starts empty
    for index in range(recorder_module.MAX_CLIENTS + 10):
        recorder.record("m", "3", Outcome.UPSTREAM_ERROR, 0.01, client=f"c{index}")
    table = recorder.take_clients("m", "3")
    assert table is not None and len(table) == recorder_module.MAX_CLIENTS + 1
    assert table[recorder_module.OVERFLOW_CLIENT] == (10, 10, 0, 0)
    recorder.unwatch_latencies("m", "3")
    assert recorder.take_clients("m", "3") is None


def test_a_clients_own_deadline_is_no_error_and_a_censored_latency() -> None:
    """Outcome.CLIENT_DEADLINE (the client's grpc-timeout ran out): not among the judged requests
    nor the errors, nor in the latency histogram; in the reservoir as -elapsed (censored)."""
    recorder = Recorder(clock=Clock())
    recorder.watch_latencies("m", "3")
    recorder.record("m", "3", Outcome.CLIENT_DEADLINE, 0.25, "", "grpc", "DEADLINE_EXCEEDED", client="10.0.0.1")
    recorder.record("m", "3", Outcome.SUCCESS, 0.002, "", "grpc", "OK", client="10.0.0.1")
    window = recorder.window("m", "3", 10)
    assert (window.requests, window.errors, sum(window.histogram)) == (1, 0, 1)
    assert sorted(recorder.take_latencies("m", "3")) == [-0.25, 0.002]
    assert recorder.outcome_totals()[("m", "3")][Outcome.CLIENT_DEADLINE] == 1
