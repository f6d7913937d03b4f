"""The workers' own Prometheus series, on the control plane's registry (``/metrics``).

Built at scrape time from the supervisor's slots and merge cost, as ``telemetry.prometheus``
builds the recorder's families: supervising only keeps plain fields up to date.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from gateway.workers.supervisor import Supervisor


class WorkersCollector:
    """Per-worker series, only where one worker means something: up, restarts, loop lag; and
    what merging their reports cost the control plane."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gateway_worker_up", "1 while the worker's ports listen and it reports to the "
                               "control plane", labels=["worker"])
        restarts = CounterMetricFamily("gateway_worker_restarts", "Workers replaced after exiting or stalling",
                                       labels=["worker"])
        lag = GaugeMetricFamily("gateway_worker_event_loop_lag_seconds", "How late the worker's last report "
                                "timer fired: its event loop's lag", labels=["worker"])
        current = GaugeMetricFamily("gateway_worker_policy_current", "1 when the worker runs the latest policy push",
                                    labels=["worker"])
        for slot in self.supervisor.slots:
            label = [str(slot.index)]
            up.add_metric(label, 1.0 if slot.ready.is_set() else 0.0)
            restarts.add_metric(label, slot.restarts)
            lag.add_metric(label, slot.lag_s)
            current.add_metric(label, 1.0 if slot.push == self.supervisor.push else 0.0)
        cost = self.supervisor.cost
        merged = CounterMetricFamily("gateway_worker_reports", "Worker reports merged by the control plane")
        merged.add_metric([], cost.reports)
        seconds = CounterMetricFamily("gateway_worker_merge_seconds", "Seconds the control plane spent "
                                      "decoding and merging worker reports")
        seconds.add_metric([], cost.seconds)
        yield from (up, restarts, lag, current, merged, seconds)
