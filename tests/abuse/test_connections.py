"""Caps on client connections: the gRPC port's own (``grpc_max_connections``), and one client
address's share of either port (``max_connections_per_client``). A client opening connections by
the thousand holds at most that many (each refused one for at most a second), and a refused
client is told why at once."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import pytest
import tritonclient.grpc
from tritonclient.utils import InferenceServerException

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from tests.abuse.attack import (
    DATA,
    END_STREAM,
    GOAWAY,
    NO_ERROR,
    Attacker,
    frame,
    infer_message,
    open_connections,
    request_headers,
)
from tests.fleet_support import drive_grpc
from tests.support import GatewayThread, gateway_settings, wait_for

pytestmark = pytest.mark.triton
CAP = 4


def test_a_connection_over_the_cap_is_told_why_and_a_freed_slot_serves_again(triton: LocalTriton) -> None:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}}, grpc_max_connections=CAP)
    with GatewayThread(settings) as gateway:
        port = gateway.settings.grpc_port

        held = [Attacker(port) for _ in range(CAP)]
        wait_for(lambda: open_connections(gateway) == CAP, 5, what=f"{CAP} connections accepted")

        refused = Attacker(port)
        frames = refused.frames(until=3.0, stop=None)  # to the close
        goaway = next(f for f in frames if f.kind == GOAWAY)
        last_stream_id = int.from_bytes(goaway.payload[:4], "big")
        assert goaway.code == NO_ERROR and last_stream_id == 0, goaway
        assert b"grpc_max_connections" in goaway.payload[8:], goaway.payload
        assert refused.closed, "the refused connection was not closed"
        assert open_connections(gateway) == CAP  # refused connections are not counted against the cap

        # Real clients while the port is full: a clear failure at once, no hang.
        started = time.monotonic()
        codes = asyncio.run(drive_grpc(f"127.0.0.1:{port}", 1, concurrency=1))
        assert set(codes) == {StatusCode.UNAVAILABLE}, codes
        client = tritonclient.grpc.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as refusal:
            client.is_server_ready(client_timeout=5)
        client.close()
        assert refusal.value.status() == "StatusCode.UNAVAILABLE", refusal.value
        assert "grpc_max_connections" in str(refusal.value), refusal.value
        assert time.monotonic() - started < 5

        held[0].close()
        wait_for(lambda: open_connections(gateway) == CAP - 1, 5, what="a closed connection to free its slot")
        codes = asyncio.run(drive_grpc(f"127.0.0.1:{port}", 20, concurrency=1))
        assert codes == Counter({StatusCode.OK: 20}), codes
        for attacker in held[1:]:
            attacker.close()


# -- one client address cannot take the port: max_connections_per_client, both ports (issue 22) --

def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the gateway from ``source``, another loopback address (127.0.0.0/8 is all
    local): another client, as far as the gateway can tell."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def http_get(sock: socket.socket, path: bytes = b"/healthz") -> tuple[int, bytes]:
    sock.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: gateway\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), b"0"))
    while len(body) < length:
        body += sock.recv(1 << 16)
    return int(head.split()[1]), body


def test_one_address_holds_at_most_its_share_of_either_port(triton: LocalTriton) -> None:
    """127.0.0.1 holds CAP connections on each port; its next one is refused as each port refuses
    at its own cap (HTTP 503 JSON + Retry-After; gRPC UNAVAILABLE naming the setting, GOAWAY),
    while a client from 127.0.0.2 is served on both. A slot freed serves again."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}}, max_connections_per_client=CAP)
    with GatewayThread(settings) as gateway:
        http_port, grpc_port = gateway.settings.port, gateway.settings.grpc_port
        held_http = [connect_from("127.0.0.1", http_port) for _ in range(CAP)]
        held_grpc = [Attacker(grpc_port) for _ in range(CAP)]
        wait_for(lambda: open_connections(gateway) == CAP, 5, what=f"{CAP} gRPC connections accepted")
        try:
            refused = connect_from("127.0.0.1", http_port)
            status, body = http_get(refused)
            assert (status, json.loads(body)) == (503, {"error": f"this client address has {CAP} connections open "
                                                                 "(max_connections_per_client): retry shortly"})
            refused.close()
            codes = asyncio.run(drive_grpc(f"127.0.0.1:{grpc_port}", 1, concurrency=1))
            assert set(codes) == {StatusCode.UNAVAILABLE}, codes
            attacker = Attacker(grpc_port)
            goaway = next(f for f in attacker.frames(until=3.0, stop=None) if f.kind == GOAWAY)
            assert b"(max_connections_per_client)" in goaway.payload[8:], goaway.payload
            attacker.close()
            assert open_connections(gateway) == CAP  # refused connections are not counted

            other = connect_from("127.0.0.2", http_port)  # another address: served on both ports
            assert http_get(other)[0] == 200
            other.close()
            other_grpc = Attacker(grpc_port, source="127.0.0.2")
            other_grpc.send(other_grpc.headers(1, request_headers()) + frame(DATA, END_STREAM, 1, infer_message()))
            assert other_grpc.statuses(1) == {1: 0}
            other_grpc.close()

            held_http.pop().close()
            held_grpc.pop().close()
            wait_for(lambda: open_connections(gateway) == CAP - 1, 5, what="a closed connection to free its slot")
            again = connect_from("127.0.0.1", http_port)
            assert http_get(again)[0] == 200
            again.close()
            assert set(asyncio.run(drive_grpc(f"127.0.0.1:{grpc_port}", 5, concurrency=1))) == {StatusCode.OK}
        finally:
            for sock in held_http:
                sock.close()
            for held in held_grpc:
                held.close()
