"""Control-frame floods end in GOAWAY ENHANCE_YOUR_CALM; a client that does not read is not read."""

from __future__ import annotations

import socket
import time

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import (
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    PRIORITY,
    SETTINGS,
    Attacker,
    frame,
    request_headers,
    server_side,
    watch,
)
from tests.support import GatewayThread, wait_for

pytestmark = pytest.mark.triton


def flood(kind: str, attacker: Attacker) -> bytes:
    if kind == "ping":
        return b"".join(frame(PING, 0, 0, i.to_bytes(8, "big")) for i in range(2000))
    if kind == "settings":
        return frame(SETTINGS, 0, 0) * 2000
    if kind == "empty-data":
        return attacker.headers(1, request_headers()) + frame(DATA, 0, 1) * 2000
    if kind == "empty-continuation":
        return frame(HEADERS, 0, 1, attacker.block(request_headers())) + frame(CONTINUATION, 0, 1) * 2000
    assert kind == "priority"
    return b"".join(frame(PRIORITY, 0, 1 + 2 * i, b"\x00\x00\x00\x00\x10") for i in range(2000))


@pytest.mark.parametrize("kind", ["ping", "settings", "empty-data", "empty-continuation", "priority"])
def test_floods_end_in_enhance_your_calm(gateway: GatewayThread, triton: LocalTriton, kind: str) -> None:
    with watch(gateway, triton, rss_bound_mb=32):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(flood(kind, attacker))
        assert attacker.goaway().code == ENHANCE_YOUR_CALM
        attacker.close()


def test_a_flooder_that_keeps_sending_still_reads_why_it_was_cut_off(gateway: GatewayThread,
                                                                     triton: LocalTriton) -> None:
    """Closing a socket with the client's bytes unread makes the kernel send a reset, which throws
    away the GOAWAY not yet sent. Here the flooder sends 16 times the limit in one go: without the
    lingering close the GOAWAY was lost on every try (200 of 200), so this fails at once."""
    with watch(gateway, triton, rss_bound_mb=32):
        for _ in range(5):
            attacker = Attacker(gateway.settings.grpc_port)
            for _ in range(8):
                if not attacker.send(flood("ping", attacker)):
                    break
            assert attacker.goaway().code == ENHANCE_YOUR_CALM
            attacker.close()


def test_a_cut_off_client_that_neither_reads_nor_closes_is_let_go_within_seconds(gateway: GatewayThread) -> None:
    """The lingering close is bounded: a flooder that then sits silent on its socket is aborted."""
    attacker = Attacker(gateway.settings.grpc_port)
    attacker.send(flood("ping", attacker))
    wait_for(lambda: server_side(gateway, attacker) is None, 3, interval=0.05,
             what="the gateway to let go of the flooder's connection")
    attacker.close()


def test_a_client_that_does_not_read_its_answers_is_not_read(gateway: GatewayThread, triton: LocalTriton) -> None:
    """50,000 tiny requests whose answers (UNIMPLEMENTED with a long path) are ~20x larger, from a
    client that never reads: the gateway stops reading once its unread answers pass the high-water
    mark. The attacker's connection gets small buffers on the gateway's side (a 64 KiB high-water
    mark, an 8 KiB socket buffer) so the test needs hundreds of answers, not megabytes, to show it."""
    with watch(gateway, triton, rss_bound_mb=48):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        attacker.frames(until=1, stop=SETTINGS, done=lambda frames: len(frames) >= 2)  # the gateway has it now
        attacked = server_side(gateway, attacker)
        assert attacked is not None and attacked.transport is not None
        transport = attacked.transport

        async def shrink() -> None:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            transport.set_write_buffer_limits(high=64 << 10)

        gateway.call(shrink())
        attacker.received.clear()
        path = b"/unknown.Service/" + b"p" * 180
        first = attacker.headers(1, request_headers(path), end_stream=True)
        repeat = attacker.headers(3, request_headers(path), end_stream=True)  # the encoder now indexes all of it
        assert len(repeat) < 20
        requests = first + b"".join(frame(HEADERS, 0x5, 3 + 2 * i, repeat[9:]) for i in range(50_000))
        attacker.sock.setblocking(False)
        sent, deadline = 0, time.monotonic() + 2
        while sent < len(requests) and time.monotonic() < deadline:
            try:
                sent += attacker.sock.send(requests[sent:sent + 65536])
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(0.3)

        async def state() -> tuple[int, int]:
            """Unread answers, and requests read, on the attacker's connection (not the bystander's)."""
            return transport.get_write_buffer_size(), attacked._last_stream_id // 2

        buffered, read = gateway.call(state())
        assert buffered < 128 << 10, f"{buffered} bytes of answers piled up for a client that does not read"
        assert read < 2_000, f"{read} of 50,000 requests read from a client that does not read"
        attacker.close()
