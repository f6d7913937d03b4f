"""HTTP requests over a fleet choose their server by what the HTTP front read, once: the fleet reads
nothing of the request again, its path included (issue 22: the second parse is gone), and notes
the server it chose on the request's exchange, the last one tried (the access log names it).

The two "servers" are small HTTP listeners on 127.0.0.1 that answer every request 200 and
remember its request line: what is tested is the fleet's choice and what the front hands it,
not Triton (tests/integration/test_fleet_access_log.py and test_fleet*.py run the same path
against two real Tritons, where a version READY on one server only is a model-control dance).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.fleet.forward import FleetHttp
from gateway.fleet.members import Server
from gateway.grpc.fleet_upstream import FleetGrpc
from gateway.grpc.status import StatusCode
from gateway.pipeline import Pipeline
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy
from gateway.sequences import SequenceFields
from gateway.telemetry.recorder import Recorder
from tests.unit.test_fleet_grpc import RecordingConnection

INFER = "/inference.GRPCInferenceService/ModelInfer"


class Listener:
    """An HTTP/1.1 server that answers every request ``200 {}`` and keeps its request line."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Listener:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.lines.append(head.split(b"\r\n", 1)[0])
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        """Refuses connections from now on, and closes the ones kept alive."""
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


class Noted:
    """What a front's exchange is to the fleet: where it notes the server it chose."""

    __slots__ = ("server",)

    def __init__(self) -> None:
        self.server = ""


@pytest.fixture
async def listeners() -> AsyncIterator[tuple[Listener, Listener]]:
    first, second = await Listener().start(), await Listener().start()
    yield first, second
    await first.stop()
    await second.stop()


@pytest.fixture
async def fleet(listeners: tuple[Listener, Listener]) -> AsyncIterator[Fleet]:
    """Two servers in service: version 1 of qc is READY on the first only, version 2 on the second only."""
    fleet = Fleet("f", grpc_connect=RecordingConnection)
    for listener, versions in zip(listeners, ({"1"}, {"2"}), strict=True):
        server = fleet.add(ServerSpec(http=f"http://127.0.0.1:{listener.port}", grpc=f"127.0.0.1:{listener.port}"))
        server.up = server.in_service = True
        server.ready = {"qc": frozenset(versions)}
    fleet.changed()
    yield fleet
    await fleet.aclose()


def servers(fleet: Fleet) -> tuple[Server, Server]:
    first, second = fleet.servers.values()
    return first, second


async def test_the_fleet_chooses_by_the_version_handed_over_not_by_the_path(
        fleet: Fleet, listeners: tuple[Listener, Listener]) -> None:
    """The path says version 1 (READY on the first server only), the front handed over version 2:
    every request goes to the second server. A path that names nothing at all goes by the fields too."""
    first, second = listeners
    upstream = FleetHttp(fleet)
    for _ in range(20):
        response = await upstream.request(b"POST", b"/v2/models/qc/versions/1/infer", [], b"{}",
                                          model="qc", version="2")
        assert response.status == 200 and response.body() == b"{}"
    assert (len(first.lines), len(second.lines)) == (0, 20)
    for _ in range(20):
        await upstream.request(b"GET", b"/nothing/to/read", [], model="qc", version="1")
    assert (len(first.lines), len(second.lines)) == (20, 20)
    assert set(first.lines) == {b"GET /nothing/to/read HTTP/1.1"}  # sent as it came: only the choice moved


async def test_the_exchange_names_the_server_and_a_retry_names_the_last_one(
        fleet: Fleet, listeners: tuple[Listener, Listener]) -> None:
    upstream = FleetHttp(fleet)
    first, second = servers(fleet)
    noted = Noted()
    await upstream.request(b"POST", b"/v2/models/qc/versions/2/infer", [], b"{}", model="qc", version="2",
                           for_exchange=noted)
    assert noted.server == second.name
    await upstream.request(b"POST", b"/v2/models/qc/versions/1/infer", [], b"{}", model="qc", version="1",
                           for_exchange=noted)
    assert noted.server == first.name
    await listeners[0].stop()  # the first refuses connections now: what went there is sent to the second
    answered = []
    for _ in range(4):  # no version: both are candidates, and two servers alternate which is drawn first
        noted = Noted()
        response = await upstream.request(b"GET", b"/v2/models/qc/ready", [], model="qc", for_exchange=noted)
        answered.append((response.status, noted.server))
    assert answered == [(200, second.name)] * 4
    assert first.requests >= 2 and first.failures >= 1, "no request was retried: the test proved nothing"


