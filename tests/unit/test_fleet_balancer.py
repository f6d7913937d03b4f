"""The balancer and admission control on their own: no sockets are opened (servers are only built)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.errors import Overloaded, UpstreamUnavailable
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.fleet.members import Server
from gateway.grpc.upstream import GrpcUpstream
from gateway.grpc.wire import message_model_version, with_version
from gateway.sequences import SequenceFields
from tests.unit.test_idle_connections import live_timers


def fleet_of(count: int, **kwargs: object) -> tuple[Fleet, list[Server]]:
    fleet = Fleet("f", grpc_connect=GrpcUpstream, **kwargs)  # type: ignore[arg-type]
    servers = [fleet.add(ServerSpec(http=f"http://10.0.0.{i}:8000", grpc=f"10.0.0.{i}:8001")) for i in range(count)]
    for server in servers:
        server.up = server.in_service = True
        server.ready = {"qc": frozenset({"1", "2"})}
    fleet.changed()
    return fleet, servers


def test_idle_servers_share_requests_evenly() -> None:
    fleet, servers = fleet_of(2)
    picks = Counter(fleet.pick("qc", "2").name for _ in range(10_000))
    assert set(picks) == {s.name for s in servers}
    assert all(4_700 < count < 5_300 for count in picks.values()), picks


def test_one_request_more_in_flight_is_noise_and_does_not_steer() -> None:
    """A closed loop of equal servers keeps differing by one in flight; steering on it made each
    server's share follow its momentary speed (55/45 between two equal Tritons on a busy node)."""
    fleet, servers = fleet_of(2)
    servers[0].inflight = 4
    servers[1].inflight = 3
    picks = Counter(fleet.pick("qc", "2").name for _ in range(1_000))
    assert picks == Counter({servers[0].name: 500, servers[1].name: 500}), picks
    servers[1].inflight = 2  # two fewer and half as many again: a clear difference, always taken
    assert {fleet.pick("qc", "2").name for _ in range(200)} == {servers[1].name}


def test_a_relative_difference_below_half_again_does_not_steer() -> None:
    """A server k times slower holds k times the other's requests in flight when they alternate:
    up to 1.5 (the spread two equal Tritons show on a busy node) shares stay even."""
    fleet, servers = fleet_of(2)
    servers[0].inflight, servers[1].inflight = 11, 8  # 3 more, 1.375x: noise
    picks = Counter(fleet.pick("qc", "2").name for _ in range(1_000))
    assert picks == Counter({servers[0].name: 500, servers[1].name: 500}), picks
    servers[0].inflight = 12  # 1.5x: steered from
    assert {fleet.pick("qc", "2").name for _ in range(200)} == {servers[1].name}


def test_the_less_busy_of_two_wins() -> None:
    fleet, servers = fleet_of(2)
    servers[0].inflight = 5
    assert {fleet.pick("qc", "1").name for _ in range(200)} == {servers[1].name}


def test_power_of_two_spreads_over_many_and_avoids_the_busiest() -> None:
    fleet, servers = fleet_of(5)
    servers[3].inflight = 100
    picks = Counter(fleet.pick("qc", "1").name for _ in range(10_000))
    assert servers[3].name not in picks  # it loses every pair it is drawn into
    assert len(picks) == 4 and min(picks.values()) > 1_500, picks


def test_only_servers_where_the_version_is_ready() -> None:
    fleet, servers = fleet_of(3)
    servers[0].ready = {"qc": frozenset({"1", "2", "3"})}
    fleet.changed()
    assert {fleet.pick("qc", "3").name for _ in range(100)} == {servers[0].name}
    assert len({fleet.pick("qc", "2").name for _ in range(300)}) == 3
    # READY nowhere: every in-service server (Triton answers, and the version fallback applies)
    assert len({fleet.pick("qc", "9").name for _ in range(300)}) == 3


def test_out_of_service_servers_get_nothing_unless_none_is_in_service() -> None:
    fleet, servers = fleet_of(2)
    servers[0].in_service = False
    fleet.changed()
    assert {fleet.pick("qc", None).name for _ in range(100)} == {servers[1].name}
    servers[1].in_service = False
    fleet.changed()
    assert len({fleet.pick("qc", None).name for _ in range(200)}) == 2, "try anyway, fail clearly"


