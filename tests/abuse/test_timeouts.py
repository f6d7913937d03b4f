"""Slow clients: no preface, a header block never finished, an idle connection; a bad grpc-timeout."""

from __future__ import annotations

import time

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import (
    HEADERS,
    NO_ERROR,
    PROTOCOL_ERROR,
    Attacker,
    frame,
    infer_message,
    request_headers,
    watch,
)
from tests.support import GatewayThread

pytestmark = pytest.mark.triton
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4


def closed_within(attacker: Attacker, seconds: float) -> float:
    started = time.monotonic()
    attacker.frames(until=seconds, stop=None)
    assert attacker.closed, f"the connection was still open after {seconds} s"
    return time.monotonic() - started


def test_a_client_that_never_sends_the_preface_is_closed(impatient_gateway: GatewayThread,
                                                          triton: LocalTriton) -> None:
    with watch(impatient_gateway, triton, rss_bound_mb=32):
        attackers = [Attacker(impatient_gateway.settings.grpc_port, preface=False) for _ in range(20)]
        attackers[0].send(b"PRI * HTTP/2.0\r\n")  # half a preface is no better
        for attacker in attackers:
            closed_within(attacker, 3.5)
            attacker.close()


def test_a_header_block_left_unfinished_is_a_protocol_error(impatient_gateway: GatewayThread,
                                                            triton: LocalTriton) -> None:
    with watch(impatient_gateway, triton, rss_bound_mb=32):
        attacker = Attacker(impatient_gateway.settings.grpc_port)
        attacker.send(frame(HEADERS, 0, 1, attacker.block(request_headers())))  # no END_HEADERS, no CONTINUATION
        assert attacker.goaway(until=3.5).code == PROTOCOL_ERROR
        attacker.close()


def test_an_idle_connection_is_closed(impatient_gateway: GatewayThread, triton: LocalTriton) -> None:
    with watch(impatient_gateway, triton, rss_bound_mb=32):
        attacker = Attacker(impatient_gateway.settings.grpc_port)
        assert attacker.goaway(until=3.5).code == NO_ERROR
        closed_within(attacker, 1)
        attacker.close()


@pytest.mark.parametrize("timeout", [b"99999999999999999999999H", b"1e9S", b"-1S", b"5", b"S"])
def test_a_malformed_grpc_timeout_is_answered(gateway: GatewayThread, triton: LocalTriton, timeout: bytes) -> None:
    """Was an OverflowError inside the connection; now INVALID_ARGUMENT, and the connection lives on."""
    with watch(gateway, triton, rss_bound_mb=32):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(attacker.headers(1, request_headers(extra=[(b"grpc-timeout", timeout)]), end_stream=True)
                      + attacker.headers(3, request_headers(b"/inference.GRPCInferenceService/ServerLive"))
                      + frame(0, 1, 3, b"\x00\x00\x00\x00\x00"))
        assert attacker.statuses(1, 3) == {1: INVALID_ARGUMENT, 3: 0}
        attacker.close()


@pytest.mark.parametrize("timeout", [b"1u", b"50u"])
def test_a_deadline_below_the_floor_is_never_answered_ok_after_it(gateway: GatewayThread, triton: LocalTriton,
                                                                  timeout: bytes) -> None:
    """Triton is sent no deadline below 1 s (grpc/upstream.py says why), so the gateway keeps the
    client's: it answered at the deadline + 0.1 s, and OK when Triton answered in between (20 of
    20 calls with a 1 ms deadline, at a 1.03 ms median). No call can be answered within 50 us,
    so every one ends DEADLINE_EXCEEDED; Triton still runs each (it is left to finish there)."""
    calls = 20
    with watch(gateway, triton, rss_bound_mb=32, completed=[calls]):
        attacker = Attacker(gateway.settings.grpc_port)
        streams = list(range(1, 2 * calls, 2))
        attacker.send(b"".join(attacker.headers(stream, request_headers(extra=[(b"grpc-timeout", timeout)]))
                               + frame(0, 1, stream, infer_message()) for stream in streams))
        statuses = attacker.statuses(*streams)
        attacker.close()
    assert statuses == dict.fromkeys(streams, DEADLINE_EXCEEDED), statuses