async def test_one_server_reads_nothing_of_the_request(listeners: tuple[Listener, Listener]) -> None:
    """One server has no choice to make: what the front handed over is not even looked up."""
    fleet = Fleet("single", grpc_connect=RecordingConnection)
    only = fleet.add(ServerSpec(http=f"http://127.0.0.1:{listeners[0].port}", grpc="127.0.0.1:1"))
    fleet.changed()
    noted = Noted()
    try:
        response = await FleetHttp(fleet).request(b"POST", b"/v2/models/qc/infer", [], b"{}", model="qc",
                                                  version="2", sequence=SequenceFields(5, start=True),
                                                  for_exchange=noted)
    finally:
        await fleet.aclose()
    assert response.status == 200 and noted.server == only.name
    assert not fleet._cache, "the choice was computed for one server"
    assert len(fleet.sequences) == 0, "a sequence was pinned where there is nothing to choose"


async def test_a_sequence_keeps_its_server_whichever_port_its_requests_come_on(fleet: Fleet) -> None:
    """Pins are keyed by the model's name as both fronts read it: a sequence started over HTTP and
    continued over gRPC (routed elsewhere by version) stays on its server."""
    first, second = servers(fleet)
    http, grpc = FleetHttp(fleet), FleetGrpc(fleet)
    await http.request(b"POST", b"/v2/models/qc/infer", [], b"{}", model="qc", version="2",
                       sequence=SequenceFields("s-1", start=True))
    for _ in range(10):  # routed to version 1 now (READY on the first only): the pin keeps them on the second
        await http.request(b"POST", b"/v2/models/qc/infer", [], b"{}", model="qc", version="1",
                           sequence=SequenceFields("s-1"))
        assert (await grpc.unary(INFER, b"", model="qc", version="1", sequence=SequenceFields("s-1")))[0] \
            == StatusCode.OK
    assert (first.requests, second.requests) == (0, 21)
    await http.request(b"POST", b"/v2/models/qc/infer", [], b"{}", model="qc", version="1",
                       sequence=SequenceFields("s-1", end=True))
    assert second.requests == 22 and len(fleet.sequences) == 0


# -- through the HTTP front: what it hands over is what it read of the request --------------------------------


def scope(method: str, path: str, raw_path: bytes | None = None) -> MutableMapping[str, Any]:
    return {"type": "http", "method": method, "path": path, "raw_path": raw_path or path.encode(),
            "query_string": b"", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}


async def call(proxy: HttpProxy, method: str, path: str, raw_path: bytes | None = None) -> int:
    sent: list[MutableMapping[str, Any]] = []
    messages = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> MutableMapping[str, Any]:
        message = next(messages, None)
        if message is None:  # the front watches for a disconnect: none comes
            await asyncio.Event().wait()
        assert message is not None
        return message

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await proxy(scope(method, path, raw_path), receive, send)
    status: int = sent[0]["status"]
    return status


@pytest.mark.parametrize(("path", "raw_path"), [
    ("/v2/models/qc/versions/002/infer", None),  # Triton reads 002 as 2: so does the front, once
    ("/v2/models/qc/versions/2/infer", b"/v2/models/q%63/versions/2/infer"),  # the name as decoded, not the bytes
])
async def test_the_front_hands_over_the_model_and_version_it_read(
        fleet: Fleet, listeners: tuple[Listener, Listener], path: str, raw_path: bytes | None) -> None:
    """The fleet used to split the path's raw bytes again: "002" or "q%63" named a version READY
    nowhere, and the requests went to both servers."""
    first, second = listeners
    proxy = HttpProxy(Pipeline(PolicyBook(), Recorder()), FleetHttp(fleet))
    for _ in range(20):
        assert await call(proxy, "POST", path, raw_path) == 200
    assert (len(first.lines), len(second.lines)) == (0, 20)
    assert set(second.lines) == {b"POST %s HTTP/1.1" % (raw_path or path.encode())}  # the path goes as sent


async def test_a_call_passed_through_goes_where_its_version_is(fleet: Fleet,
                                                               listeners: tuple[Listener, Listener]) -> None:
    """Metadata, readiness, statistics: not routed, still sent where the version they name is READY;
    a version Triton could not hold names none (either server answers it)."""
    first, second = listeners
    proxy = HttpProxy(Pipeline(PolicyBook(), Recorder()), FleetHttp(fleet))
    for _ in range(10):
        assert await call(proxy, "GET", "/v2/models/qc/versions/1/ready") == 200
        assert await call(proxy, "GET", "/v2/models/qc/versions/1") == 200
    assert (len(first.lines), len(second.lines)) == (20, 0)
    for _ in range(10):
        assert await call(proxy, "GET", "/v2/models/qc/versions/x\n/ready", b"/v2/models/qc/versions/x%0A/ready") == 200
    assert (len(first.lines), len(second.lines)) == (25, 5)
    assert all("x\n" not in by_version for by_version in fleet._cache.values()), "kept a version no Triton holds"
