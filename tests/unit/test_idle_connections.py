"""Idle connections are free (issue 37): 5,000 idle client connections on either port hold no
timer of their own, counted on the event loop's timer heap (asyncio's, which pytest-asyncio
runs: ``loop._scheduled``). A timer per connection, re-armed every second, cost 43-57 ms of
CPU a second at 5,000 idle gRPC connections; the HTTP port armed one per answer for
keep-alive. The loop's one sweep (``gateway.sweep``) holds them all; the bounds themselves
are proven end to end in tests/abuse (test_timeouts, test_http_port)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.endpoint import PREFACE, SETTINGS, frame
from gateway.http2.server_stream import Limits, ServerStream
from gateway.http_front import protocol_for
from gateway.settings import Settings
from gateway.sweep import Sweep
from tests.unit.test_http2_fuzz import Transport

IDLE = 5_000


class PeerTransport(Transport):
    """The fuzz tests' transport, from a client address of its own (per-client caps stay out of the way)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.peer = (f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}", 40000)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "sockname": ("127.0.0.1", 8081)}.get(name, default)


def live_timers(loop: asyncio.AbstractEventLoop) -> int:
    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]
    return len([timer for timer in scheduled if not timer.cancelled()])


def no_handler(connection: GrpcServerConnection, stream: ServerStream) -> None:
    return None


async def test_five_thousand_idle_grpc_connections_hold_no_timer_of_their_own() -> None:
    loop = asyncio.get_running_loop()
    before = live_timers(loop)
    connections: set[GrpcServerConnection] = set()
    limits = Limits(max_connections=2 * IDLE)
    opened = []
    for index in range(IDLE):
        connection = GrpcServerConnection(no_handler, connections, limits)
        connection.connection_made(PeerTransport(index))
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0))
        opened.append(connection)
    try:
        assert len(connections) == IDLE, "every connection was admitted"
        assert live_timers(loop) - before <= 1, "the loop's one sweep, not a timer per connection"
        assert Sweep.of(loop).filed == IDLE, "each is filed once, for its earliest bound"
    finally:
        for connection in opened:
            connection.connection_lost(None)
    assert Sweep.of(loop).filed == 0, "a closed connection leaves the sweep"


async def ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_five_thousand_kept_alive_http_connections_hold_no_timer_of_their_own() -> None:
    """Each connection made one request and was answered: it waits, kept alive, for the next."""
    loop = asyncio.get_running_loop()
    before = live_timers(loop)
    settings = Settings.load(None, max_client_connections=2 * IDLE, max_connections_per_client=2 * IDLE)
    config = Config(app=ok, lifespan="off", timeout_keep_alive=settings.keep_alive_timeout_s, log_level="warning")
    config.load()
    state = ServerState()
    protocol = protocol_for(settings)
    opened = []
    for index in range(IDLE):
        connection = protocol(config=config, server_state=state, app_state={}, _loop=loop)
        connection.connection_made(PeerTransport(index))
        connection.data_received(b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n")
        opened.append(connection)
    await asyncio.wait_for(asyncio.gather(*state.tasks), 30)
    await asyncio.sleep(0)  # the answers' writes, joined per loop turn, go out
    try:
        assert state.total_requests == IDLE, "every connection was answered and is kept alive"
        assert all(b"200 OK" in connection._raw.written for connection in opened)  # type: ignore[attr-defined]
        assert live_timers(loop) - before <= 1, "no keep-alive timer per answer: the loop's one sweep"
    finally:
        for connection in opened:
            connection.connection_lost(None)


@pytest.mark.parametrize("ticks", [1, 3, 40])
async def test_a_filed_connection_is_visited_once_on_its_tick(ticks: int) -> None:
    """The wheel itself, on a clock moved by hand: a connection is visited on its tick (a late
    run catches up every tick it missed), once; filing it again moves it; a closed one is not."""
    clock = [1000]

    class HandClock(Sweep):
        __slots__ = ()

        def _now(self) -> int:
            return clock[0]

    sweep = HandClock(asyncio.get_running_loop())
    visits: list[tuple[str, int]] = []

    class Item:
        sweep_due = 0

        def __init__(self, name: str) -> None:
            self.name = name

        def swept(self) -> None:
            visits.append((self.name, sweep.tick))

    item, moved, closed = Item("item"), Item("moved"), Item("closed")
    for each in (item, moved, closed):
        sweep.at(each, ticks)
    sweep.at(moved, ticks + 5)
    sweep.cancel(closed)
    try:
        clock[0] += ticks - 1
        sweep._run()
        assert not visits and sweep.filed == 2, "nothing is due before its tick"
        clock[0] += 3  # the loop ran late: the tick it missed is visited all the same
        sweep._run()
        assert visits == [("item", 1000 + ticks + 2)] and sweep.filed == 1
        clock[0] += 10
        sweep._run()
        assert visits == [("item", 1000 + ticks + 2), ("moved", 1000 + ticks + 12)] and sweep.filed == 0
        assert sweep._timer is None, "nothing filed: no timer"
    finally:
        if sweep._timer is not None:
            sweep._timer.cancel()
