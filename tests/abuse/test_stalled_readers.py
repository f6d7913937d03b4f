"""Stream replies to a client that does not read them: what the gateway holds stays bounded.

Triton's replies to a ModelStreamInfer call are relayed as they come. A client that opens long
generations and reads nothing (its stream windows at 0, or its socket unread) once made the
gateway queue every reply: 8 streams of 50,000 tokens grew it by ~9.5 MB a second. Now a stream
whose replies wait for its client stops crediting Triton's stream (``client_connection.hold``)
until they go out, so Triton waits instead, and what the gateway holds is a few stream windows
per stream. A client that reads slowly is paced the same way and still gets every token.
"""

from __future__ import annotations

import socket
import struct
import time

import hpack
import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.grpc.wire import grpc_frame
from tests.abuse.attack import (
    DATA,
    END_STREAM,
    HEADERS,
    MB,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    Attacker,
    frame,
    request_headers,
    server_side,
    watch,
)
from tests.support import GatewayThread, tokens_request, wait_for

pytestmark = pytest.mark.triton
STREAM_INFER = b"/inference.GRPCInferenceService/ModelStreamInfer"
INITIAL_WINDOW = 4
MAX_WINDOW = (1 << 31) - 1


def settings(window: int) -> bytes:
    """The preface and SETTINGS_INITIAL_WINDOW_SIZE ``window``, the connection window opened as wide."""
    opened = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", window - 65535)) if window > 65535 else b""
    return PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW, window)) + opened


def held(gateway: GatewayThread, connection: GrpcServerConnection) -> tuple[int, int]:
    """(reply bytes queued for the client's windows across the connection's streams, bytes in its
    transport's write buffer: written, not yet taken by the client's socket)."""
    async def read() -> tuple[int, int]:
        queued = sum(len(stream.pending) for stream in connection.streams.values() if stream.pending is not None)
        transport = connection.transport
        return queued, 0 if transport is None else transport.get_write_buffer_size()

    counted: tuple[int, int] = gateway.call(read())
    return counted


def small_socket_buffers(gateway: GatewayThread, connection: GrpcServerConnection, attacker: Attacker) -> None:
    """Little of what is unread waits in the kernel (the buffers autotune to a few MB each on
    loopback): what the client does not read reaches the gateway's write buffer in seconds."""
    attacker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    async def shrink() -> None:
        assert connection.transport is not None
        connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    gateway.call(shrink())


def client_streams(gateway: GatewayThread) -> int:
    """The loopback client's streams still running on Triton (``grpc.client_streams``)."""
    async def count() -> int:
        router = gateway.app.grpc_router
        assert router is not None
        return router.streams.counts.get("127.0.0.1", 0)

    counted: int = gateway.call(count())
    return counted


@pytest.mark.parametrize("window", [0, MAX_WINDOW], ids=["windows-at-0", "socket-unread"])
def test_a_client_that_reads_no_replies_parks_a_few_windows_per_stream(gateway: GatewayThread, triton: LocalTriton,
                                                                       window: int) -> None:
    """8 streams of 20,000 tokens (~2 MB each), none read: the client's windows stay at 0, or
    are opened wide and its socket is not read. Polled for 8 s, what the gateway holds for the
    connection (replies queued for the client's windows plus its write buffer) never passes 1.5
    stream windows per stream plus the write buffer's high-water mark (4 MiB; measured: 2.25 MiB
    with the windows at 0, 1.45 MiB with the socket unread), and a bystander is served
    throughout. Before, every reply was queued: ~1.2 MB more each second (6.2 and 7.3 MiB after 6 s)."""
    streams = [1 + 2 * i for i in range(8)]
    limits_window = gateway.settings.grpc_stream_window_bytes
    bound = len(streams) * 3 * limits_window // 2 + MB  # MB: the transport's write_high_water
    message = grpc_frame(tokens_request(20_000))
    with watch(gateway, triton, rss_bound_mb=64):
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        attacker.send(settings(window))
        connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
        small_socket_buffers(gateway, connection, attacker)
        attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                               for s in streams))
        peak, samples = 0, []
        ends = time.monotonic() + 8.0
        while time.monotonic() < ends:
            queued, buffered = held(gateway, connection)
            samples.append(queued + buffered)
            peak = max(peak, queued + buffered)
            time.sleep(0.1)
        assert peak <= bound, f"the gateway held {peak / MB:.1f} MiB for the client (bound {bound / MB:.0f} MiB); " \
                              f"last samples {[round(s / MB, 1) for s in samples[-5:]]}"
        assert peak >= MB, f"only {peak} bytes were ever held: were the replies streamed at all?"
        attacker.close()
    # the streams' calls go on to their end on Triton (never reset), their replies dropped
    wait_for(lambda: client_streams(gateway) == 0, 60, what="Triton to end the left streams")


