"""Workers' fleet counters: what the control plane's servers show is the sum over workers."""

from __future__ import annotations

from gateway.fleet.config import FleetSpec, ServerSpec
from gateway.fleet.registry import Fleets
from gateway.grpc.upstream import GrpcUpstream
from gateway.workers.fleet_counts import FleetSums, ServerCounts

SPECS = [ServerSpec(http="http://127.0.0.1:18001", grpc="127.0.0.1:18002"),
         ServerSpec(http="http://127.0.0.1:18003", grpc="127.0.0.1:18004")]


def fleets(*specs: ServerSpec) -> Fleets:
    """Fleets with these servers added (as the health monitor adds them once it starts)."""
    built = Fleets({"default": FleetSpec(servers=SPECS)}, grpc_connect=GrpcUpstream)
    for spec in specs or SPECS:
        built.default.add(spec)
    return built


def test_the_control_plane_servers_read_the_sum_of_every_workers_counts_and_in_flight() -> None:
    workers, control = [fleets(), fleets()], fleets()
    takers, sums = [ServerCounts(worker) for worker in workers], FleetSums(control)
    first, second = (list(worker.default.servers.values()) for worker in workers)
    first[0].requests, first[0].errors, first[0].inflight = 7, 1, 3
    second[0].requests, second[0].refused, second[0].inflight = 5, 2, 4
    second[1].requests, second[1].ejections = 11, 1
    for pid, taker in enumerate(takers):
        sums.merge(pid, taker.take())
    a, b = control.default.servers.values()
    assert (a.requests, a.errors, a.refused, a.inflight) == (12, 1, 2, 7)
    assert (b.requests, b.ejections, b.inflight) == (11, 1, 0)

    first[0].requests, first[0].inflight = 9, 0  # two more, and nothing in flight any more
    sums.merge(0, takers[0].take())
    assert (a.requests, a.inflight) == (14, 4)
    assert takers[0].take() == {}  # nothing changed: nothing sent (the 0 in flight went once)
    sums.forget(1)  # worker 1 died: its requests are no longer in flight, its counts stay
    assert (a.requests, a.inflight, b.requests) == (14, 0, 11)


def test_a_server_the_control_plane_does_not_list_is_skipped() -> None:
    worker, control = fleets(), fleets(SPECS[0])
    for server in worker.default.servers.values():
        server.requests = 3
    FleetSums(control).merge(0, ServerCounts(worker).take())
    assert [s.requests for s in control.default.servers.values()] == [3]
