"""Fleet-aware stand-ins for the single-server upstream clients: same calls, one server per request.

``FleetHttp.request`` and ``FleetGrpc.unary``/``open`` take exactly what ``HttpUpstream`` and
``GrpcUpstream`` take, read the model and version the request is already addressed to (the
versioned path, or the first two fields of the protobuf message), pick a server with
:meth:`Fleet.pick`, take an admission slot, and send. Per request that is a short byte split
or two varint reads, a dict lookup and two random draws: no parsing of bodies, no locks. An
HTTP request's sequence fields come with it, read once by the HTTP front (``sequence``).

- A request that could not be sent at all (the connect was refused or timed out: nothing was
  written, and a streamed body was not read yet) is tried once more on another server.
- A connect failure or a broken exchange counts towards the server's passive ejection.
- A request in flight on a server that dies gets one clear error (HTTP 502/503, gRPC
  UNAVAILABLE) that says the gateway answered and names no server (the server's address goes
  to ``/admin/fleets`` and the log); it is not re-sent, since Triton may have run it.
- Triton's own answers pass as Triton sent them, its queue-full included (HTTP 503, gRPC
  UNAVAILABLE "Exceeds maximum queue size"): counted as the server's ``refused`` here, and
  recorded as overload (never against a version) by the recorder.
- The admission slot is held until the response headers are in (inference responses arrive
  whole); a streamed response (SSE) releases it then, not at its last chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from gateway.errors import BadRequest, ClientGone, Overloaded, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.fleet.balancer import Fleet
from gateway.fleet.members import Server
from gateway.grpc.status import FAULTS, StatusCode
from gateway.grpc.upstream import GrpcUpstream, Reply, StreamListener, UpstreamStream
from gateway.grpc.upstream import Metadata as GrpcMetadata
from gateway.grpc.wire import WireError, route_fields
from gateway.http2.client import GOING_AWAY, LOST, NOT_CONNECTED
from gateway.sequences import SequenceFields, checked_sequence_id
from gateway.upstream import HttpUpstream, UpstreamResponse

UNAVAILABLE, RESOURCE_EXHAUSTED = StatusCode.UNAVAILABLE, StatusCode.RESOURCE_EXHAUSTED
# Triton's answer when a model's queue is full (HTTP 503, gRPC UNAVAILABLE): passed on as it is.
TRITON_QUEUE_FULL = "Exceeds maximum queue size"
_QUEUE_FULL = TRITON_QUEUE_FULL.encode()
# GrpcUpstream's own words for "nothing reached the server", and for "the connection broke".
_NOT_SENT = (NOT_CONNECTED, GOING_AWAY)
_BROKEN = (NOT_CONNECTED, GOING_AWAY, LOST)


def target_model_version(target: bytes) -> tuple[bytes, bytes | None]:
    """``/v2/models/{m}[/versions/{v}]/...`` -> (m, v or None) as bytes; (b"", None) for other paths."""
    parts = target.split(b"/", 6)
    if len(parts) < 5 or parts[2] != b"models":
        return b"", None
    if len(parts) >= 7 and parts[4] == b"versions":
        return parts[3], parts[5]
    return parts[3].partition(b"?")[0], None


def message_model_version(message: bytes) -> tuple[bytes, bytes | None, bool]:
    """Fields 1 and 2 (model name and version) of a ModelInferRequest or ModelMetadataRequest.

    The last occurrence wins, as in protobuf: the router sets the version by appending a field 2
    (``grpc.wire.with_version``). Only field headers are read; every field of these messages is
    length-delimited, so the scan skips tensors without touching them. (b"", None) if absent.
    The third value says whether a ``parameters`` map (field 4, where a sequence id lives) is there.
    """
    model = version = b""
    parameters = False
    pos, size = 0, len(message)
    while pos < size:
        tag = message[pos]
        if tag & 7 != 2 or tag > 0x7F:
            break  # not a field these messages have: keep what was read
        length = message[pos + 1] if pos + 1 < size else 0
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint(message, pos + 1)
        end = pos + length
        if tag == 0x0A:
            model = message[pos:end]
        elif tag == 0x12:
            version = message[pos:end]
        elif tag == 0x22:
            parameters = True
        pos = end
    return model, version or None, parameters


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value, pos


class FleetHttp(HttpUpstream):
    """``HttpUpstream.request`` over a fleet. A subclass only so that every caller typed for the
    single-server pool (proxy, shadow, readiness probe) takes it unchanged; it has no pool of its
    own: each server has one (``Server.http``)."""

    def __init__(self, fleet: Fleet) -> None:  # no super().__init__(): no pool of its own
        self.fleet = fleet
        self.name = f"fleet '{fleet.name}'"

    @property
    def reads_sequences(self) -> bool:  # type: ignore[override]
        """Several servers: a sequence must stay on the one holding its state, so the front reads
        the sequence fields of the requests it sends here."""
        return self.fleet.single is None

    async def request(self, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                      body: bytes | AsyncIterator[bytes] = b"", *, content_length: int | None = None,
                      timeout_s: float | None = None, sequence: SequenceFields | None = None) -> UpstreamResponse:
        fleet = self.fleet
        single = fleet.single
        if single is not None:  # one server: nothing to choose, the path need not be read
            model, version, server = b"", None, single
        else:
            model, version = target_model_version(target)
            pinned = None if sequence is None else fleet.sequence_server(model, sequence.id, sequence.start)
            server = pinned or fleet.pick(model, version)
            if sequence is not None:
                fleet.pin_sequence(model, sequence.id, sequence.end, server)
        if server.limit and server.inflight >= server.limit:
            server = await fleet.admit(server, model, version)  # full: wait for a slot, or another server
        else:
            server.inflight += 1
        try:
            return await self._on(server, method, target, headers, body, content_length, timeout_s)
        except UpstreamUnavailable:
            if not isinstance(headers, (list, tuple)):
                raise  # a one-shot header iterator may have been consumed: not safe to send again
            try:
                other = fleet.pick(model, version, avoid=server)
            except UpstreamUnavailable:
                other = server
            if other is server:
                raise
            if other.limit and other.inflight >= other.limit:
                other = await fleet.admit(other, model, version)
            else:
                other.inflight += 1
            return await self._on(other, method, target, headers, body, content_length, timeout_s)

    async def _on(self, server: Server, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                    body: bytes | AsyncIterator[bytes], content_length: int | None,
                    timeout_s: float | None) -> UpstreamResponse:
        server.requests += 1
        try:
            response = await server.http.request(method, target, headers, body, content_length=content_length,
                                                 timeout_s=timeout_s)
        except (UpstreamTimeout, ClientGone):
            raise
        except UpstreamError as exc:  # refused, unreachable, or the connection broke: the server's fault
            self.fleet.failed(server, exc.message)
            raise
        finally:
            server.release()
        server.failures = 0
        if response.status >= 500:
            if response.status == 503 and response.complete and _QUEUE_FULL in response.body():
                server.refused += 1  # Triton's own overload answer: the client gets it as it is
            else:
                server.errors += 1
        return response

    @property
    def open_connections(self) -> int:
        """Data-plane connections open to every server of the fleet."""
        return sum(server.http.open_connections for server in self.fleet.servers.values())

    async def aclose(self) -> None:
        await self.fleet.aclose()


class FleetGrpc(GrpcUpstream):
    """``GrpcUpstream.unary``/``open`` over a fleet: one HTTP/2 connection per server
    (``Server.grpc``). A subclass for the same reason as :class:`FleetHttp`."""

    def __init__(self, fleet: Fleet) -> None:  # no super().__init__(): no connection of its own
        self.fleet = fleet

    @property
    def address(self) -> str:  # type: ignore[override]
        """Named in error details: the first server in service."""
        servers = self.fleet.in_service() or list(self.fleet.servers.values())
        return servers[0].grpc.address if servers else f"fleet '{self.fleet.name}'"

    async def unary(self, path: str, message: bytes, metadata: GrpcMetadata = (),
                    timeout: float | None = None) -> Reply:
        fleet = self.fleet
        single = fleet.single
        try:
            if single is not None:  # one server: nothing to choose, the message need not be read
                model, version, server = b"", None, single
            else:
                model, version, parameters = message_model_version(message)
                pinned = sequence = None
                if parameters:  # a parameters map: read it for a sequence id (requests without one skip this)
                    fields = route_fields(message)
                    sequence = checked_sequence_id(fields.sequence_id)  # bounded before it is pinned
                    if sequence is not None:
                        pinned = fleet.sequence_server(model, sequence, fields.sequence_start)
                server = pinned or fleet.pick(model, version)
                if sequence is not None:
                    fleet.pin_sequence(model, sequence, fields.sequence_end, server)
            if server.limit and server.inflight >= server.limit:
                server = await fleet.admit(server, model, version)
            else:
                server.inflight += 1
        except Overloaded as exc:
            return RESOURCE_EXHAUSTED, exc.message, b""
        except UpstreamUnavailable as exc:
            return UNAVAILABLE, exc.message, b""
        except (BadRequest, WireError) as exc:  # an id Triton would not take, or not a message at all
            return StatusCode.INVALID_ARGUMENT, str(exc), b""
        reply = await self._call(server, path, message, metadata, timeout)
        if reply[0] == UNAVAILABLE and reply[1].startswith(_NOT_SENT):
            try:
                other = fleet.pick(model, version, avoid=server)
                if other.limit and other.inflight >= other.limit:
                    other = await fleet.admit(other, model, version)
                else:
                    other.inflight += 1
            except (UpstreamUnavailable, Overloaded):
                return reply
            reply = await self._call(other, path, message, metadata, timeout)
        return reply

    async def _call(self, server: Server, path: str, message: bytes, metadata: GrpcMetadata,
                    timeout: float | None) -> Reply:
        server.requests += 1
        try:
            reply = await server.grpc.unary(path, message, metadata, timeout)
        finally:
            server.release()
        code = reply[0]
        if code == UNAVAILABLE:
            if reply[1].startswith(_BROKEN):
                self.fleet.failed(server, reply[1])
                return reply
            if TRITON_QUEUE_FULL in reply[1]:
                server.refused += 1  # Triton's own overload answer: the client gets it as it is
                server.failures = 0
                return reply
        server.failures = 0
        if code != 0 and code in FAULTS:
            server.errors += 1
        return reply

    async def open(self, path: str, listener: StreamListener, metadata: GrpcMetadata = (),
                   timeout: float | None = None) -> UpstreamStream:
        """A ModelStreamInfer stream may carry requests for any model: it goes to a server
        picked for no particular version, and stays there (no admission slot: it is long-lived).
        UpstreamUnavailable if none could start; a server that could not be reached (nothing was
        sent) is counted, and the stream is tried once on another."""
        fleet = self.fleet
        server = fleet.pick("", None)
        try:
            return await server.grpc.open(path, listener, metadata, timeout)
        except UpstreamUnavailable as exc:
            fleet.failed(server, exc.message)
            try:
                other = fleet.pick("", None, avoid=server)
            except UpstreamUnavailable:
                raise exc from None
            if other is server:
                raise
        try:
            return await other.grpc.open(path, listener, metadata, timeout)
        except UpstreamUnavailable as exc:
            fleet.failed(other, exc.message)
            raise

    async def aclose(self) -> None:
        await self.fleet.aclose()

