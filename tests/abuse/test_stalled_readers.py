"""Stream replies to a client that does not read them: what the gateway holds stays bounded.

Triton's replies to a ModelStreamInfer call are relayed as they come. A client that opens long
generations and reads nothing (its stream windows at 0, or its socket unread) once made the
gateway queue every reply: 8 streams of 50,000 tokens grew it by ~9.5 MB a second. Now a stream
whose replies wait for its client stops crediting Triton's stream (``client_connection.hold``)
until they go out, so Triton waits instead, and what the gateway holds is a few stream windows
per stream, on either gRPC server (grpcio's: the replies in its handler's relay queue). A
client that reads slowly is paced the same way and still gets every token.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Callable

import hpack
import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.grpc.wire import grpc_frame
from tests.abuse.attack import (
    DATA,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    MB,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Attacker,
    Frame,
    frame,
    infer_message,
    request_headers,
    server_side,
    watch,
)
from tests.support import GatewayThread, gateway_settings, tokens_request, wait_for

pytestmark = pytest.mark.triton
STREAM_INFER = b"/inference.GRPCInferenceService/ModelStreamInfer"
INITIAL_WINDOW = 4
MAX_WINDOW = (1 << 31) - 1


def settings_frames(window: int) -> bytes:
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
    """8 streams of 12,000 tokens (~0.9 MB each) 1 ms apart, none read: the client's windows stay at
    0, or are opened wide and its socket is not read. Polled for 12 s, what the gateway holds for
    the connection (replies queued for the client's windows plus its write buffer) stays under the
    bound, and a bystander is served throughout. With the windows at 0: 1.5 stream windows per
    stream (3 MiB; measured 2.25 MiB with the tokens unpaced: a stream window queued, then what is
    left of Triton's window). With the socket unread: the write buffer's high-water mark and half a
    stream window per stream (2 MiB; measured 1.45 MiB). Before, every reply was queued: 4.0 and
    4.5 MiB after 12 s paced so (8.4 and 8.2 MiB after 8 s unpaced). Paced, because tokens at
    Triton's full speed saturate it on two cores, and the bystander's ModelInfer then waited for
    Triton past its 1-2 s bounds in full runs (ci-59): what is measured here is the gateway."""
    streams = [1 + 2 * i for i in range(8)]
    stream_window = gateway.settings.grpc_stream_window_bytes
    bound = len(streams) * 3 * stream_window // 2 if window == 0 else MB + len(streams) * stream_window // 2
    message = grpc_frame(tokens_request(12_000, delay_ms=1))
    with watch(gateway, triton, rss_bound_mb=64):
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        attacker.send(settings_frames(window))
        connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
        small_socket_buffers(gateway, connection, attacker)
        attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                               for s in streams))
        assert_held_within(lambda: sum(held(gateway, connection)), bound, "the gateway held {} for the client")
        attacker.close()
    # the streams' calls go on to their end on Triton (never reset), their replies dropped
    wait_for(lambda: client_streams(gateway) == 0, 60, what="Triton to end the left streams")


def test_a_stream_stalled_past_its_bound_is_answered_and_left(triton: LocalTriton) -> None:
    """Triton keeps what it generates for a held stream (measured with 8 streams of 50,000 tokens:
    its RSS grew by ~30 MB a second while the gateway held 2.25 MiB, ~19 MB a second when they
    were read as fast as they came), so a stream whose client takes none of its queued replies for
    ``grpc_stalled_stream_timeout_s`` (1 s here) is ended: RST_STREAM ENHANCE_YOUR_CALM (gRPC
    clients read RESOURCE_EXHAUSTED; a reset needs no window), its queued replies dropped, and the
    call is left to finish on Triton, its replies dropped, so Triton ends it soon after."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_stalled_stream_timeout_s=1.0,
                                policies={"qc": {"weights": {"2": 100}}})
    streams = [1, 3]
    message = grpc_frame(tokens_request(20_000))
    with GatewayThread(settings) as gateway:
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        started = time.monotonic()
        attacker.send(settings_frames(0) + b"".join(attacker.headers(s, request_headers(STREAM_INFER))
                                                    + frame(DATA, END_STREAM, s, message) for s in streams))
        resets = stall_resets(attacker, streams, until=10)
        answered = time.monotonic() - started
        assert resets == {s: ENHANCE_YOUR_CALM for s in streams}, resets
        assert 1.0 <= answered < 5.0, f"answered after {answered:.1f} s"
        wait_for(lambda: client_streams(gateway) == 0, 30, what="Triton to end the left streams")
        attacker.close()


def stall_resets(attacker: Attacker, streams: list[int], until: float) -> dict[int, int]:
    """The RST_STREAM codes the streams got, read until each has one (or ``until`` s pass)."""
    def reset(frames: list[Frame]) -> dict[int, int]:
        return {f.stream_id: f.code for f in frames if f.kind == RST_STREAM and f.stream_id in streams}

    return reset(attacker.frames(until, stop=None, done=lambda frames: len(reset(frames)) == len(streams)))


def test_replies_of_ended_calls_are_dropped_past_the_stall_bound(triton: LocalTriton) -> None:
    """Calls that END on Triton while their client reads nothing (windows at 0): four streams of
    3,000 tokens (~225 KB each: under a stream window, so Triton's stream is never held) and a
    unary ModelInfer. Their replies wait in the gateway with no call running on Triton (the
    client's ``grpc_max_streams_per_client`` count drops back), so the stall bound is the
    queue's, not the upstream call's: past ``grpc_stalled_stream_timeout_s`` (1 s here) with
    nothing taken, every stream is reset ENHANCE_YOUR_CALM, nothing is queued and no stream
    slot is taken. Before, the bound ran only while Triton's stream was held: ~0.9 MB stayed
    queued and the five streams stayed open, with no time limit."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_stalled_stream_timeout_s=1.0,
                                policies={"qc": {"weights": {"2": 100}}})
    streams, unary = [1, 3, 5, 7], 9
    message = grpc_frame(tokens_request(3_000))
    with GatewayThread(settings) as gateway:
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        attacker.send(settings_frames(0))
        connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
        attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                               for s in streams)
                      + attacker.headers(unary, request_headers()) + frame(DATA, END_STREAM, unary, infer_message()))
        wait_for(lambda: client_streams(gateway) == 0, 30, what="Triton to end the streams")
        resets = stall_resets(attacker, [*streams, unary], until=10)
        queued, _ = held(gateway, connection)
        still_open = open_streams(gateway, connection)
        attacker.close()
    assert (queued, still_open) == (0, 0), f"{queued} bytes still queued on {still_open} streams"
    assert resets == {s: ENHANCE_YOUR_CALM for s in [*streams, unary]}, resets


def open_streams(gateway: GatewayThread, connection: GrpcServerConnection) -> int:
    async def count() -> int:
        return len(connection.streams)

    counted: int = gateway.call(count())
    return counted


def test_held_token_replies_cost_about_their_bytes(gateway: GatewayThread, triton: LocalTriton) -> None:
    """64 streams of 4,000 tokens (~75 bytes a reply), windows at 0: each parks about a stream
    window of replies (~16 MiB in all). Queued as an object each (the reply, a view of it and a
    deque slot), they cost ~5.5 times their bytes (measured: 18.0 MiB queued, RSS +102 MB); now
    the small replies queued on a stream are appended to one buffer, so a stream holds a few
    objects, not one per reply (measured before: ~3,500 a stream)."""
    streams = [1 + 2 * i for i in range(64)]
    stream_window = gateway.settings.grpc_stream_window_bytes
    message = grpc_frame(tokens_request(4_000))
    attacker = Attacker(gateway.settings.grpc_port, preface=False)
    attacker.send(settings_frames(0))
    connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
    attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                           for s in streams))
    wait_for(lambda: held(gateway, connection)[0] >= len(streams) * stream_window, 30,
             what="every stream to park a stream window")
    objects = queued_objects(gateway, connection)
    attacker.close()
    assert objects <= 4 * len(streams), f"{objects} queued objects for {len(streams)} streams"
    wait_for(lambda: client_streams(gateway) == 0, 60, what="Triton to end the left streams")


def queued_objects(gateway: GatewayThread, connection: GrpcServerConnection) -> int:
    """The buffers the connection's streams keep their queued replies in."""
    async def count() -> int:
        queues = [stream.pending for stream in connection.streams.values() if stream.pending is not None]
        return sum(len(queue.parts) + (getattr(queue, "tail", None) is not None) for queue in queues)

    counted: int = gateway.call(count())
    return counted


def test_grpcio_server_holds_replies_for_a_client_that_reads_none(triton: LocalTriton) -> None:
    """The same attack (windows at 0) on grpcio's server (``grpc_server: grpcio``), whose handler
    writes a reply only once the client's window takes the one before: the replies waiting for
    it in the stream's relays stay under 1.5 stream windows per stream over 12 s (3 MiB; measured
    2.35 MiB with the tokens unpaced: past a quarter MiB each holds the upstream call), and a
    bystander is served. Before, they queued without bound: 4.0 MiB after 12 s paced as above
    (8.9 MiB after 8 s unpaced, ~16,000 replies per stream)."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server="grpcio",
                                policies={"qc": {"weights": {"2": 100}}})
    streams = [1 + 2 * i for i in range(8)]
    bound = len(streams) * 3 * settings.grpc_stream_window_bytes // 2
    message = grpc_frame(tokens_request(12_000, delay_ms=1))
    with GatewayThread(settings) as gateway, watch(gateway, triton, rss_bound_mb=64):
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        attacker.send(settings_frames(0) + b"".join(attacker.headers(s, request_headers(STREAM_INFER))
                                                    + frame(DATA, END_STREAM, s, message) for s in streams))
        assert_held_within(lambda: relayed(gateway), bound, "the relays held {} of replies")
        attacker.close()
        wait_for(lambda: client_streams(gateway) == 0, 60, what="Triton to end the left streams")


def assert_held_within(bytes_held: Callable[[], int], bound: int, what: str, seconds: float = 12.0) -> None:
    """Sampled every 0.1 s for ``seconds``: the most ever held is within ``bound``, and at least a
    MiB (else the replies were not streamed and the bound says nothing). ``what``: the failure's
    words, ``{}`` for the amount."""
    peak, samples = 0, []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        samples.append(bytes_held())
        peak = max(peak, samples[-1])
        time.sleep(0.1)
    assert peak <= bound, f"{what.format(f'{peak / MB:.1f} MiB')} (bound {bound / MB:.0f} MiB); " \
                          f"last samples {[round(s / MB, 1) for s in samples[-5:]]}"
    assert peak >= MB, f"only {peak} bytes were ever held: were the replies streamed at all?"

def relayed(gateway: GatewayThread) -> int:
    """Reply bytes waiting in grpcio's stream handlers for their clients: the relay queue of
    every call on the upstream connections (its listener)."""
    async def read() -> int:
        router = gateway.app.grpc_router
        assert router is not None
        fleet = router.upstream.fleet  # type: ignore[attr-defined]  # a FleetGrpc, of one server here
        connections = [server.grpc._connection for server in fleet.servers.values()]
        calls = [call for connection in connections if connection is not None for call in connection.streams.values()]
        queues = [getattr(call.listener, "replies", None) for call in calls]
        return sum(len(reply) for queue in queues if queue is not None
                   for reply in queue._queue if reply is not None)

    counted: int = gateway.call(read())
    return counted


def test_a_slow_reader_gets_every_token(gateway: GatewayThread, triton: LocalTriton) -> None:
    """Not an attack: two streams of 12,000 tokens (~0.9 MB each) whose client reads nothing until
    Triton's stream is held (its replies past a stream window), then takes 2 KiB at a time and
    gives as much window back, at most ~0.5 MB/s: the credit is given back and held again as the
    replies go out, and every token arrives, then the OK status, on both streams."""
    streams = [1, 3]
    tokens = 12_000
    attacker = Attacker(gateway.settings.grpc_port, preface=False, timeout=60)
    message = grpc_frame(tokens_request(tokens))
    attacker.send(settings_frames(16 << 10))
    connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
    attacker.send(b"".join(attacker.headers(s, request_headers(STREAM_INFER)) + frame(DATA, END_STREAM, s, message)
                           for s in streams))
    wait_for(lambda: upstream_held(gateway, connection), 20, what="Triton's stream to be held")
    reader = _Reader(attacker)
    ends = time.monotonic() + 60
    while len(reader.statuses) < len(streams) and time.monotonic() < ends:
        reader.read()
        time.sleep(0.004)
    attacker.close()
    assert reader.statuses == {s: b"0" for s in streams}, reader.statuses
    assert {s: reader.messages.get(s, 0) for s in streams} == {s: tokens for s in streams}
    wait_for(lambda: client_streams(gateway) == 0, 10, what="the streams to end on Triton")


def test_a_reader_slower_than_the_release_is_not_cut(triton: LocalTriton) -> None:
    """The stall bound measures progress, not time held: a client reading one stream at ~16 KB/s
    (4 KiB of window every 0.25 s) drains its held queue (2,500 tokens, ~190 KB, past a 64 KiB
    stream window, Triton's stream held meanwhile) slower than the 1 s bound would let a held
    stream last, yet it takes bytes well within every second, so it gets every token, in order,
    and the OK status. Before, the bound ran from the first hold until the queue was down to
    half a window (a reader under ~32 KB/s here, ~5 KB/s with the defaults): cut after 1 s."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_stalled_stream_timeout_s=1.0,
                                grpc_stream_window_bytes=65535, policies={"qc": {"weights": {"2": 100}}})
    tokens = 2_500
    with GatewayThread(settings) as gateway:
        attacker = Attacker(gateway.settings.grpc_port, preface=False, timeout=60)
        attacker.send(settings_frames(4 << 10))
        connection = wait_for(lambda: server_side(gateway, attacker), 5, what="the attacker's connection")
        attacker.send(attacker.headers(1, request_headers(STREAM_INFER))
                      + frame(DATA, END_STREAM, 1, grpc_frame(tokens_request(tokens))))
        wait_for(lambda: upstream_held(gateway, connection), 20, what="Triton's stream to be held")
        reader = _Reader(attacker, chunk=4 << 10)
        ends = time.monotonic() + 60
        while not reader.statuses and time.monotonic() < ends:
            reader.read()
            time.sleep(0.25)
        attacker.close()
    assert (reader.statuses, reader.messages.get(1, 0)) == ({1: b"0"}, tokens), (reader.statuses, reader.messages)
    assert reader.order == {1: tokens - 1} and reader.unordered == 0, (reader.order, reader.unordered)


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

    def __init__(self, attacker: Attacker, chunk: int = 2 << 10) -> None:
        self.attacker = attacker
        self.chunk = chunk  # bytes read at most at a time
        self.buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.replies: dict[int, bytearray] = {}
        self.messages: dict[int, int] = {}
        self.statuses: dict[int, bytes] = {}
        self.order: dict[int, int] = {}  # each stream's last token index (tok's replies say ``v<version>:<i>``)
        self.unordered = 0  # replies whose index was not the one after the last

    def read(self) -> None:
        sock = self.attacker.sock
        sock.settimeout(0.05)
        try:
            chunk = sock.recv(self.chunk)
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
            token = re.search(rb"v\d+:(\d+)", bytes(replies[5:5 + length]))
            del replies[:5 + length]
            self.messages[stream_id] = self.messages.get(stream_id, 0) + 1
            if token is not None:
                index = int(token.group(1))
                self.unordered += index != self.order.get(stream_id, -1) + 1
                self.order[stream_id] = index
