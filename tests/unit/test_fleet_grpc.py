"""gRPC calls over a fleet choose their server by what the front read, once: the fleet reads nothing
of the message again (issue 22: the second parse is gone).

No sockets: each server's gRPC connection is a recorder made by the fleet's ``grpc_connect``
factory, which is what the factory is for; what is tested is the choice, not the transport
(tests/integration/test_fleet*.py run the same path against two real Tritons).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

import gateway.grpc.wire as wire
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.fleet.members import Server
from gateway.grpc.fleet_upstream import FleetGrpc
from gateway.grpc.router import GrpcRouter
from gateway.grpc.status import StatusCode
from gateway.pipeline import Pipeline
from gateway.policy_book import PolicyBook
from gateway.sequences import SequenceFields
from gateway.telemetry.recorder import Recorder

INFER = "/inference.GRPCInferenceService/ModelInfer"
# Not a protobuf message at all: any attempt to read it would find no model, version or sequence.
UNREADABLE = b"\xff\xfe\xfd not a ModelInferRequest"


class RecordingConnection:
    """A server's gRPC connection that answers OK and remembers the calls it carried."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.calls: list[bytes] = []

    async def unary(self, path: str, message: bytes, metadata: Any = (),
                    timeout: float | None = None, *, slot: Any = None) -> tuple[int, str, bytes]:
        self.calls.append(message)
        if slot is not None:
            slot.release()  # answered: as the real connection does when the call ends
        return StatusCode.OK, "", b"answer"

    async def open(self, path: str, listener: Any, metadata: Any = (), timeout: float | None = None) -> Any:
        raise AssertionError("not used here")

    async def aclose(self) -> None:
        return None


@pytest.fixture
def fleet() -> Fleet:
    """Two servers in service: version 1 of qc is READY on the first only, version 2 on the second only."""
    fleet = Fleet("f", grpc_connect=RecordingConnection)
    for index, versions in enumerate(({"1"}, {"2"})):
        server = fleet.add(ServerSpec(http=f"http://10.0.0.{index}:8000", grpc=f"10.0.0.{index}:8001"))
        server.up = server.in_service = True
        server.ready = {"qc": frozenset(versions)}
    fleet.changed()
    return fleet


