"""A ModelStreamInfer client that sends faster than the upstream reads: the gateway pauses it.

Real Triton cannot be made to read a stream slowly, so the stream's upstream here is a fake
HTTP/2 server (``WindowHoarder``): it accepts the connection and the stream, drains its socket,
and never grants flow-control window past the RFC's initial 65,535 bytes. ModelInfer (the
bystander's) still goes to the real Triton.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import h2.config
import h2.connection
import h2.events
import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.upstream import GrpcUpstream
from tests.abuse.attack import MB, SETTINGS, WINDOW_UPDATE, frame, request_headers, watch
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
STREAM_INFER = b"/inference.GRPCInferenceService/ModelStreamInfer"


@contextmanager
def window_hoarder() -> Iterator[tuple[int, threading.Event]]:
    """The fake upstream's port while it runs, and an event that makes it grant 64 MiB of window
    (on the connection and on stream 1, the gateway's first stream). Until then: what arrives is
    read and discarded, and no WINDOW_UPDATE goes out."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop, grant = threading.Event(), threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(0.1)
            connection.sendall(frame(SETTINGS, 0, 0))  # the default windows of 65,535 bytes, never raised
            granted = False
            while not stop.is_set():
                if grant.is_set() and not granted:
                    increment = struct.pack(">I", 64 * MB)
                    connection.sendall(frame(WINDOW_UPDATE, 0, 0, increment) + frame(WINDOW_UPDATE, 0, 1, increment))
                    granted = True
                try:
                    if not connection.recv(1 << 16):
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], grant
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def stream_request(size: int) -> bytes:
    """A ModelStreamInfer request for ``qc`` of about ``size`` bytes, gRPC-framed."""
    message = service_pb2.ModelInferRequest(model_name="qc")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, size // 4])
    message.raw_input_contents.append(bytes(size))
    raw: bytes = message.SerializeToString()
    return b"\x00" + len(raw).to_bytes(4, "big") + raw


class FastStreamer:
    """An honest, fast client (the h2 library keeps to our windows) on one ModelStreamInfer stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.client.initiate_connection()
        self.client.send_headers(1, request_headers(STREAM_INFER))
        sock.sendall(self.client.data_to_send())

    def send(self, message: bytes, total: int, seconds: float) -> int:
        """``message`` over and over until ``total`` bytes went out or ``seconds`` passed: the bytes
        sent. The stream stays open."""
        return send_within_windows(self.sock, self.client, message, total, seconds)


def send_within_windows(sock: socket.socket, client: h2.connection.H2Connection, message: bytes, total: int,
                        seconds: float) -> int:
    sent, deadline = 0, time.monotonic() + seconds
    while sent < total and time.monotonic() < deadline:
        if client.local_flow_control_window(1) >= len(message):
            step = client.max_outbound_frame_size
            for start in range(0, len(message), step):
                client.send_data(1, message[start:start + step])
            sent += len(message)
            sock.sendall(client.data_to_send())
            continue
        sock.settimeout(0.05)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        assert chunk, "the gateway closed the connection"
        for event in client.receive_data(chunk):
            assert not isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)), event
        sock.sendall(client.data_to_send())
    return sent


def test_a_stream_whose_upstream_reads_nothing_pauses_its_client(gateway: GatewayThread, triton: LocalTriton,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB requests as fast as the windows allow, for 2 s, up to 48 MiB, on a stream whose
    upstream takes 65,535 bytes and no more. The gateway's queue on that upstream stream stays
    within two stream windows and a message, and the client is paused (it gets no stream credit
    while that queue is above one stream window). Before, credit went back on receipt and the
    gateway queued all 48 MiB for the upstream. Once the upstream grants window, the queue
    drains and the client is sent credit again: 4 MiB more go through."""
    window = gateway.settings.grpc_stream_window_bytes
    message = stream_request(64 << 10)
    router = gateway.app.grpc_router
    assert router is not None
    with window_hoarder() as (port, grant):
        hoarder = GrpcUpstream(f"127.0.0.1:{port}")
        monkeypatch.setattr(router.upstream, "open", hoarder.open)  # streams only: ModelInfer stays on Triton

        async def queued() -> int:
            """What the gateway holds for the hoarder, queued on the upstream connection."""
            connection = hoarder._connection
            assert connection is not None
            return sum(len(call.pending or b"") for call in connection.streams.values())

        try:
            with watch(gateway, triton, rss_bound_mb=24):
                with socket.create_connection(("127.0.0.1", gateway.settings.grpc_port), timeout=5) as sock:
                    client = FastStreamer(sock)
                    sent = client.send(message, 48 * MB, seconds=2)
                    time.sleep(0.2)  # the gateway has handled all it was sent
                    held = gateway.call(queued())
                    grant.set()
                    resumed = client.send(message, 4 * MB, seconds=5)
                    drained = gateway.call(queued())
        finally:
            gateway.call(hoarder.aclose())
    assert held <= 2 * window + len(message), f"{held} bytes queued for the upstream"
    assert sent <= 65535 + held + window, f"the client sent {sent} bytes; the upstream took 65,535"
    assert resumed >= 4 * MB and drained <= 2 * window + len(message), (resumed, drained)