def test_a_slow_reader_gets_every_token(gateway: GatewayThread, triton: LocalTriton) -> None:
    """Not an attack: two streams of 20,000 tokens (~1.5 MB each) read by a client that takes 4 KiB
    at a time and gives as much window back, at most ~1 MB/s, slower than Triton sends: the
    replies wait for it, Triton's credit is held (seen) and given back again and again, and every
    token arrives, then the OK status, on both streams."""
    streams = [1, 3]
    tokens = 20_000
    attacker = Attacker(gateway.settings.grpc_port, preface=False, timeout=60)
    message = grpc_frame(tokens_request(tokens))
    attacker.send(settings(16 << 10))
    connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
    attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                           for s in streams))
    reader, held_seen = _Reader(attacker), False
    ends = time.monotonic() + 60
    while len(reader.statuses) < len(streams) and time.monotonic() < ends:
        for _ in range(25):
            reader.read()
            time.sleep(0.004)
        held_seen = held_seen or upstream_held(gateway, connection)
    attacker.close()
    assert reader.statuses == {s: b"0" for s in streams}, reader.statuses
    assert {s: reader.messages.get(s, 0) for s in streams} == {s: tokens for s in streams}
    assert held_seen, "Triton's stream was never held: the client read faster than it sent"
    wait_for(lambda: client_streams(gateway) == 0, 10, what="the streams to end on Triton")


def upstream_held(gateway: GatewayThread, connection: GrpcServerConnection) -> bool:
    """Some stream's upstream call is held (its replies wait for the client)."""
    async def read() -> bool:
        return any(getattr(getattr(stream.handler, "upstream", None), "held", False)  # type: ignore[attr-defined]
                   for stream in connection.streams.values())

    held: bool = gateway.call(read())
    return held


class _Reader:
    """Reads what came, counts each stream's gRPC messages and its grpc-status, and gives back
    as much window (stream and connection) as it took."""

    def __init__(self, attacker: Attacker) -> None:
        self.attacker = attacker
        self.buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.replies: dict[int, bytearray] = {}
        self.messages: dict[int, int] = {}
        self.statuses: dict[int, bytes] = {}

    def read(self) -> None:
        sock = self.attacker.sock
        sock.settimeout(0.05)
        try:
            chunk = sock.recv(4 << 10)
        except TimeoutError:
            return
        if not chunk:
            raise AssertionError(f"the gateway closed the connection; statuses {self.statuses}")
        self.buffer += chunk
        credit = b""
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                break
            kind, stream_id = self.buffer[3], int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.buffer[9:9 + length])
            del self.buffer[:9 + length]
            if kind == DATA and payload:
                self._count(stream_id, payload)
                increment = struct.pack(">I", len(payload))
                credit += frame(WINDOW_UPDATE, 0, 0, increment) + frame(WINDOW_UPDATE, 0, stream_id, increment)
            elif kind == HEADERS:
                for name, value in self.decoder.decode(payload, raw=True):
                    if name == b"grpc-status":
                        self.statuses[stream_id] = value
        if credit:
            self.attacker.send(credit)

    def _count(self, stream_id: int, payload: bytes) -> None:
        replies = self.replies.setdefault(stream_id, bytearray())
        replies += payload
        while len(replies) >= 5 and len(replies) >= 5 + (length := int.from_bytes(replies[1:5], "big")):
            del replies[:5 + length]
            self.messages[stream_id] = self.messages.get(stream_id, 0) + 1
