"""Per-server fleet counters over every worker: what ``/admin/fleets``, the console and
``gateway_fleet_server_*`` show with ``--workers N``.

Each worker's servers count their own requests, errors, ejections and refusals (plain
attributes bumped on the hot path, as with one process). With its recorder delta, every
250 ms, a worker sends the increments since its last report and its current in-flight count
(:class:`ServerCounts`). The control plane adds the increments into its own server objects,
which carry no data-plane traffic of their own, and sets their ``inflight`` to the sum of the
workers' latest counts (:class:`FleetSums`), so every reader of the control plane's fleets
sees the node's totals without knowing about workers. Health (up, ejected, in service, READY
versions) stays the control plane's own view: it runs its own health checks.
"""

from __future__ import annotations

from gateway.fleet.members import Server
from gateway.fleet.registry import Fleets

ServerKey = tuple[str, str]  # (fleet, server)
# requests, errors, ejections, refused: increments since the last report; then in flight now
ServerReport = tuple[int, int, int, int, int]


def _counts(server: Server) -> tuple[int, int, int, int]:
    return server.requests, server.errors, server.ejections, server.refused


class ServerCounts:
    """A worker's side: its servers' counters since the previous :meth:`take`."""

    def __init__(self, fleets: Fleets) -> None:
        self.fleets = fleets
        self._sent: dict[ServerKey, tuple[int, int, int, int]] = {}
        self._busy: set[ServerKey] = set()  # reported with requests in flight last time: their 0 is reported once

    def take(self) -> dict[ServerKey, ServerReport]:
        report: dict[ServerKey, ServerReport] = {}
        for fleet in self.fleets:
            for server in list(fleet.servers.values()):
                key = (fleet.name, server.name)
                now = _counts(server)
                before = self._sent.get(key, (0, 0, 0, 0))
                self._sent[key] = now
                if now != before or server.inflight or key in self._busy:
                    report[key] = (now[0] - before[0], now[1] - before[1], now[2] - before[2], now[3] - before[3],
                                   server.inflight)
        self._busy = {key for key, counts in report.items() if counts[4]}
        return report


class FleetSums:
    """The control plane's side: every worker's reports added into its own fleets' servers."""

    def __init__(self, fleets: Fleets) -> None:
        self.fleets = fleets
        self._inflight: dict[int, dict[ServerKey, int]] = {}  # per worker (pid): its latest in-flight counts

    def merge(self, worker: int, report: dict[ServerKey, ServerReport]) -> None:
        inflight = self._inflight.setdefault(worker, {})
        for (fleet_name, name), (requests, errors, ejections, refused, now) in report.items():
            fleet = self.fleets.fleets.get(fleet_name)
            server = fleet.servers.get(name) if fleet is not None else None
            if server is None:
                continue  # a DNS fleet's server the control plane no longer lists
            server.requests += requests
            server.errors += errors
            server.ejections += ejections
            server.refused += refused
            if now:
                inflight[(fleet_name, name)] = now
            else:
                inflight.pop((fleet_name, name), None)
        self._sum()

    def forget(self, worker: int) -> None:
        """A worker (by pid) is gone: its requests are no longer in flight (its counts stay)."""
        if self._inflight.pop(worker, None):
            self._sum()

    def _sum(self) -> None:
        for fleet in self.fleets:
            for server in fleet.servers.values():
                server.inflight = sum(counts.get((fleet.name, server.name), 0) for counts in self._inflight.values())
