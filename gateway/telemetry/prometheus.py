"""``/metrics``: the recorder's totals exported at scrape time.

The hot path never calls prometheus-client (a labelled ``inc()`` costs microseconds per
request); it bumps plain counters in the recorder, and this collector turns them into
metric families when Prometheus scrapes. Each app has its own ``CollectorRegistry``.
Label cardinality is bounded: no user ids or raw paths, and model names Triton does not
know collapse into one ``_unknown`` label.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from gateway.policy_book import PolicyBook
from gateway.telemetry.recorder import LATENCY_BOUNDS, OUTCOMES, STEERED_ROUTES, Recorder


class GatewayCollector:
    """Reads only the two meeting points of the planes: the recorder and the policy book."""

    def __init__(self, recorder: Recorder, book: PolicyBook) -> None:
        self.recorder = recorder
        self.book = book

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._streams()
        yield from self._policies()
        yield from self._rollouts()
        yield from self._shadow()
        yield from self._state()

    def _state(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_store_up", "1 while the state store answers, 0 while this replica "
                               "serves from its last policies without it")
        up.add_metric([], 1.0 if self.recorder.store_up else 0.0)
        yield up
        errors = CounterMetricFamily("gateway_state_sync_errors", "Policy sync failures: unreadable stored records "
                                     "(skipped), store unreachable, internal (a sync loop crashed and restarted)",
                                     labels=["reason"])
        for reason, count in list(self.recorder.sync_errors.items()):
            errors.add_metric([reason], count)
        yield errors
        restarts = CounterMetricFamily("gateway_background_restarts", "Background loops restarted after a crash",
                                       labels=["loop"])
        for loop, count in list(self.recorder.loop_restarts.items()):
            restarts.add_metric([loop], count)
        yield restarts

    def _shadow(self) -> Iterator[Metric]:
        results = CounterMetricFamily("gateway_shadow_requests", "Mirrored requests by result",
                                      labels=["model", "version", "result"])
        for (model, version), stats in list(self.recorder.shadow.items()):
            results.add_metric([model, version, "agree"], stats.agreed)
            results.add_metric([model, version, "disagree"], stats.compared - stats.agreed)
            results.add_metric([model, version, "error"], stats.errors)
            results.add_metric([model, version, "dropped"], stats.dropped)
        yield results
        latency = CounterMetricFamily("gateway_shadow_latency_seconds", "Total latency of mirrored requests",
                                      labels=["model", "version"])
        for (model, version), stats in list(self.recorder.shadow.items()):
            latency.add_metric([model, version], stats.latency_sum)
        yield latency

    def _requests(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("gateway_requests", "Requests through the gateway, by routed version, "
                                       "route reason, protocol and status code",
                                       labels=["model", "version", "route", "protocol", "code"])
        durations: dict[tuple[str, str, str, str], tuple[list[int], float]] = {}
        for (model, version, route, protocol, code), totals in list(self.recorder.totals.items()):
            requests.add_metric([model, version, route, protocol, code], totals.count)
            key = (model, version, protocol, "false" if route in STEERED_ROUTES else "true")
            hist, total = durations.get(key, ([0] * len(totals.hist), 0.0))
            durations[key] = ([a + b for a, b in zip(hist, totals.hist)], total + totals.sum)
        yield requests
        routed = self._routed_versions()
        for model, version in routed:  # from 0, so the first judged request counts in increase()
            for protocol in ("http", "grpc"):
                durations.setdefault((model, version, protocol, "true"), ([0] * (len(LATENCY_BOUNDS) + 1), 0.0))
        histogram = HistogramMetricFamily("gateway_request_duration_seconds", "Latency through the gateway of "
                                          "successes and upstream errors; judged=\"false\": the client chose the "
                                          "version (routes pinned and rule), never judged",
                                          labels=["model", "version", "protocol", "judged"])
        for labelled, (hist, total) in durations.items():
            histogram.add_metric(list(labelled), _buckets(hist), total)
        yield histogram
        yield self._outcomes(routed)
        errors = CounterMetricFamily("gateway_upstream_errors", "Upstream failures by kind",
                                     labels=["model", "version", "kind"])
        for model_version_kind, count in list(self.recorder.upstream_errors.items()):
            errors.add_metric(list(model_version_kind), count)
        yield errors
        inflight = GaugeMetricFamily("gateway_inflight_requests", "Requests waiting on Triton now",
                                     labels=["model", "version"])
        for series, count in list(self.recorder.inflight.items()):
            inflight.add_metric(list(series), count)
        yield inflight

    def _streams(self) -> Iterator[Metric]:
        first = HistogramMetricFamily("gateway_stream_time_to_first_response_seconds", "Streaming calls (HTTP "
                                      "generate_stream, gRPC ModelStreamInfer): seconds from the request to its "
                                      "first successful response", labels=["model", "version"])
        gap = HistogramMetricFamily("gateway_stream_response_gap_seconds", "Streaming calls: seconds between "
                                    "consecutive successful responses to one request", labels=["model", "version"])
        rows = {key: ((stream.first.hist, stream.first.sum), (stream.gap.hist, stream.gap.sum))
                for key, stream in list(self.recorder.streams.items()) if stream.first.count or stream.gap.count}
        zero, streaming = ([0] * (len(LATENCY_BOUNDS) + 1), 0.0), {model for model, _ in rows}
        for model, version in self._routed_versions():  # from 0 once the model streams, as request durations
            if model in streaming:
                rows.setdefault((model, version), (zero, zero))
        for (model, version), ((first_hist, first_sum), (gap_hist, gap_sum)) in rows.items():
            first.add_metric([model, version], _buckets(first_hist), first_sum)
            gap.add_metric([model, version], _buckets(gap_hist), gap_sum)
        yield first
        yield gap

    def _routed_versions(self) -> set[tuple[str, str]]:
        return {(model, version) for model, policy in self.book.snapshot().items() for version in policy.spec.weights}

    def _outcomes(self, routed: set[tuple[str, str]]) -> Metric:
        """Per version and outcome, every outcome from 0 for every routed version: a version's
        first error then counts in increase(), which misses the first sample of a new series."""
        family = CounterMetricFamily("gateway_version_requests", "Requests per version by outcome (success, "
                                     "upstream_error, client_error, overload, cancelled); judged=\"false\": the "
                                     "client chose the version (routes pinned and rule), never judged",
                                     labels=["model", "version", "outcome", "judged"])
        totals = self.recorder.outcome_totals()
        for key in routed:
            totals.setdefault(key, dict.fromkeys(OUTCOMES, 0))
        for judged, rows in (("true", totals), ("false", self.recorder.steered_outcome_totals())):
            for (model, version), counts in rows.items():
                for outcome, count in counts.items():
                    family.add_metric([model, version, outcome.value, judged], count)
        return family

    def _policies(self) -> Iterator[Metric]:
        weights = GaugeMetricFamily("gateway_route_weight", "Routing weight in percent", labels=["model", "version"])
        revisions = GaugeMetricFamily("gateway_policy_revision", "Applied policy revision", labels=["model"])
        for model, policy in self.book.snapshot().items():
            revisions.add_metric([model], policy.revision)
            for version, percent in policy.spec.weights.items():
                weights.add_metric([model, version], float(percent))
        yield weights
        yield revisions

    def _rollouts(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("gateway_rollout_state", "1 for the rollout's current state",
                                  labels=["model", "state"])
        for model, (current, states) in list(self.recorder.rollout_states.items()):
            for name in states:
                state.add_metric([model, name], 1.0 if name == current else 0.0)
        yield state
        rollbacks = CounterMetricFamily("gateway_rollbacks", "Automatic rollbacks, by the metric that caused them",
                                        labels=["model", "reason"])
        for (model, reason), count in list(self.recorder.rollbacks.items()):
            rollbacks.add_metric([model, reason], count)
        yield rollbacks
        blocked = GaugeMetricFamily("gateway_rollback_blocked", "1 while a rollback waits for a stable version "
                                    "that is not READY (traffic stays where it is served)", labels=["model"])
        for model, value in list(self.recorder.rollback_blocked.items()):
            blocked.add_metric([model], value)
        yield blocked


def _buckets(hist: list[int]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of one LATENCY_BOUNDS histogram."""
    running, buckets = 0, []
    for bound, count in zip((*LATENCY_BOUNDS, float("inf")), hist):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return buckets


def make_registry(collector: GatewayCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
