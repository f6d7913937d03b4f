"""gRPC calls over a fleet: ``GrpcUpstream.unary``/``open``, one server per call.

The gRPC side of ``fleet.forward`` (same rules: retry of what was never sent, passive
ejection, Triton's queue-full passed on and counted as the server's ``refused``). It lives
here, not in ``gateway.fleet``: the fleet balances and admits and knows no protocol's wire.

A call arrives addressed: the front read the message once, and hands over what the fleet
chooses by (``model``, ``version``, ``sequence``: for a ``ModelInfer`` the router's routing
fields, the version being the one it is sent to; for any other call the message's first two
fields). The fleet reads nothing of the message again.
"""

from __future__ import annotations

import asyncio

from gateway.errors import BadRequest, Overloaded, UpstreamUnavailable
from gateway.fleet.balancer import Fleet
from gateway.fleet.forward import TRITON_QUEUE_FULL
from gateway.fleet.members import Server
from gateway.grpc.client_connection import GOING_AWAY, LOST, NOT_CONNECTED
from gateway.grpc.status import FAULTS, StatusCode
from gateway.grpc.upstream import GrpcUpstream, Reply, Slot, StreamListener, UpstreamStream
from gateway.grpc.upstream import Metadata as GrpcMetadata
from gateway.grpc.wire import Message
from gateway.sequences import SequenceFields, checked_sequence_id
from gateway.upstream import NotesServer

UNAVAILABLE, RESOURCE_EXHAUSTED = StatusCode.UNAVAILABLE, StatusCode.RESOURCE_EXHAUSTED
# GrpcUpstream's own words for "nothing reached the server", and for "the connection broke".
_NOT_SENT = (NOT_CONNECTED, GOING_AWAY)
_BROKEN = (NOT_CONNECTED, GOING_AWAY, LOST)


class FleetGrpc(GrpcUpstream):
    """``GrpcUpstream.unary``/``open`` over a fleet: one HTTP/2 connection per server
    (``Server.grpc``). A subclass for the same reason as ``fleet.forward.FleetHttp``."""

    def __init__(self, fleet: Fleet) -> None:  # no super().__init__(): no connection of its own
        self.fleet = fleet

    @property
    def address(self) -> str:  # type: ignore[override]
        """Named in error details: the first server in service."""
        servers = self.fleet.in_service() or list(self.fleet.servers.values())
        return servers[0].grpc.address if servers else f"fleet '{self.fleet.name}'"

    @property
    def chooses_server(self) -> bool:  # type: ignore[override]
        """Several servers: the front reads the model and version of a call it does not route."""
        return self.fleet.single is None

    async def unary(self, path: str, message: Message, metadata: GrpcMetadata = (),
                    timeout: float | None = None, *, model: str | bytes = "", version: str | bytes | None = None,
                    sequence: SequenceFields | None = None, for_exchange: NotesServer | None = None,
                    slot: Slot | None = None) -> Reply:
        """``model``, ``version`` and ``sequence``: what the front read of the message (see the
        module's docstring); the message itself is not read here. ``for_exchange.server``: the
        server it went to, the last one tried. ``slot``: not for a fleet (it takes its servers' own)."""
        fleet = self.fleet
        single = fleet.single
        try:
            if single is not None:  # one server: nothing to choose
                model, version, server = b"", None, single
            else:
                if sequence is not None and checked_sequence_id(sequence.id) is not None:  # bounded before it is pinned
                    # pinned by the model's name, as FleetHttp pins by the name the HTTP front read:
                    # one pin per sequence, whichever port its requests come on
                    key = model if isinstance(model, str) else model.decode("utf-8", "replace")
                    server = fleet.pick_in_sequence(key, version, sequence)
                else:
                    server = fleet.pick(model, version)
            if server.limit and server.inflight >= server.limit:
                server, timeout = await self._admit(server, model, version, timeout)
            else:
                server.inflight += 1
        except Overloaded as exc:
            return RESOURCE_EXHAUSTED, exc.message, b""
        except UpstreamUnavailable as exc:
            return UNAVAILABLE, exc.message, b""
        except BadRequest as exc:  # a sequence id Triton would not take
            return StatusCode.INVALID_ARGUMENT, str(exc), b""
        if for_exchange is not None:
            for_exchange.server = server.name
        reply = await self._call(server, path, message, metadata, timeout)
        if reply[0] == UNAVAILABLE and reply[1].startswith(_NOT_SENT):
            try:
                other = fleet.pick(model, version, avoid=server)
                if other.limit and other.inflight >= other.limit:
                    other, timeout = await self._admit(other, model, version, timeout)
                else:
                    other.inflight += 1
            except (UpstreamUnavailable, Overloaded):
                return reply
            if for_exchange is not None:
                for_exchange.server = other.name  # the one that answers (or fails) last
            reply = await self._call(other, path, message, metadata, timeout)
        return reply

    async def _admit(self, server: Server, model: str | bytes, version: str | bytes | None,
                     timeout: float | None) -> tuple[Server, float | None]:
        """A slot, waited for in order; the server and what is left of the client's deadline. A
        call whose client set a deadline waits until its front cuts it there (DEADLINE_EXCEEDED,
        the client's own); one without waits at most ``request_timeout_s``, as its call would."""
        if timeout is None:
            return await self.fleet.admit(server, model, version, self.fleet.request_timeout_s), None
        loop = asyncio.get_running_loop()
        started = loop.time()
        server = await self.fleet.admit(server, model, version, None)
        return server, max(timeout - (loop.time() - started), 0.001)

    async def _call(self, server: Server, path: str, message: Message, metadata: GrpcMetadata,
                    timeout: float | None) -> Reply:
        server.requests += 1
        # the slot goes back as the call ends on the connection (or on the way out), not when this task runs again
        reply = await server.grpc.unary(path, message, metadata, timeout, slot=server.admitted())
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
            stream: UpstreamStream = await server.grpc.open(path, listener, metadata, timeout)
            return stream
        except UpstreamUnavailable as exc:
            fleet.failed(server, exc.message)
            try:
                other = fleet.pick("", None, avoid=server)
            except UpstreamUnavailable:
                raise exc from None
            if other is server:
                raise
        try:
            stream = await other.grpc.open(path, listener, metadata, timeout)
            return stream
        except UpstreamUnavailable as exc:
            fleet.failed(other, exc.message)
            raise

    async def aclose(self) -> None:
        await self.fleet.aclose()