def test_the_retry_avoids_the_server_that_failed() -> None:
    fleet, servers = fleet_of(2)
    assert {fleet.pick("qc", "1", avoid=servers[0]).name for _ in range(100)} == {servers[1].name}
    solo, (only,) = fleet_of(1)
    with pytest.raises(UpstreamUnavailable, match="no other server"):
        solo.pick("qc", "1", avoid=only)


def test_consecutive_transport_failures_eject_and_a_success_resets_the_count() -> None:
    fleet, servers = fleet_of(2, eject_after=3)
    fleet.failed(servers[0], "refused")
    fleet.failed(servers[0], "refused")
    servers[0].failures = 0  # what a successful exchange does
    fleet.failed(servers[0], "refused")
    fleet.failed(servers[0], "refused")
    assert servers[0].in_service and not servers[0].ejected
    fleet.failed(servers[0], "refused")
    assert servers[0].ejected and not servers[0].in_service and servers[0].ejections == 1
    assert {fleet.pick("qc", "1").name for _ in range(100)} == {servers[1].name}


def test_messages_name_their_model_and_version() -> None:
    message = bytes([0x0A, 2]) + b"qc" + bytes([0x3A, 1, 0])  # model_name, then a field 7
    assert message_model_version(message) == (b"qc", None)
    assert message_model_version(with_version(message, "12")) == (b"qc", b"12")
    pinned = bytes([0x0A, 2]) + b"qc" + bytes([0x12, 1]) + b"3" + bytes([0x22, 1, 0]) + bytes([0x3A, 1, 0])
    assert message_model_version(pinned) == (b"qc", b"3")
    assert message_model_version(b"") == (b"", None)


def test_wire_keys_and_names_reach_the_same_servers() -> None:
    fleet, servers = fleet_of(2)
    servers[1].ready = {"qc": frozenset({"1", "2", "3"})}
    fleet.changed()
    assert {fleet.pick(b"qc", b"3").name for _ in range(50)} == {fleet.pick("qc", "3").name} == {servers[1].name}


async def test_admission_queues_then_refuses() -> None:
    fleet, (server,) = fleet_of(1, max_inflight=2, queue_timeout_s=0.2)
    assert await fleet.admit(server, "qc", "1", 60.0) is server
    assert await fleet.admit(server, "qc", "1", 60.0) is server
    assert server.inflight == 2
    waiting = asyncio.ensure_future(fleet.admit(server, "qc", "1", 60.0))
    await asyncio.sleep(0.01)
    assert not waiting.done() and len(server.waiters) == 1
    server.release()  # the slot passes to the waiter: in flight stays at the limit
    assert await waiting is server and server.inflight == 2
    with pytest.raises(Overloaded, match="limit of 2 .* queue wait"):
        await fleet.admit(server, "qc", "1", 60.0)  # nobody releases: refused after the queue wait (shedding)
    assert server.refused == 1 and server.inflight == 2 and not [w for w in server.waiters if not w.done()]
    server.release()
    server.release()
    assert server.inflight == 0


async def test_admission_without_a_queue_refuses_at_once_and_prefers_a_server_with_room() -> None:
    fleet, servers = fleet_of(2, max_inflight=1, queue_timeout_s=0.0)
    first = await fleet.admit(servers[0], "qc", "1", 60.0)
    second = await fleet.admit(servers[0], "qc", "1", 60.0)
    assert {first, second} == set(servers)
    with pytest.raises(Overloaded):
        await fleet.admit(servers[0], "qc", "1", 60.0)


async def test_a_queued_caller_that_goes_away_passes_its_slot_on() -> None:
    fleet, (server,) = fleet_of(1, max_inflight=1, queue_timeout_s=5.0)
    await fleet.admit(server, "qc", "1", 60.0)
    gone = asyncio.ensure_future(fleet.admit(server, "qc", "1", 60.0))
    staying = asyncio.ensure_future(fleet.admit(server, "qc", "1", None))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    assert len(server.waiters) == 1, "a caller that left leaves the queue"
    server.release()
    assert await staying is server and server.inflight == 1


