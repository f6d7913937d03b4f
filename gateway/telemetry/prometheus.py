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
from gateway.telemetry.recorder import LATENCY_BOUNDS, Recorder


class GatewayCollector:
    """Reads only the two meeting points of the planes: the recorder and the policy book."""

    def __init__(self, recorder: Recorder, book: PolicyBook) -> None:
        self.recorder = recorder
        self.book = book

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._policies()
        yield from self._rollouts()
        yield from self._shadow()

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
        durations: dict[tuple[str, str, str], tuple[list[int], float]] = {}
        for (model, version, route, protocol, code), totals in list(self.recorder.totals.items()):
            requests.add_metric([model, version, route, protocol, code], totals.count)
            hist, total = durations.get((model, version, protocol), ([0] * len(totals.hist), 0.0))
            durations[(model, version, protocol)] = ([a + b for a, b in zip(hist, totals.hist)], total + totals.sum)
        yield requests
        histogram = HistogramMetricFamily("gateway_request_duration_seconds", "Request latency through the gateway",
                                          labels=["model", "version", "protocol"])
        for labels, (hist, total) in durations.items():
            running, buckets = 0, []
            for bound, count in zip((*LATENCY_BOUNDS, float("inf")), hist):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            histogram.add_metric(list(labels), buckets, total)
        yield histogram
        errors = CounterMetricFamily("gateway_upstream_errors", "Upstream failures by kind",
                                     labels=["model", "version", "kind"])
        for key, count in list(self.recorder.upstream_errors.items()):
            errors.add_metric(list(key), count)
        yield errors
        inflight = GaugeMetricFamily("gateway_inflight_requests", "Requests waiting on Triton now",
                                     labels=["model", "version"])
        for series, count in list(self.recorder.inflight.items()):
            inflight.add_metric(list(series), count)
        yield inflight

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


def make_registry(collector: GatewayCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
