"""http2.stall: a stream or socket is cut for no progress, never for a long but moving wait."""

from __future__ import annotations

import asyncio
import struct

from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.endpoint import PREFACE, SETTINGS, WINDOW_UPDATE, frame
from gateway.http2.server_stream import Limits, ServerStream
from gateway.http2.stall import StallWatch
from tests.unit.test_message_copies import Keeping
from tests.unit.test_write_turns import Holder, call


def stream(stream_id: int, moved: int) -> ServerStream:
    made = ServerStream(stream_id, 65535, [], "/p", b"", 65535)
    made.moved = moved
    return made


def test_a_stream_is_due_a_bound_after_it_last_moved() -> None:
    watch = StallWatch(bound=8)
    quiet, moving = stream(1, moved=0), stream(3, moved=5)
    assert watch.streams_due([quiet, moving], now=7) == ([], 8)
    assert watch.streams_due([quiet, moving], now=8) == ([quiet], 13)
    moving.moved = 12  # the client took some: its bound starts again
    assert watch.streams_due([moving], now=19) == ([], 20)
    assert watch.streams_due([], now=19) == ([], 0)


def test_a_paused_socket_is_due_unless_its_buffer_shrinks() -> None:
    watch = StallWatch(bound=8)
    watch.paused(now=10, unsent=1 << 20)
    assert watch.socket_due(now=15, unsent=(1 << 20) + 100) == 18  # more written, nothing taken
    assert watch.socket_due(now=16, unsent=(1 << 20) - 1) == 24  # a byte taken: progress
    assert watch.socket_due(now=24, unsent=(1 << 20) - 1) == 24  # none since: due now


async def test_streams_waiting_for_the_connection_window_take_turns() -> None:
    """A stream waiting for the connection's window gets bytes of each WINDOW_UPDATE in turn with
    the others, so a client that reads slowly but reads is never starved into the stall bound by
    another stream's queue that Triton keeps refilling: here stream 1 has 1 MiB queued and gets
    refilled, and stream 3 still gets the second 16 KiB the client gives back."""
    Holder.streams = []
    connection = GrpcServerConnection(Holder, set(), Limits())
    transport = Keeping()
    connection.connection_made(transport)
    wide = frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 30))  # stream windows wide, the connection's 65,535
    connection.data_received(PREFACE + wide + call(1) + call(3))
    await asyncio.sleep(0)
    first, second = Holder.streams
    connection.send_message(first, b"x" * (1 << 20))
    connection.send_message(second, b"y" * (10 << 10))
    for _ in range(2):
        transport.pieces.clear()
        connection.data_received(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 16 << 10)))
        await asyncio.sleep(0)
        connection.send_message(first, b"x" * (16 << 10))  # Triton's next replies
    sent = bytes(b"".join(bytes(piece) for piece in transport.pieces))
    assert sent.count(b"y" * 1024) >= 1, "stream 3 got none of the window given back"
    connection.connection_lost(None)