async def test_without_shedding_the_queue_holds_every_client_and_serves_them_in_order() -> None:
    """The default (no queue_timeout_ms): the queue is as long as the clients make it, not
    max_inflight; each waits until a slot frees or its own deadline, first come first served."""
    fleet, (server,) = fleet_of(1, max_inflight=1)
    await fleet.admit(server, "qc", "1", 60.0)
    waiting = [asyncio.ensure_future(fleet.admit(server, "qc", "1", 60.0)) for _ in range(50)]
    await asyncio.sleep(0.01)
    assert len(server.waiters) == 50 and not any(w.done() for w in waiting), "50 waiting behind a limit of 1"
    for served in range(50):
        server.release()
        assert await asyncio.wait_for(waiting[served], 1) is server
        assert not any(w.done() for w in waiting[served + 1:]), "in order"
    assert server.inflight == 1 and server.refused == 0
    expiring = asyncio.ensure_future(fleet.admit(server, "qc", "1", 0.05))
    with pytest.raises(Overloaded, match="deadline ran out"):
        await expiring  # its own deadline, not a queue bound, ends its wait
    assert server.refused == 1 and not server.waiters


async def test_a_freed_slot_wakes_its_queued_request_on_the_next_loop_turn() -> None:
    """At 1,000 HTTP connections nearly every request queues for a slot, so what a wait costs is
    paid per request: the queued request's own task awaits its waiter (one wake-up, one future;
    its deadline is kept under the queue's one timer). ``wait_for`` over a ``shield`` took three loop turns and three
    more futures per queued request (a tenth of the gateway's CPU at 1,000 connections)."""
    fleet, (server,) = fleet_of(1, max_inflight=1)
    await fleet.admit(server, "qc", "1", 60.0)
    loop = asyncio.get_running_loop()
    futures = 0
    create_future = loop.create_future

    def counted() -> asyncio.Future[object]:
        nonlocal futures
        futures += 1
        return create_future()

    loop.create_future = counted  # type: ignore[method-assign]
    try:
        waiting = [asyncio.ensure_future(fleet.admit(server, "qc", "1", 60.0)) for _ in range(100)]
        await asyncio.sleep(0)
        assert len(server.waiters) == 100
        turns = []
        for queued in waiting:
            server.release()
            turn = 0
            while not queued.done():
                await asyncio.sleep(0)
                turn += 1
            turns.append(turn)
    finally:
        del loop.create_future
    assert turns == [1] * 100, f"loop turns from a freed slot to its request running on: {sorted(set(turns))}"
    assert futures == 100, f"{futures} futures for 100 queued requests"
    assert server.inflight == 1 and not server.waiters


async def test_queued_deadlines_share_one_timer_and_each_ends_at_its_own() -> None:
    """A timer armed and cancelled per queued request cost ~2 µs of each request at 1,000
    connections: the queue keeps its waiters' deadlines under one timer, re-armed when a shorter
    deadline comes in or when it fires, and each waiter still ends at its own deadline."""
    fleet, (server,) = fleet_of(1, max_inflight=1)
    await fleet.admit(server, "qc", "1", 60.0)
    loop = asyncio.get_running_loop()
    before = live_timers(loop)
    ended: list[float] = []
    waits = {timeout: asyncio.ensure_future(fleet.admit(server, "qc", "1", timeout))
             for timeout in (0.3, 60, 0.05, 0.15)}
    for timeout, wait in waits.items():
        wait.add_done_callback(lambda _, timeout=timeout: ended.append(timeout))  # type: ignore[misc]
    await asyncio.sleep(0)
    assert len(server.waiters) == 4 and live_timers(loop) - before == 1, "one timer for the queue's four deadlines"
    for timeout in (0.05, 0.15, 0.3):
        with pytest.raises(Overloaded, match="deadline ran out"):
            await waits[timeout]
    assert ended == [0.05, 0.15, 0.3] and not waits[60].done(), "each at its own deadline, the shortest first"
    server.release()
    assert await waits[60] is server and server.inflight == 1 and not server.waiters
    await fleet.aclose()
    assert live_timers(loop) == before, "the queue's timer goes with the fleet"


def test_a_slot_is_released_once_whoever_releases_it() -> None:
    """The upstream connection gives a slot back as the answer arrives; the request's own way out
    releases it again: only the first counts."""
    fleet, (server,) = fleet_of(1, max_inflight=4)
    server.inflight = 2
    slot = server.admitted()
    slot.release()
    slot.release()
    assert server.inflight == 1


