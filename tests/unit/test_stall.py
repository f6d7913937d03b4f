"""http2.stall: a stream or socket is cut for no progress, never for a long but moving wait."""

from __future__ import annotations

from gateway.http2.server_stream import ServerStream
from gateway.http2.stall import StallWatch


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
