"""``GrpcServerConnection.cut_open_calls``: what a call still open at the drain bound is told.

A call whose answer waits for the client's flow-control window still gets its UNAVAILABLE at
once (a status is a HEADERS frame, never held by a window); a call already answered but still
flushing is not given a second status; a handler that fails while stopping does not keep the
other calls from being cut."""

from __future__ import annotations

import asyncio
import logging
import struct

import hpack
import pytest

from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.endpoint import PREFACE, frame
from gateway.http2.server_stream import ServerStream
from tests.unit.test_http2_fuzz import LIMITS, Connection, Transport

HEADERS, SETTINGS, INITIAL_WINDOW_SIZE = 1, 4, 4
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/svc/M"), (b":authority", b"gw"),
           (b"content-type", b"application/grpc"), (b"te", b"trailers")]


class Call:
    """A streaming call that answers nothing by itself; notes its reset, or fails in it."""

    streaming = True
    failing_reset = False
    resets: list[int] = []

    def __init__(self, connection: GrpcServerConnection, stream: ServerStream) -> None:
        self.stream = stream

    def on_message(self, message: bytes | bytearray) -> None:
        pass

    def on_end(self) -> None:
        pass

    def on_sent(self) -> None:
        pass

    def on_reset(self) -> None:
        Call.resets.append(self.stream.id)
        if self.stream.id == 1:
            raise RuntimeError("a handler that fails while stopping")


def statuses(written: bytes | bytearray) -> dict[int, list[bytes]]:
    """Each stream's grpc-status values, from the HEADERS frames the server wrote."""
    decoder, pos = hpack.Decoder(), 0
    found: dict[int, list[bytes]] = {}
    while len(written) - pos >= 9:
        length = int.from_bytes(written[pos:pos + 3], "big")
        kind, stream_id = written[pos + 3], int.from_bytes(written[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        if kind == HEADERS:
            for name, value in decoder.decode(bytes(written[pos + 9:pos + 9 + length]), raw=True):
                if name == b"grpc-status":
                    found.setdefault(stream_id, []).append(value)
        pos += 9 + length
    return found


async def test_open_calls_are_answered_unavailable_at_once_and_answered_ones_are_left(
        caplog: pytest.LogCaptureFixture) -> None:
    Call.resets = []
    connection = Connection(Call, set(), LIMITS)
    transport = Transport()
    connection.connection_made(transport)
    encoder = hpack.Encoder()
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 8)) + b"".join(
        frame(HEADERS, 0x4, stream_id, encoder.encode(REQUEST)) for stream_id in (1, 3, 5)))
    streams: dict[int, ServerStream] = connection.streams  # type: ignore[assignment]
    assert sorted(streams) == [1, 3, 5]
    connection.send_message(streams[3], b"x" * 100)  # headers out, the message held by the 8-byte window
    connection.reply(streams[5], b"y" * 100)  # answered; its message and status wait for the window
    assert streams[3].pending is not None and streams[5].pending is not None

    with caplog.at_level(logging.ERROR, logger="gateway.grpc"):
        cut = connection.cut_open_calls("the gateway is shutting down")
        await asyncio.sleep(0)  # the connection's writes of one loop turn go out together

    assert cut == 2
    assert statuses(transport.written) == {1: [b"14"], 3: [b"14"]}, "1 and 3 cut at once; 5's status behind the window"
    assert sorted(Call.resets) == [1, 3], "the failing handler of stream 1 did not keep stream 3 from its reset"
    assert "cutting gRPC call" in caplog.text
    assert 5 in connection.streams and 3 not in connection.streams
    if connection._timer is not None:
        connection._timer.cancel()