@pytest.fixture
def parsers_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader of a request message fails loudly if the fleet path calls it, under whatever
    name a gateway module imported it."""
    def refuse(*_args: object, **_kwargs: object) -> Any:
        raise AssertionError("the fleet read the message a second time")

    readers = {wire.route_fields, wire.message_model_version}
    for name, module in list(sys.modules.items()):
        if name.startswith("gateway.") and module is not None:
            for attribute, value in list(vars(module).items()):
                if any(value is reader for reader in readers):
                    monkeypatch.setattr(module, attribute, refuse)


def served(server: Server) -> int:
    connection = server.grpc
    assert isinstance(connection, RecordingConnection)
    return len(connection.calls)


async def test_the_fleet_picks_by_the_version_the_front_hands_over_not_by_the_message(
        fleet: Fleet, parsers_fail: None) -> None:
    first, second = fleet.servers.values()
    upstream = FleetGrpc(fleet)
    for _ in range(40):
        assert await upstream.unary(INFER, UNREADABLE, model="qc", version="2") == (StatusCode.OK, "", b"answer")
    assert (served(first), served(second)) == (0, 40)  # only the second has version 2 READY
    for _ in range(40):
        await upstream.unary(INFER, UNREADABLE, model="qc", version="1")
    assert (served(first), served(second)) == (40, 40)


async def test_a_sequence_handed_over_by_the_front_stays_on_its_server(fleet: Fleet, parsers_fail: None) -> None:
    first, second = fleet.servers.values()
    upstream = FleetGrpc(fleet)
    await upstream.unary(INFER, UNREADABLE, model="qc", version="2", sequence=SequenceFields(7, start=True))
    assert (served(first), served(second)) == (0, 1)
    for _ in range(20):  # routed to version 1 now (READY on the first only): the pin keeps it on the second
        await upstream.unary(INFER, UNREADABLE, model="qc", version="1", sequence=SequenceFields(7))
    assert (served(first), served(second)) == (0, 21)
    await upstream.unary(INFER, UNREADABLE, model="qc", version="1", sequence=SequenceFields(7, end=True))
    assert served(second) == 22 and len(fleet.sequences) == 0  # the end released the pin


async def test_a_sequence_id_triton_would_not_take_is_refused_before_it_is_pinned(
        fleet: Fleet, parsers_fail: None) -> None:
    code, details, _ = await FleetGrpc(fleet).unary(INFER, UNREADABLE, model="qc", version="2",
                                                    sequence=SequenceFields("s" * 129, start=True))
    assert code == StatusCode.INVALID_ARGUMENT and "sequence" in details
    assert len(fleet.sequences) == 0 and sum(served(server) for server in fleet.servers.values()) == 0


METADATA = "/inference.GRPCInferenceService/ModelMetadata"


def metadata_request(name: str, version: str) -> bytes:
    from tritonclient.grpc import service_pb2

    return bytes(service_pb2.ModelMetadataRequest(name=name, version=version).SerializeToString())


async def test_a_call_the_router_does_not_route_goes_where_its_version_is_ready(fleet: Fleet) -> None:
    """ModelMetadata & co.: the router reads the model and version once (the fleet used to read
    them itself), so the call still reaches a server that has that version READY."""
    first, second = fleet.servers.values()
    router = GrpcRouter(Pipeline(PolicyBook(), Recorder()), FleetGrpc(fleet))
    for _ in range(40):
        assert (await router.pass_through(METADATA, metadata_request("qc", "2"), (), None))[0] == StatusCode.OK
    assert (served(first), served(second)) == (0, 40)
    for _ in range(40):
        await router.pass_through(METADATA, metadata_request("qc", "1"), (), None)
    assert (served(first), served(second)) == (40, 40)


async def test_one_server_reads_nothing_of_a_call_it_does_not_route(parsers_fail: None) -> None:
    """One server has no choice to make: the message is not read at all."""
    fleet = Fleet("single", grpc_connect=RecordingConnection)
    only = fleet.add(ServerSpec(http="http://10.0.0.9:8000", grpc="10.0.0.9:8001"))
    fleet.changed()
    router = GrpcRouter(Pipeline(PolicyBook(), Recorder()), FleetGrpc(fleet))
    assert (await router.pass_through(METADATA, UNREADABLE, (), None))[0] == StatusCode.OK
    assert served(only) == 1


async def test_a_call_passed_through_names_to_the_fleet_only_what_triton_could_hold(fleet: Fleet) -> None:
    """As HTTP's (test_fleet_http.py): the router used to hand the message's bytes over as they
    were, so 5,000 made-up versions or 300-byte names each took an entry of the fleet's choice
    cache (and filled it to its cap). A version that is not at most 19 digits, or a name Triton
    could not hold, names nothing now: either server answers it, and the cache keeps nothing of it.
    A version is read as Triton reads it ("0002" is 2: where version 2 is READY)."""
    first, second = fleet.servers.values()
    router = GrpcRouter(Pipeline(PolicyBook(), Recorder()), FleetGrpc(fleet))
    for index in range(200):
        for message in (metadata_request("qc", f"x{index}"), metadata_request("qc", "9" * 20 + str(index)),
                        metadata_request("q" * 256 + str(index), "1"), metadata_request(f"q\n{index}", "1")):
            assert (await router.pass_through(METADATA, message, (), None))[0] == StatusCode.OK
    assert served(first) + served(second) == 800
    cached = [(model, version) for model, by_version in fleet._cache.items() for version in by_version]
    assert len(cached) <= 2, f"kept {len(cached)} choices for names and versions no Triton holds"
    before = served(first), served(second)
    for _ in range(10):
        await router.pass_through(METADATA, metadata_request("qc", "0002"), (), None)
    assert (served(first), served(second)) == (before[0], before[1] + 10), "0002 is version 2, READY on the second"