def send_on_streams(sock: socket.socket, streams: list[int], message: bytes, seconds: float) -> dict[int, int]:
    """One ``message`` on each of ``streams`` (opened here), each as far as its windows allow,
    for ``seconds``: the bytes each stream sent."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    for stream in streams:
        client.send_headers(stream, request_headers(STREAM_INFER))
    sock.sendall(client.data_to_send())
    sent = dict.fromkeys(streams, 0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and min(sent.values()) < len(message):
        for stream in streams:
            size = min(client.local_flow_control_window(stream), client.max_outbound_frame_size,
                       len(message) - sent[stream])
            if size > 0:
                client.send_data(stream, message[sent[stream]:sent[stream] + size])
                sent[stream] += size
        sock.sendall(client.data_to_send())
        sock.settimeout(0.05)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        assert chunk, "the gateway closed the connection"
        for event in client.receive_data(chunk):
            assert not isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)), event
        sock.sendall(client.data_to_send())
    return sent


def test_large_messages_the_upstream_has_not_taken_keep_their_reservation(triton: LocalTriton,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Four streams on one connection each send a 3 MiB message (4 MiB limit), to an upstream
    that takes 65,535 bytes. The first message is admitted and handed over; as the upstream has
    not taken it, it keeps its reservation, so the other three are not admitted and stop at their
    stream window: about one message is queued, not four. Before, the reservation went with the
    hand-over, and all four messages were queued for the upstream."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_max_message_bytes=4 * MB)
    message = stream_request(3 * MB)
    window = settings.grpc_stream_window_bytes
    with window_hoarder() as (port, _), GatewayThread(settings) as gateway:
        router = gateway.app.grpc_router
        assert router is not None
        hoarder = GrpcUpstream(f"127.0.0.1:{port}")
        monkeypatch.setattr(router.upstream, "open", hoarder.open)

        async def queued() -> int:
            connection = hoarder._connection
            assert connection is not None
            return sum(len(call.pending or b"") for call in connection.streams.values())

        try:
            with watch(gateway, triton, rss_bound_mb=24):
                with socket.create_connection(("127.0.0.1", settings.grpc_port), timeout=5) as sock:
                    sent = send_on_streams(sock, [1, 3, 5, 7], message, seconds=2)
                    time.sleep(0.2)
                    held = gateway.call(queued())
        finally:
            gateway.call(hoarder.aclose())
    assert sorted(sent.values())[-1] == len(message) and sorted(sent.values())[-2] <= window, sent
    assert held <= len(message) + window, f"{held} bytes queued for the upstream"
