"""A fleet's sequence -> server pins on two real Triton servers (issue 22): one client's sequence
starts cannot push another client's sequences off their servers, and a shadow copy never moves
a primary's pin.

Triton keeps a sequence's state in the one server that saw its start; a continuation sent to
the other fails there ("must specify the START flag"). The sample ``seq`` model answers the
running sum of its sequence times the version, so a 200 with the right sum proves the request
reached the server holding the state.

Clients are told apart as the gateway does: the test's calls come from 127.0.0.1, a trusted
proxy here, so each client is the address its ``x-forwarded-for`` names.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.test_sequence_pins import grpc_step
from tests.fleet_support import fleet_settings
from tests.support import GatewayThread

pytestmark = pytest.mark.triton
TABLE, QUOTA, ATTACK = 100, 10, 300
VICTIM, ATTACKER = "198.51.100.7", "203.0.113.66"
# Continued in an order other than their starts': with two servers a balancer without pins
# alternates, so some continuation is sent to the server that did not see its start.
VICTIM_SEQUENCES = (9301, 9302, 9303, 9304)
CONTINUE_ORDER = (9301, 9303, 9302, 9304)


@contextmanager
def fleet_gateway(pair: tuple[LocalTriton, LocalTriton], **policy: Any) -> Iterator[GatewayThread]:
    settings = fleet_settings(*pair, trusted_proxies=["127.0.0.1/32"], max_sequence_pins=TABLE,
                              max_sequence_pins_per_client=QUOTA,
                              policies={"seq": {"weights": {"1": 100}, "sequence_affinity": True, **policy}})
    with GatewayThread(settings) as gw:
        assert gw.app.fleets.default.single is None, "two servers: the fleet chooses, and pins sequences"
        yield gw


def http_step(gw: GatewayThread, client: str, sequence_id: int, value: int, start: bool = False,
              end: bool = False, tensor: str = "INPUT0",
              connection: http.client.HTTPConnection | None = None) -> tuple[int, Any]:
    """One request of a sequence (a new connection unless one is given: a victim idle through the
    attack would meet the gateway's keep-alive timeout, which says nothing of pins)."""
    body = json.dumps({"parameters": {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end},
                       "inputs": [{"name": tensor, "datatype": "INT32", "shape": [1, 1], "data": [value]}]})
    own = connection is None
    conn = connection or http.client.HTTPConnection("127.0.0.1", gw.settings.port, timeout=30)
    try:
        conn.request("POST", "/v2/models/seq/infer", body,
                     {"Content-Type": "application/json", "x-forwarded-for": client})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        if own:
            conn.close()


def test_one_clients_sequence_starts_do_not_move_another_clients_sequences_off_their_servers(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """A fleet pin table of 100 with a quota of 10 per client (scaled down through the same settings
    as the version pins). The victim starts four sequences; the attacker starts 300 (requests
    Triton refuses, but each is pinned before it is forwarded); every victim continuation must
    still reach the server holding its sum. Before the quota the attacker's pins, which had no
    owner, pushed the victim's out and its continuations went wherever the balancer sent them."""
    with fleet_gateway(triton_pair) as gw:
        for sequence_id in VICTIM_SEQUENCES:
            status, answer = http_step(gw, VICTIM, sequence_id, 5, start=True)
            assert status == 200 and answer["outputs"][0]["data"][0] == 5, answer
        attacker = http.client.HTTPConnection("127.0.0.1", gw.settings.port, timeout=30)
        try:
            for sequence_id in range(400_000, 400_000 + ATTACK):
                status, answer = http_step(gw, ATTACKER, sequence_id, 1, start=True, tensor="NOPE",
                                           connection=attacker)
                assert status == 400, answer  # Triton refuses the tensor: its batcher holds nothing
        finally:
            attacker.close()
        fleet_pins = gw.app.fleets.default.sequences
        assert fleet_pins.held_by(ATTACKER) == QUOTA and fleet_pins.held_by(VICTIM) == len(VICTIM_SEQUENCES)
        for sequence_id in CONTINUE_ORDER:
            status, answer = http_step(gw, VICTIM, sequence_id, 2)
            assert status == 200, f"sequence {sequence_id} continued on a server without its state: {answer}"
            assert answer["outputs"][0]["data"][0] == 7, answer
        for sequence_id in VICTIM_SEQUENCES:
            status, answer = http_step(gw, VICTIM, sequence_id, 1, end=True)
            assert status == 200 and answer["outputs"][0]["data"][0] == 8, answer
        assert fleet_pins.held_by(VICTIM) == 0, "the ends let the victim's pins go"


def test_a_shadow_copy_of_a_grpc_sequence_start_does_not_move_its_pin(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """Version 2 shadows every request. A gRPC copy carried the primary's sequence fields, so the
    copy of a start was pinned too, to the server the balancer picked for the copy (the other
    one, with two servers alternating), and the sequence's next request went there and failed.
    A copy now carries none, as HTTP copies never did: it never makes or moves a pin."""
    with fleet_gateway(triton_pair, shadow={"version": "2", "percent": 100}) as gw:
        stats = gw.app.recorder.shadow_stats("seq", "2")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.settings.grpc_port}")
        try:
            for sequence_id in VICTIM_SEQUENCES:
                before = stats.requests
                started = grpc_step(client, VICTIM, sequence_id, 5, start=True)
                assert started.get_response().model_version == "1"
                deadline = time.monotonic() + 30
                while stats.requests == before and time.monotonic() < deadline:  # the copy was sent
                    time.sleep(0.01)
                assert stats.requests > before, "the shadow copy of the start was never sent"
                continued = grpc_step(client, VICTIM, sequence_id, 2)  # raises on "must specify the START flag"
                assert continued.as_numpy("OUTPUT0")[0][0] == 7
                # the gRPC front hands the client over too: the fleet's pin is the victim's
                assert gw.app.fleets.default.sequences.held_by(VICTIM) == 1
                ended = grpc_step(client, VICTIM, sequence_id, 1, end=True)
                assert ended.as_numpy("OUTPUT0")[0][0] == 8
        finally:
            client.close()
