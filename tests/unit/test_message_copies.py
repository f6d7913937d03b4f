"""A gRPC message is copied at most once on its way through (issue 37), counted in bytes allocated.

An 8 MB ModelInferRequest arrives as 16 KB DATA frames spread over 64 KB reads, and goes on to
Triton with a version field after it, in 16 KB frames. What the gateway allocates meanwhile is
counted with tracemalloc (Python's allocations, message buffers included): on the way in, one
message's worth (the pieces joined once); on the way out, nothing the size of the message
(DATA frames are views of it). The old path held 2.5-2.7 copies at its peak and made more
(the connection's buffer, a bytes() of every frame, the stream's buffer, a bytes() of the
message, a concatenation for the version field and another for the gRPC prefix, a bytearray
queued for window and a bytes() of every frame out)."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from collections.abc import Iterable
from typing import Any

import pytest

from gateway.grpc.client_connection import Http2Connection
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.grpc.wire import addressed, version_field
from gateway.http2.endpoint import DATA, END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, WINDOW_UPDATE, frame
from gateway.http2.hpack_codec import literal, literal_indexed_name
from gateway.http2.server_stream import Limits, ServerStream
from tests.unit.test_http2_fuzz import Transport

MB = 1 << 20
SIZE = 8 * MB


class Keeping(Transport):
    """Keeps what is written as the objects given (no copy of its own, as uvloop's writev does)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[Any] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.pieces.append(data)

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.pieces.extend(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.1.2.3", 40000) if name == "peername" else default


class Keeper:
    """A unary handler that keeps the message it is handed."""

    streaming = False
    messages: list[bytes | bytearray] = []

    def __init__(self, connection: GrpcServerConnection, stream: ServerStream) -> None:
        pass

    def on_message(self, message: bytes | bytearray) -> None:
        Keeper.messages.append(message)

    def on_end(self) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def on_sent(self) -> None:
        pass


def reads(message: bytes, frame_size: int = 16 << 10, read_size: int = 64 << 10) -> list[bytes]:
    """The client's bytes for one call carrying ``message``, cut into reads that end mid-frame."""
    block = (b"\x83\x86" + literal_indexed_name(4, b"/inference.GRPCInferenceService/ModelInfer")
             + literal_indexed_name(1, b"gw") + literal_indexed_name(31, b"application/grpc")
             + literal(b"te", b"trailers"))
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    data = [PREFACE, frame(SETTINGS, 0, 0), frame(HEADERS, END_HEADERS, 1, block)]
    for start in range(0, len(framed), frame_size):
        piece = framed[start:start + frame_size]
        data.append(frame(DATA, END_STREAM if start + frame_size >= len(framed) else 0, 1, piece))
    wire = b"".join(data)
    return [wire[start:start + read_size] for start in range(0, len(wire), read_size)]


def allocated_peak(run: Any) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("read_size", [64 << 10, 256 << 10, 16 << 10 | 3])
async def test_a_message_spread_over_frames_and_reads_is_copied_once_on_its_way_in(read_size: int) -> None:
    message = bytes(range(256)) * (SIZE // 256)
    chunks = reads(message, read_size=read_size)
    limits = Limits(stream_window=SIZE + 4096, connection_window=2 * SIZE, max_message=2 * SIZE)
    connection = GrpcServerConnection(Keeper, set(), limits)
    connection.connection_made(Keeping())
    Keeper.messages = []

    def feed() -> None:
        for chunk in chunks:
            connection.data_received(chunk)

    peak = allocated_peak(feed)
    connection.connection_lost(None)
    assert [bytes(received) for received in Keeper.messages] == [message], "the message arrived whole"
    # its one copy, in a buffer grown as the bytes came (CPython's bytearray keeps 1/8 in hand)
    assert peak < 1.2 * SIZE, f"{peak / MB:.1f} MB allocated for an 8 MB message: more than its one copy"


async def test_a_large_message_is_copied_into_its_buffer_without_a_temporary() -> None:
    """Each read's bytes go into the message's buffer as they are: what the connection allocates
    read by read (each read's peak over what was held before it) sums to the buffer and little
    else. A bytearray's own slice assignment (``buffer[a:b] = view``) copied every piece into a
    temporary bytearray first: another 8 MB allocated and copied for an 8 MB message, 16 KB at a time."""
    message = bytes(range(256)) * (SIZE // 256)
    chunks = reads(message)
    limits = Limits(stream_window=SIZE + 4096, connection_window=2 * SIZE, max_message=2 * SIZE)
    connection = GrpcServerConnection(Keeper, set(), limits)
    connection.connection_made(Keeping())
    Keeper.messages = []
    allocated = 0
    tracemalloc.start()
    try:
        for chunk in chunks:
            tracemalloc.reset_peak()
            held = tracemalloc.get_traced_memory()[0]
            connection.data_received(chunk)
            allocated += tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()
        connection.connection_lost(None)
    assert [bytes(received) for received in Keeper.messages] == [message], "the message arrived whole"
    assert allocated < 1.1 * SIZE, f"{allocated / MB:.1f} MB allocated read by read for an 8 MB message"


async def test_a_message_goes_to_triton_with_its_version_field_without_a_copy_of_it() -> None:
    raw = bytes(range(256)) * (SIZE // 256)
    connection = Http2Connection(asyncio.get_running_loop().create_future(), keepalive_s=0)
    transport = Keeping()
    connection.connection_made(transport)
    # Triton's SETTINGS: 16 KB frames (grpc's default), and windows wide enough for the message
    connection.data_received(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, SIZE + 4096))
                             + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", SIZE)))
    await asyncio.sleep(0)  # the preface and the SETTINGS ACK go out
    transport.pieces.clear()

    def send() -> None:
        connection.start(b"\x83\x86", addressed(raw, "2"))

    peak = allocated_peak(send)
    await asyncio.sleep(0)  # the writes of this loop turn go out (BatchedTransport)
    assert peak < SIZE / 16, f"{peak / MB:.1f} MB allocated sending an 8 MB message: a copy of it"
    wire = b"".join(bytes(piece) for piece in transport.pieces)
    payload = bytearray()
    pos = 0
    while pos < len(wire):  # the DATA frames' payloads, in order
        length = int.from_bytes(wire[pos:pos + 3], "big")
        if wire[pos + 3] == DATA:
            payload += wire[pos + 9:pos + 9 + length]
        pos += 9 + length
    field = version_field("2")
    assert bytes(payload) == b"\x00" + (len(raw) + len(field)).to_bytes(4, "big") + raw + field
    assert sum(1 for piece in transport.pieces if isinstance(piece, memoryview)) >= SIZE // (16 << 10), \
        "16 KB frames, each a view of the message"
    connection.connection_lost(None)
