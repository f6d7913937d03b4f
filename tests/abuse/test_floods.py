"""Control-frame floods end in GOAWAY ENHANCE_YOUR_CALM; a client that does not read is not read."""

from __future__ import annotations

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
    watch,
)
from tests.support import GatewayThread

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


def test_a_client_that_does_not_read_its_answers_is_not_read(gateway: GatewayThread, triton: LocalTriton) -> None:
    """50,000 tiny requests whose answers (UNIMPLEMENTED with a long path) are ~60x larger, from a
    client that never reads: the gateway stops reading once its unread answers pass the high-water
    mark, so its buffer for this client stays near 1 MiB instead of growing to ~60 MB."""
    with watch(gateway, triton, rss_bound_mb=48):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 4096)
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

        async def buffered() -> int:
            connection = next(iter(gateway.app.grpc_server.front.connections))
            return int(connection.transport.get_write_buffer_size())

        assert gateway.call(buffered()) < 2 << 20, "answers kept piling up for a client that does not read"
        attacker.close()
