"""``/metrics``: the recorder's totals exported at scrape time.

The hot path never calls prometheus-client (a labelled ``inc()`` costs microseconds per
request); it bumps plain counters in the recorder, and this collector turns them into
metric families when Prometheus scrapes. Each app has its own registry.
Label cardinality is bounded: no user ids or raw paths, and model names Triton does not
know collapse into one ``_unknown`` label.

A version has series once it has traffic. Before that, only what a version needs from 0
exists: its outcome counters when a policy's weights name it (six per version), and its
latency histogram while a rollout watches it (the judge's and dashboards' increase() then
count its first request). Zero histograms for every routed version x protocol made 147
series per model with no traffic: 735,000 series and 80 MB at 5,000 models.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from gateway.policy_book import PolicyBook
from gateway.telemetry.exposition import Keyed, SnapshotRegistry, pace
from gateway.telemetry.recorder import LATENCY_BOUNDS, OUTCOMES, STEERED_ROUTES, Outcome, Recorder

Totals = tuple[int, float, tuple[int, ...]]  # count, sum, histogram (LATENCY_BOUNDS + overflow)
ZERO_OUTCOMES = tuple((outcome, 0) for outcome in OUTCOMES)  # a version a policy names, before its traffic


@dataclass(frozen=True)
class GatewaySnapshot:
    """What ``/metrics`` shows, copied out of the recorder and the policy book at one moment on
    the serving loop (plain numbers, O(label sets)); :meth:`collect` builds the metric families
    from it on any thread, so a histogram's buckets, sum and count are always of the same
    requests, however many arrive while the exposition is rendered."""

    totals: list[tuple[tuple[str, str, str, str, str], Totals]]
    outcomes: dict[tuple[str, str], dict[Outcome, int]]
    steered: dict[tuple[str, str], dict[Outcome, int]]
    upstream_errors: dict[tuple[str, str, str], int]
    inflight: dict[tuple[str, str], int]
    streams: list[tuple[tuple[str, str], Totals, Totals]]
    shadow: list[tuple[tuple[str, str], tuple[int, int, int, int, float]]]
    policies: Mapping[str, Any]  # the policy book's snapshot: model -> routing.Policy (revision, spec)
    watched: frozenset[tuple[str, str]]
    rollout_states: dict[str, tuple[str, tuple[str, ...]]]
    rollbacks: dict[tuple[str, str], int]
    rollback_blocked: dict[str, int]
    sync_errors: dict[str, int]
    loop_restarts: dict[str, int]
    store_up: bool

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield family.metric() if isinstance(family, Keyed) else family

    def families(self) -> Iterator[Metric | Keyed]:
        """Every family; the ones with a few series per model as :class:`Keyed` rows, whose text
        the rendering thread keeps between scrapes (gateway.telemetry.exposition)."""
        yield from self._requests()
        yield from self._streams()
        yield from self._policies()
        yield from self._rollouts()
        yield from self._shadow()
        yield from self._state()

    def _state(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_store_up", "1 while the state store answers, 0 while this replica "
                               "serves from its last policies without it")
        up.add_metric([], 1.0 if self.store_up else 0.0)
        yield up
        errors = CounterMetricFamily("gateway_state_sync_errors", "Policy sync failures: unreadable stored records "
                                     "(skipped), store unreachable, internal (a sync loop crashed and restarted)",
                                     labels=["reason"])
        for reason, count in self.sync_errors.items():
            errors.add_metric([reason], count)
        yield errors
        restarts = CounterMetricFamily("gateway_background_restarts", "Background loops restarted after a crash",
                                       labels=["loop"])
        for loop, count in self.loop_restarts.items():
            restarts.add_metric([loop], count)
        yield restarts

    def _shadow(self) -> Iterator[Metric]:
        results = CounterMetricFamily("gateway_shadow_requests", "Mirrored requests by result",
                                      labels=["model", "version", "result"])
        latency = CounterMetricFamily("gateway_shadow_latency_seconds", "Total latency of mirrored requests",
                                      labels=["model", "version"])
        for (model, version), (compared, agreed, errors, dropped, latency_sum) in self.shadow:
            results.add_metric([model, version, "agree"], agreed)
            results.add_metric([model, version, "disagree"], compared - agreed)
            results.add_metric([model, version, "error"], errors)
            results.add_metric([model, version, "dropped"], dropped)
            latency.add_metric([model, version], latency_sum)
        yield results
        yield latency

    def _requests(self) -> Iterator[Metric | Keyed]:
        durations: dict[tuple[str, str, str, str], tuple[list[int], float]] = {}
        for (model, version, route, protocol, _), (_, total, hist) in self.totals:
            key = (model, version, protocol, "false" if route in STEERED_ROUTES else "true")
            summed = durations.get(key)
            if summed is None:
                durations[key] = (list(hist), total)
            else:
                durations[key] = ([a + b for a, b in zip(summed[0], hist)], summed[1] + total)
        totals = self.totals
        yield Keyed("gateway_requests", _requests_family,
                    lambda: ((label, count) for label, (count, _, _) in totals), _add_count)
        for model, version in self.watched:  # from 0, so the first judged request counts in increase()
            for protocol in ("http", "grpc"):
                durations.setdefault((model, version, protocol, "true"), ([0] * (len(LATENCY_BOUNDS) + 1), 0.0))
        yield Keyed("gateway_request_duration_seconds", _durations_family,
                    lambda: ((labelled, (tuple(hist), total)) for labelled, (hist, total) in durations.items()),
                    _add_duration)
        yield self._outcomes()
        errors = CounterMetricFamily("gateway_upstream_errors", "Upstream failures by kind",
                                     labels=["model", "version", "kind"])
        for model_version_kind, count in self.upstream_errors.items():
            errors.add_metric(list(model_version_kind), count)
        yield errors
        inflight = GaugeMetricFamily("gateway_inflight_requests", "Requests waiting on Triton now",
                                     labels=["model", "version"])
        for series, count in self.inflight.items():
            inflight.add_metric(list(series), count)
        yield inflight

    def _streams(self) -> Iterator[Metric]:
        first = HistogramMetricFamily("gateway_stream_time_to_first_response_seconds", "Streaming calls (HTTP "
                                      "generate_stream, gRPC ModelStreamInfer): seconds from the request to its "
                                      "first successful response", labels=["model", "version"])
        gap = HistogramMetricFamily("gateway_stream_response_gap_seconds", "Streaming calls: seconds between "
                                    "consecutive successful responses to one request", labels=["model", "version"])
        rows = {key: (first_totals, gap_totals) for key, first_totals, gap_totals in self.streams
                if first_totals[0] or gap_totals[0]}
        zero: Totals = (0, 0.0, (0,) * (len(LATENCY_BOUNDS) + 1))
        streaming = {model for model, _ in rows}
        for model, version in self.watched:  # from 0 once the model streams, as request durations
            if model in streaming:
                rows.setdefault((model, version), (zero, zero))
        for (model, version), ((_, first_sum, first_hist), (_, gap_sum, gap_hist)) in rows.items():
            first.add_metric([model, version], _buckets(first_hist), first_sum)
            gap.add_metric([model, version], _buckets(gap_hist), gap_sum)
        yield first
        yield gap

    def _outcomes(self) -> Keyed:
        """Per version and outcome. Every version in a policy's weights has every outcome from 0
        (one bounded set: six series per version a policy names), so its first error counts in
        increase(), which misses the first sample of a new series."""
        totals, policies, steered = self.outcomes, self.policies, self.steered

        def rows() -> Iterator[tuple[Any, Any]]:
            for (model, version), counts in totals.items():
                yield (model, version, "true"), tuple(counts.items())
            for model, policy in policies.items():
                for version in policy.spec.weights:
                    if (model, version) not in totals:
                        yield (model, version, "true"), ZERO_OUTCOMES
            for (model, version), counts in steered.items():
                yield (model, version, "false"), tuple(counts.items())

        return Keyed("gateway_version_requests", _outcomes_family, rows, _add_outcomes)

    def _policies(self) -> Iterator[Keyed]:
        policies = self.policies

        def weights() -> Iterator[tuple[Any, Any]]:
            for model, policy in policies.items():
                for version, percent in policy.spec.weights.items():
                    yield (model, version), float(percent)

        yield Keyed("gateway_route_weight", _weights_family, weights, _add_gauge)
        yield Keyed("gateway_policy_revision", _revisions_family,
                    lambda: ((model, policy.revision) for model, policy in policies.items()), _add_revision)

    def _rollouts(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("gateway_rollout_state", "1 for the rollout's current state",
                                  labels=["model", "state"])
        for model, (current, states) in self.rollout_states.items():
            for name in states:
                state.add_metric([model, name], 1.0 if name == current else 0.0)
        yield state
        rollbacks = CounterMetricFamily("gateway_rollbacks", "Automatic rollbacks, by the metric that caused them",
                                        labels=["model", "reason"])
        for (model, reason), count in self.rollbacks.items():
            rollbacks.add_metric([model, reason], count)
        yield rollbacks
        blocked = GaugeMetricFamily("gateway_rollback_blocked", "1 while a rollback waits for a stable version "
                                    "that is not READY (traffic stays where it is served)", labels=["model"])
        for model, value in self.rollback_blocked.items():
            blocked.add_metric([model], value)
        yield blocked


class GatewayCollector:
    """Reads only the two meeting points of the planes: the recorder and the policy book.

    ``/metrics`` takes a :meth:`snapshot` on the serving loop and renders it elsewhere
    (:class:`gateway.telemetry.exposition.SnapshotRegistry`); :meth:`collect` does both at
    once, for ``registry.get_sample_value`` in tests."""

    def __init__(self, recorder: Recorder, book: PolicyBook) -> None:
        self.recorder = recorder
        self.book = book

    def collect(self) -> Iterator[Metric]:
        return self.snapshot().collect()

    def snapshot(self) -> GatewaySnapshot:
        """A copy of every number ``/metrics`` shows, taken now: O(label sets), no formatting."""
        recorder = self.recorder
        return GatewaySnapshot(
            totals=[(label, (totals.count, totals.sum, tuple(totals.hist)))
                    for label, totals in recorder.totals.items()],
            outcomes=recorder.outcome_totals(), steered=recorder.steered_outcome_totals(),
            upstream_errors=dict(recorder.upstream_errors), inflight=dict(recorder.inflight),
            streams=[(key, (stream.first.count, stream.first.sum, tuple(stream.first.hist)),
                      (stream.gap.count, stream.gap.sum, tuple(stream.gap.hist)))
                     for key, stream in recorder.streams.items()],
            shadow=[(key, (stats.compared, stats.agreed, stats.errors, stats.dropped, stats.latency_sum))
                    for key, stats in recorder.shadow.items()],
            policies=self.book.snapshot(), watched=frozenset(recorder.watched()),
            rollout_states=dict(recorder.rollout_states), rollbacks=dict(recorder.rollbacks),
            rollback_blocked=dict(recorder.rollback_blocked), sync_errors=dict(recorder.sync_errors),
            loop_restarts=dict(recorder.loop_restarts), store_up=recorder.store_up)


def _requests_family() -> Metric:
    return CounterMetricFamily("gateway_requests", "Requests through the gateway, by routed version, route reason, "
                               "protocol and status code", labels=["model", "version", "route", "protocol", "code"])


def _durations_family() -> Metric:
    return HistogramMetricFamily("gateway_request_duration_seconds", "Latency through the gateway of successes and "
                                 "upstream errors; judged=\"false\": the client chose the version (routes pinned and "
                                 "rule), never judged", labels=["model", "version", "protocol", "judged"])


def _outcomes_family() -> Metric:
    return CounterMetricFamily("gateway_version_requests", "Requests per version by outcome (success, "
                               "upstream_error, client_error, rejected, overload, cancelled); judged=\"false\": the "
                               "client chose the version (routes pinned and rule), never judged",
                               labels=["model", "version", "outcome", "judged"])


def _weights_family() -> Metric:
    return GaugeMetricFamily("gateway_route_weight", "Routing weight in percent", labels=["model", "version"])


def _revisions_family() -> Metric:
    return GaugeMetricFamily("gateway_policy_revision", "Applied policy revision", labels=["model"])


def _add_count(family: CounterMetricFamily, key: tuple[str, ...], count: int) -> None:
    family.add_metric(list(key), count)
    pace()


def _add_duration(family: HistogramMetricFamily, key: tuple[str, ...], totals: tuple[tuple[int, ...], float]) -> None:
    family.add_metric(list(key), _buckets(totals[0]), totals[1])
    pace()


def _add_outcomes(family: CounterMetricFamily, key: tuple[str, str, str],
                  counts: tuple[tuple[Outcome, int], ...]) -> None:
    model, version, judged = key
    for outcome, count in counts:
        family.add_metric([model, version, outcome.value, judged], count)
        pace()


def _add_gauge(family: GaugeMetricFamily, key: tuple[str, ...], value: float) -> None:
    family.add_metric(list(key), value)
    pace()


def _add_revision(family: GaugeMetricFamily, model: str, revision: int) -> None:
    family.add_metric([model], revision)


def _buckets(hist: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of one LATENCY_BOUNDS histogram."""
    running, buckets = 0, []
    for bound, count in zip((*LATENCY_BOUNDS, float("inf")), hist):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return buckets


def make_registry(collector: GatewayCollector) -> SnapshotRegistry:
    registry = SnapshotRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry
