"""The credit the upstream client gives Triton per call (``grpc.client_connection``), frame by frame.

A streaming call's replies may wait for a client that reads slowly or not at all, so what Triton
may send one ahead is its stream window (64 KiB), given back on receipt at half of it, and not at
all while the call is held; a unary reply past half of it opens its window to 16 MiB once. Driven
here with DATA frames fed to the connection and the WINDOW_UPDATEs it writes read back.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterable

import pytest

from gateway.grpc.client_connection import STREAM_WINDOW, UNARY_WINDOW, Http2Connection, _Call
from gateway.http2.endpoint import DATA, WINDOW_UPDATE, Headers, frame


class Sink(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def writelines(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        for part in parts:
            self.out += part

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Listener:
    def on_headers(self, headers: Headers) -> None:
        pass

    def on_data(self, payload: bytes | memoryview) -> None:
        pass

    def on_close(self, code: int, details: str) -> None:
        pass

    def on_drained(self) -> None:
        pass


@pytest.fixture
async def connection() -> AsyncIterator[Http2Connection]:
    opened = Http2Connection(asyncio.get_running_loop().create_future(), keepalive_s=0)
    sink = Sink()
    opened.connection_made(sink)
    yield opened
    opened.connection_lost(None)


def credit(connection: Http2Connection, call: _Call) -> list[int]:
    """The WINDOW_UPDATE increments written for the call since the last look."""
    assert connection.transport is not None
    connection.transport.flush()
    sink = connection.transport.raw
    assert isinstance(sink, Sink)
    out, increments, pos = bytes(sink.out), [], 0
    sink.out.clear()
    while pos + 9 <= len(out):
        length = int.from_bytes(out[pos:pos + 3], "big")
        kind, stream_id = out[pos + 3], int.from_bytes(out[pos + 5:pos + 9], "big")
        if kind == WINDOW_UPDATE and stream_id == call.id:
            increments.append(struct.unpack(">I", out[pos + 9:pos + 13])[0])
        pos += 9 + length
    return increments


def feed(connection: Http2Connection, call: _Call, size: int, pieces: int = 1) -> None:
    for _ in range(pieces):
        connection.data_received(frame(DATA, 0, call.id, bytes(size)))


async def test_a_stream_is_credited_at_half_its_window_unless_held(connection: Http2Connection) -> None:
    call = connection.open(b"", Listener())
    credit(connection, call)
    feed(connection, call, 8 << 10, 4)  # 32 KiB: not past half the window yet
    assert credit(connection, call) == []
    feed(connection, call, 8 << 10)
    assert credit(connection, call) == [40 << 10]
    connection.hold(call)
    feed(connection, call, 8 << 10, 8)  # Triton may send the window's rest; nothing goes back
    assert credit(connection, call) == []
    connection.release(call)
    assert credit(connection, call) == [64 << 10]
    connection.release(call)  # once
    assert credit(connection, call) == []


async def test_a_call_left_by_its_caller_is_released(connection: Http2Connection) -> None:
    call = connection.open(b"", Listener())
    connection.hold(call)
    feed(connection, call, 8 << 10, 6)
    credit(connection, call)
    connection.leave(call, 60.0)  # its answers are dropped from now on: none waits for the caller
    assert not call.held
    assert credit(connection, call) == [48 << 10]


async def test_a_large_unary_reply_opens_its_window_once(connection: Http2Connection) -> None:
    call = connection.start(b"", b"request")
    credit(connection, call)
    feed(connection, call, 16 << 10, 2)  # 32 KiB: a small reply costs no frame
    assert credit(connection, call) == []
    feed(connection, call, 16 << 10)
    assert credit(connection, call) == [(48 << 10) + UNARY_WINDOW - STREAM_WINDOW]
    feed(connection, call, 16 << 10, 3)
    assert credit(connection, call) == [48 << 10]
