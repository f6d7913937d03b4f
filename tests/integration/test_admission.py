"""Admission sheds only what Triton would not serve (issue 37), against a real Triton.

100 clients at once on a model made 50 ms slow: Triton runs one at a time (qc has no dynamic
batcher), so it serves all 100 in ~5 s, and the gateway answers no 429 of its own with its
defaults: a request past ``max_inflight_per_server`` waits in order until its deadline, not at
most a second on a queue as short as the limit. And a slot counts what is at Triton: the
upstream connection gives it back as the answer arrives, before the request's task runs again.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.fleet.forward import FleetHttp
from gateway.fleet.members import Server
from gateway.grpc.fleet_upstream import FleetGrpc
from gateway.grpc.status import StatusCode
from gateway.grpc.upstream import GrpcUpstream
from gateway.upstream import HttpUpstream
from tests.conftest import Faults
from tests.fleet_support import INFER, infer_message
from tests.support import INFER_BODY, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
CLIENTS = 100  # half over HTTP, half over gRPC, all at once
DELAY_MS = 50


async def one_request_each(http_url: str, grpc_address: str, clients: int) -> Counter[str]:
    """``clients`` requests at once, each on its own connection (HTTP) or stream (gRPC): their answers."""
    http = HttpUpstream(http_url, max_connections=clients, request_timeout_s=60)
    grpc = [GrpcUpstream(grpc_address) for _ in range(4)]
    message = infer_message()

    async def over_http() -> str:
        response = await http.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
        await response.read()
        return f"http {response.status}"

    async def over_grpc(index: int) -> str:
        code, details, _ = await grpc[index % len(grpc)].unary(INFER, message, (), 60.0)
        return f"grpc {StatusCode(code).name}" + (f" {details}" if code else "")

    try:
        answers = await asyncio.gather(*(over_http() if i % 2 else over_grpc(i) for i in range(clients)))
    finally:
        await http.aclose()
        for client in grpc:
            await client.aclose()
    return Counter(answers)


def test_a_hundred_clients_on_a_slow_model_get_no_refusal_from_the_gateway(triton: LocalTriton,
                                                                              faults: Faults) -> None:
    faults.set("qc", "2", delay_ms=DELAY_MS)
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}})
    assert settings.max_inflight_per_server < CLIENTS, "the limit is reached: requests wait at the gateway"
    with GatewayThread(settings) as gw:
        answers = asyncio.run(one_request_each(gw.url, f"127.0.0.1:{settings.grpc_port}", CLIENTS))
        assert answers == Counter({"http 200": CLIENTS // 2, "grpc OK": CLIENTS // 2}), answers
        (server,) = gw.app.fleets.default.servers.values()
        assert server.refused == 0 and server.inflight == 0 and not server.waiters


def fleet_on(triton: LocalTriton) -> tuple[Fleet, Server]:
    fleet = Fleet("default", grpc_connect=GrpcUpstream, max_inflight=4)
    server = fleet.add(ServerSpec(http=triton.http_url, grpc=triton.grpc_url))
    server.up = server.in_service = True
    fleet.changed()
    return fleet, server


async def test_a_slot_is_given_back_by_the_answer_not_by_the_request_running_again(
        triton: LocalTriton, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a busy loop a request's task runs again long after Triton answered it; a slot released
    there counted requests Triton had finished. Each release here is made from the upstream
    connection's callback (no task is running), on both protocols."""
    released_in: list[asyncio.Task[object] | None] = []
    release = Server.release

    def recorded(server: Server) -> None:
        released_in.append(asyncio.current_task())
        release(server)

    monkeypatch.setattr(Server, "release", recorded)
    fleet, server = fleet_on(triton)
    try:
        response = await FleetHttp(fleet).request(b"POST", b"/v2/models/qc/versions/2/infer", [], INFER_BODY,
                                                  model="qc", version="2")
        assert response.status == 200 and server.inflight == 0
        code, _, _ = await FleetGrpc(fleet).unary(INFER, infer_message(version="2"), (), 10.0, model="qc",
                                                 version="2")
        assert code == StatusCode.OK and server.inflight == 0
        assert released_in == [None, None], "released by the connection as the answer arrived, in no task"
    finally:
        await fleet.aclose()
