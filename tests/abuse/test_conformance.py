"""The RFC 9113 / RFC 7541 answers issue 12 found missing (h2spec's cases, over a raw socket).

Connection errors are a GOAWAY with the RFC's code; stream errors a RST_STREAM on that stream.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from tests.abuse.attack import (
    COMPRESSION_ERROR,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PING,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Attacker,
    frame,
    infer_message,
    request_headers,
)
from tests.support import GatewayThread

pytestmark = pytest.mark.triton


def held_open(attacker: Attacker) -> bytes:
    """Stream 1: a ModelInfer whose message never comes, so the stream stays open."""
    return attacker.headers(1, request_headers())


def answered(attacker: Attacker) -> bytes:
    """Stream 1: a complete request (closed once answered)."""
    return attacker.headers(1, request_headers(b"/inference.GRPCInferenceService/ServerLive")) + frame(
        DATA, END_STREAM, 1, b"\x00\x00\x00\x00\x00")


def closed(attacker: Attacker) -> bytes:
    """Stream 1 answered and closed, then HEADERS on it again."""
    attacker.send(answered(attacker))
    assert attacker.statuses(1) == {1: 0}
    return attacker.headers(1, request_headers(), end_stream=True)


Case = Callable[[Attacker], bytes]
CONNECTION_ERRORS: dict[str, tuple[Case, int]] = {
    "RST_STREAM of 3 bytes": (lambda a: held_open(a) + frame(RST_STREAM, 0, 1, b"\x00\x00\x08"), FRAME_SIZE_ERROR),
    "PING of 6 bytes": (lambda a: frame(PING, 0, 0, b"\x00" * 6), FRAME_SIZE_ERROR),
    "WINDOW_UPDATE of 3 bytes": (lambda a: frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), FRAME_SIZE_ERROR),
    "SETTINGS of 5 bytes": (lambda a: frame(SETTINGS, 0, 0, b"\x00\x03\x00\x00\x00"), FRAME_SIZE_ERROR),
    "SETTINGS ACK with a payload": (lambda a: frame(SETTINGS, 1, 0, b"\x00\x03\x00\x00\x00\x64"), FRAME_SIZE_ERROR),
    "SETTINGS on a stream": (lambda a: frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    "ENABLE_PUSH of 2": (lambda a: frame(SETTINGS, 0, 0, struct.pack(">HI", 2, 2)), PROTOCOL_ERROR),
    "INITIAL_WINDOW_SIZE above 2^31-1": (lambda a: frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 31)),
                                         FLOW_CONTROL_ERROR),
    "zero WINDOW_UPDATE on the connection": (lambda a: frame(WINDOW_UPDATE, 0, 0, b"\x00" * 4), PROTOCOL_ERROR),
    "connection window past 2^31-1": (lambda a: frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)),
                                      FLOW_CONTROL_ERROR),
    "table size update after a field": (
        lambda a: frame(HEADERS, END_HEADERS | END_STREAM, 1, a.block(request_headers()) + b"\x20"), COMPRESSION_ERROR),
    "DATA on an idle stream": (lambda a: frame(DATA, END_STREAM, 1, infer_message()), PROTOCOL_ERROR),
    "RST_STREAM on an idle stream": (lambda a: frame(RST_STREAM, 0, 1, b"\x00\x00\x00\x08"), PROTOCOL_ERROR),
    "WINDOW_UPDATE on an idle stream": (lambda a: frame(WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x01"), PROTOCOL_ERROR),
    "an even stream id": (lambda a: a.headers(2, request_headers(), end_stream=True), PROTOCOL_ERROR),
    "a decreasing stream id": (lambda a: a.headers(5, request_headers()) + a.headers(3, request_headers()),
                               PROTOCOL_ERROR),
    "HEADERS on a closed stream": (closed, PROTOCOL_ERROR),
    "DATA on stream 0": (lambda a: frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    "PUSH_PROMISE from a client": (lambda a: frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02"), PROTOCOL_ERROR),
    "a pad length past the frame": (lambda a: held_open(a) + frame(DATA, 0x8, 1, b"\x05abc"), PROTOCOL_ERROR),
}
STREAM_ERRORS: dict[str, tuple[Case, int]] = {
    "zero WINDOW_UPDATE on a stream": (lambda a: held_open(a) + frame(WINDOW_UPDATE, 0, 1, b"\x00" * 4),
                                       PROTOCOL_ERROR),
    "stream window past 2^31-1": (lambda a: held_open(a) + frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 0x7FFFFFFF)),
                                  FLOW_CONTROL_ERROR),
    "a second HEADERS without END_STREAM": (lambda a: held_open(a) + a.headers(1, [(b"x-more", b"1")]), PROTOCOL_ERROR),
    "pseudo-headers in trailers": (lambda a: held_open(a) + a.headers(1, [(b":path", b"/x")], end_stream=True),
                                   PROTOCOL_ERROR),
    "DATA after END_STREAM": (lambda a: a.headers(1, request_headers(), end_stream=True) + frame(DATA, 0, 1, b"x"),
                              STREAM_CLOSED),
    "a request without :path": (lambda a: a.headers(1, [(b":method", b"POST"), (b":scheme", b"http")]),
                                PROTOCOL_ERROR),
    "a pseudo-header after a regular one": (
        lambda a: a.headers(1, [(b"x-first", b"1"), *request_headers()], end_stream=True), PROTOCOL_ERROR),
    "a connection-specific header": (
        lambda a: a.headers(1, request_headers(extra=[(b"connection", b"close")]), end_stream=True), PROTOCOL_ERROR),
}


@pytest.mark.parametrize("case", list(CONNECTION_ERRORS))
def test_connection_errors(gateway: GatewayThread, case: str) -> None:
    build, code = CONNECTION_ERRORS[case]
    attacker = Attacker(gateway.settings.grpc_port)
    attacker.send(build(attacker))
    assert attacker.goaway().code == code
    attacker.close()


@pytest.mark.parametrize("case", list(STREAM_ERRORS))
def test_stream_errors(gateway: GatewayThread, case: str) -> None:
    build, code = STREAM_ERRORS[case]
    attacker = Attacker(gateway.settings.grpc_port)
    attacker.send(build(attacker))
    assert attacker.resets(until=2, stop=RST_STREAM).get(1) == code
    frames = attacker.frames(until=0.2, stop=None)
    assert not any(f.kind == GOAWAY for f in frames), "a stream error leaves the connection up"
    attacker.close()
