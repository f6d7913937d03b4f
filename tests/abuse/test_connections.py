"""A cap on the gRPC port's client connections (``grpc_max_connections``): a client opening
connections by the thousand holds at most that many (each refused one for at most a second),
and a refused client is told why at once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import tritonclient.grpc
from tritonclient.utils import InferenceServerException

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from tests.abuse.attack import GOAWAY, NO_ERROR, Attacker, open_connections
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
