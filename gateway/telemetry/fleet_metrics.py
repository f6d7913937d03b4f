"""``/metrics`` per Triton server of every fleet: up, in flight, queued, requests, errors, ejections, refusals.

Read at scrape time from the servers' plain counters (the hot path only bumps attributes).
Labels: fleet and server (its HTTP host:port); a DNS fleet's servers come and go with the
pods behind its name, so the series are bounded by the fleet sizes.

Telemetry reads the fleets through the two small views below (what it exports, nothing more);
it does not import the fleet package, which sits on the data plane's upstream side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class ServerCounters(Protocol):
    """One server's plain counters, as ``gateway.fleet.members.Server`` keeps them."""

    @property
    def name(self) -> str: ...
    @property
    def in_service(self) -> bool: ...
    @property
    def inflight(self) -> int: ...
    @property
    def waiters(self) -> Sized: ...
    @property
    def requests(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def ejections(self) -> int: ...
    @property
    def refused(self) -> int: ...


class FleetView(Protocol):
    """A fleet's name and servers, as ``gateway.fleet.balancer.Fleet`` has them."""

    @property
    def name(self) -> str: ...
    @property
    def servers(self) -> Mapping[str, ServerCounters]: ...


class FleetCollector:
    def __init__(self, fleets: Iterable[FleetView]) -> None:
        self.fleets = fleets

    def collect(self) -> Iterator[Metric]:
        labels = ["fleet", "server"]
        up = GaugeMetricFamily("gateway_fleet_server_up", "1 when the server is in service (healthy, its fleet's "
                               "versions loaded, not ejected)", labels=labels)
        inflight = GaugeMetricFamily("gateway_fleet_server_inflight", "Admitted requests in flight", labels=labels)
        queued = GaugeMetricFamily("gateway_fleet_server_queued", "Requests waiting for an admission slot",
                                   labels=labels)
        requests = CounterMetricFamily("gateway_fleet_server_requests", "Requests sent to the server", labels=labels)
        errors = CounterMetricFamily("gateway_fleet_server_errors", "Transport failures and 5xx answers",
                                     labels=labels)
        ejections = CounterMetricFamily("gateway_fleet_server_ejections", "Passive ejections (consecutive connect "
                                        "or transport failures)", labels=labels)
        refused = CounterMetricFamily("gateway_fleet_server_refused", "Requests refused by admission control "
                                      "(429 / RESOURCE_EXHAUSTED)", labels=labels)
        for fleet in self.fleets:
            for server in list(fleet.servers.values()):
                values = [fleet.name, server.name]
                up.add_metric(values, 1.0 if server.in_service else 0.0)
                inflight.add_metric(values, server.inflight)
                queued.add_metric(values, len(server.waiters))
                requests.add_metric(values, server.requests)
                errors.add_metric(values, server.errors)
                ejections.add_metric(values, server.ejections)
                refused.add_metric(values, server.refused)
        yield from (up, inflight, queued, requests, errors, ejections, refused)
