"""Fuzzing the HTTP/2 server's frame parser: random and mutated frame sequences, split anywhere.

Whatever arrives, no exception escapes ``data_received``, and the connection ends in a defined
state: either closed after a GOAWAY, with every stream dropped, or open with consistent
bookkeeping (reservations add up, windows never negative, no more streams than advertised).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import hpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.endpoint import PREFACE, frame
from gateway.http2.server_stream import Limits, ServerStream

LIMITS = Limits(max_concurrent_streams=4, stream_window=65535, connection_window=65535 * 2, max_frame=16384,
                max_header_list=1024, max_message=4096)


class Connection(GrpcServerConnection):
    """The server, noting a GOAWAY from the client (after which closing is its right)."""

    peer_said_goodbye = False

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.peer_said_goodbye = True
        super()._on_goaway(last_stream_id, code)


class Transport(asyncio.Transport):
    """Just enough transport to watch what the server writes and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.eof = False  # half-closed by the server (its lingering close after a connection error)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof:
            raise RuntimeError("Cannot call write() after write_eof()")  # as asyncio's and uvloop's transports do
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class Handler:
    """Answers each request once it is whole, as the gRPC front does."""

    streaming = False

    def __init__(self, connection: GrpcServerConnection, stream: ServerStream) -> None:
        self.connection, self.stream, self.messages = connection, stream, 0

    def on_message(self, message: bytes | bytearray) -> None:
        self.messages += 1

    def on_end(self) -> None:
        self.connection.reply(self.stream, b"answer")

    def on_reset(self) -> None:
        pass

    def on_sent(self) -> None:
        pass


def valid_sequence() -> list[bytes]:
    encoder = hpack.Encoder()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/svc/M"), (b":authority", b"gw"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    message = b"\x00\x00\x00\x00\x03abc"
    frames = [frame(4, 0, 0, struct.pack(">HI", 4, 100000))]
    for stream_id in (1, 3, 5):
        frames += [frame(1, 0x4, stream_id, encoder.encode(headers)), frame(0, 0, stream_id, message[:4]),
                   frame(0, 1, stream_id, message[4:])]
    frames += [frame(6, 0, 0, b"12345678"), frame(8, 0, 0, b"\x00\x00\x10\x00"), frame(3, 0, 3, b"\x00\x00\x00\x08")]
    return frames


random_frame = st.builds(
    lambda kind, flags, stream_id, payload: frame(kind, flags, stream_id, payload),
    st.integers(0, 10), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 7, 0x7FFFFFFF]),
    st.binary(max_size=40))


@st.composite
def mutated(draw: Any) -> list[bytes]:
    frames = valid_sequence()
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(frames) - 1))
        action = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "drop"]))
        chosen = bytearray(frames[index])
        if action == "flip" and chosen:
            position = draw(st.integers(0, len(chosen) - 1))
            chosen[position] ^= draw(st.integers(1, 255))
            frames[index] = bytes(chosen)
        elif action in ("flip", "truncate"):
            frames[index] = bytes(chosen[:draw(st.integers(0, len(chosen)))])
        elif action == "insert":
            frames.insert(index, draw(random_frame))
        elif action == "duplicate":
            frames.insert(index, frames[index])
        elif len(frames) > 1:
            del frames[index]
    return frames


async def feed(frames: list[bytes], cuts: list[int]) -> tuple[Connection, Transport]:
    connection = Connection(Handler, set(), LIMITS)
    transport = Transport()
    connection.connection_made(transport)
    data = PREFACE + b"".join(frames)
    previous = 0
    for cut in sorted({min(cut, len(data)) for cut in cuts}) + [len(data)]:
        if transport.closed:
            break
        connection.data_received(data[previous:cut])
        previous = cut
    if connection._timer is not None:
        connection._timer.cancel()
    return connection, transport


def written_frames(data: bytes | bytearray) -> list[int]:
    kinds, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos:pos + 3], "big")
        kinds.append(data[pos + 3])
        pos += 9 + length
    assert pos == len(data), "the server wrote a partial frame"
    return kinds


def check(connection: Connection, transport: Transport) -> None:
    kinds = written_frames(transport.written)
    if transport.closed or transport.eof:  # everything the client still sends is then dropped
        assert 7 in kinds or connection.peer_said_goodbye, "closed without a GOAWAY either way"
        assert not connection.streams
        return
    streams: list[ServerStream] = list(connection.streams.values())  # type: ignore[arg-type]
    assert len(streams) <= LIMITS.max_concurrent_streams
    assert connection._reserved == sum(stream.reserved for stream in streams if stream.admitted) >= 0
    assert all(stream in streams and not stream.admitted for stream in connection._waiting)
    assert connection._recv_window >= 0 and all(stream.recv_window >= 0 for stream in streams)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(random_frame, max_size=12), st.lists(st.integers(0, 400), max_size=4))
def test_random_frames(frames: list[bytes], cuts: list[int]) -> None:
    check(*asyncio.run(feed(frames, cuts)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.lists(st.integers(0, 400), max_size=4))
def test_mutated_valid_sequences(frames: list[bytes], cuts: list[int]) -> None:
    check(*asyncio.run(feed(frames, cuts)))


def test_the_valid_sequence_is_answered() -> None:
    """The fuzz seed itself is a well-formed exchange: three answers, one reset taken in stride."""
    connection, transport = asyncio.run(feed(valid_sequence(), []))
    check(connection, transport)
    assert not transport.closed and written_frames(transport.written).count(1) == 6  # headers + trailers, x3