def test_a_sequence_stays_on_its_server_until_it_ends() -> None:
    fleet, servers = fleet_of(2)
    started = fleet.pick_in_sequence("qc", "2", SequenceFields(7, start=True, client="10.0.0.1"))
    started.inflight = 50  # busy: the balancer would never pick it, the sequence still goes there
    assert all(fleet.pick_in_sequence("qc", "2", SequenceFields(7)) is started for _ in range(5))
    assert fleet.pick_in_sequence("qc", "2", SequenceFields(7, end=True)) is started
    started.inflight = 0
    assert len(fleet.sequences) == 0, "the end let the pin go"
    first = fleet.pick_in_sequence("qc", "2", SequenceFields(8, start=True, client="10.0.0.1"))
    other = servers[1] if first is servers[0] else servers[0]
    first.in_service = False  # its server left: the next request pins another, for the start's client
    fleet.changed()
    assert fleet.pick_in_sequence("qc", "2", SequenceFields(8, client="10.6.6.6")) is other
    assert fleet.sequences.held_by("10.0.0.1") == 1 and fleet.sequences.held_by("10.6.6.6") == 0


def test_one_clients_sequence_starts_evict_its_own_server_pins_never_another_clients() -> None:
    """Issue 22: the fleet's pin table was a plain LRU of 100,000 (pins without an owner), so one
    client's starts pushed every other client's sequence off its server (Triton then fails the
    continuation: "must specify the START flag"). Now its pins are held to the client's quota."""
    fleet, servers = fleet_of(2, max_sequence_pins=100, max_sequence_pins_per_client=10)
    victim = fleet.pick_in_sequence("qc", "2", SequenceFields("victim", start=True, client="10.0.0.1"))
    for sequence_id in range(1_000):
        fleet.pick_in_sequence("qc", "2", SequenceFields(sequence_id, start=True, client="10.6.6.6"))
    victim.inflight = 50  # the balancer alone would send it to the other server
    assert fleet.pick_in_sequence("qc", "2", SequenceFields("victim", client="10.0.0.1")) is victim
    assert fleet.sequences.held_by("10.6.6.6") == 10 and len(fleet.sequences) == 11


def test_a_continuation_keeps_the_starts_owner_and_made_up_ones_count_against_their_sender() -> None:
    """A continuing request used to pin again with no owner on every request; now a live pin is
    only refreshed (still the start's), and a continuation with no pin (made up, or its pin
    lost) pins against its own client's quota: it cannot push another client's pin out either."""
    fleet, servers = fleet_of(2, max_sequence_pins=100, max_sequence_pins_per_client=10)
    victim = fleet.pick_in_sequence("qc", "2", SequenceFields("victim", start=True, client="10.0.0.1"))
    fleet.pick_in_sequence("qc", "2", SequenceFields("victim", client="10.6.6.6"))  # anyone may continue it
    assert fleet.sequences.held_by("10.0.0.1") == 1 and fleet.sequences.held_by("10.6.6.6") == 0
    for sequence_id in range(1_000):
        fleet.pick_in_sequence("qc", "2", SequenceFields(sequence_id, client="10.6.6.6"))
    victim.inflight = 50
    assert fleet.pick_in_sequence("qc", "2", SequenceFields("victim", client="10.0.0.1")) is victim
    assert fleet.sequences.held_by("10.6.6.6") == 10 and len(fleet.sequences) == 11
    lost = fleet.pick_in_sequence("qc", "2", SequenceFields("lost", client="10.0.0.2"))
    lost.inflight += 100
    assert fleet.pick_in_sequence("qc", "2", SequenceFields("lost")) is lost, "its pin keeps the rest together"


def test_the_fleets_pin_table_takes_the_sequence_pin_settings() -> None:
    from gateway.fleet.config import FleetSpec
    from gateway.fleet.registry import Fleets

    spec = FleetSpec.model_validate({"servers": [{"http": "http://10.0.0.1:8000", "grpc": "10.0.0.1:8001"}]})
    fleets = Fleets({"default": spec}, grpc_connect=GrpcUpstream, max_sequence_pins=7,
                    max_sequence_pins_per_client=3)
    assert (fleets.default.sequences.max_entries, fleets.default.sequences.max_per_client) == (7, 3)
