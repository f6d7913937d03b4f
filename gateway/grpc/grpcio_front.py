"""``inference.GRPCInferenceService`` on grpcio's server (``grpc_server: grpcio``), forwarded to Triton.

The fallback to our own HTTP/2 server (``grpc.front``): a generic handler with no
(de)serializers, so requests and responses stay raw bytes. ``ModelInfer`` goes through the
shared ``GrpcRouter``; ``ModelStreamInfer`` through the same upstream client as the lean front
(``GrpcUpstream.open`` / the fleet's ``FleetGrpc.open``), each message routed: so a stream gets
its server picked across the fleet, keepalive PINGs that find a hung Triton, and only the
gateway's own words when the connection fails (a grpc.aio channel had none of these: a SIGSTOPped
Triton held streams for ever, and a DNS failure put Triton's host name in the client's status).
Every other unary method passes through unchanged. Deadlines propagate; a call its client
cancels is left to finish upstream, never reset (``grpc.upstream``).
``grpc.health.v1.Health`` is answered here from the gateway's readiness (``grpc.health``).

The lean server's bounds, as far as grpcio lets them be kept (issue 22):

- **Messages.** grpcio's core assembles and inflates each message before any Python code sees
  it, so ``grpc_max_message_bytes`` is its ``max_receive_message_length`` (the core applies it to
  the inflated size too) and ``grpc_max_concurrent_streams`` its ``max_concurrent_streams``:
  those bound what the core holds (and ``grpc_preface_timeout_s``/``grpc_idle_timeout_s`` how long
  a silent or callless connection stays). Was unbounded: four gzip messages of 200 MiB (~200 KB each on
  the wire) grew the process by ~870 MB. From the moment the handler has a message to the
  moment it lets it go (a unary request: its whole call; a stream message: until it is on its
  way upstream) it is charged to the gateway's one ``ByteBudget``, released in ``finally``;
  past it: UNAVAILABLE, as on the lean server. What the core holds before that is not charged:
  grpcio says nothing of a message before it is whole and inflated.
- **Connections per client address.** grpcio tells Python nothing of connections: no accept, no
  close, no way to refuse one. A connection is seen only through its calls (``context.peer()``
  is address:port, one per connection), so ``max_connections_per_client`` counts, per address,
  the connections with calls in flight; a call on one more is answered UNAVAILABLE with the lean
  server's reason. Idle connections are not counted (they hold a socket, not a call; the idle
  timeout closes them). ``grpc_max_connections`` is not set as grpcio's
  ``grpc.max_allowed_incoming_connections``: with idle connections uncounted per address, one
  client could fill it and lock every other out (measured: 3,000 idle connections from one
  address with the per-address cap at 4, and another address was still served in 0.13 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from gateway.byte_budget import ByteBudget
from gateway.client_address import client_key, grpcio_peer
from gateway.control_surface import ControlGate
from gateway.errors import GatewayError
from gateway.grpc.health import HEALTH, Health, grpcio_handlers
from gateway.grpc.router import SERVICE, GrpcRouter, StreamLedger, client_deadline_ran_out
from gateway.grpc.status import StatusCode, status_for
from gateway.grpc.upstream import UpstreamStream
from gateway.grpc.wire import WireError, split_messages
from gateway.http2.endpoint import Headers
from gateway.http2.server_stream import Limits
from gateway.pipeline import SEQUENCED

log = logging.getLogger("gateway.grpc")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1)]
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
# Request bytes a stream may have waiting for Triton's flow-control window before the client's
# next message is read: Triton reading slower than the client sends pauses the client.
STREAM_BACKLOG = 1 << 20
# Reply bytes a stream may have waiting for its client (grpcio writes one at a time, each once the
# client's window takes it) before Triton's stream gets no more credit: a client that reads none
# parks this plus what is left of the upstream window, not every reply (they queued without bound).
REPLY_BACKLOG = 256 << 10


class GrpcProxy(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, router: GrpcRouter, gate: ControlGate | None = None, health: Health | None = None,
                 budget: ByteBudget | None = None, max_connections_per_client: int = 256) -> None:
        self.router = router
        self.health = grpcio_handlers(health) if health is not None else {}
        self.gate = gate  # None: Triton control calls pass through (triton_control=allow)
        # the gateway's one budget of bytes held for requests, shared with the HTTP port (proxy.limits)
        self.budget = budget if budget is not None else ByteBudget(1 << 62)
        self.callers = CallingConnections(max_connections_per_client)
        self._handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._handlers.get(method, False)
        if handler is False:
            built = self._build(method)
            handler = self._handlers[method] = None if built is None else self._guarded(built)
        return handler

    def _guarded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """Every call under the per-address cap; a unary request charged to the budget for its call."""
        admitted = self._admitted
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def charged_unary(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                async with admitted(context, len(raw)):
                    answer: bytes = await unary(raw, context)
                    return answer

            return grpc.unary_unary_rpc_method_handler(charged_unary)
        if handler.unary_stream is not None:
            replies = handler.unary_stream

            async def charged_replies(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async with admitted(context, len(raw)):
                    async for answer in replies(raw, context):
                        yield answer

            return grpc.unary_stream_rpc_method_handler(charged_replies)
        assert handler.stream_stream is not None  # the only other kind built here; its messages are charged in _pump
        streamed = handler.stream_stream

        async def counted_stream(requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            async with admitted(context, 0):
                async for answer in streamed(requests, context):
                    yield answer

        return grpc.stream_stream_rpc_method_handler(counted_stream)

    @contextlib.asynccontextmanager
    async def _admitted(self, context: grpc.aio.ServicerContext, size: int) -> AsyncIterator[None]:
        """The call counted on its connection and ``size`` request bytes charged, both until it ends;
        or UNAVAILABLE (the cap's or the budget's words), nothing kept."""
        peer = context.peer() or ""
        refusal = self.callers.enter(peer)
        if refusal:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        try:
            if not self.budget.try_take(size):
                await context.abort(grpc.StatusCode.UNAVAILABLE, over_budget(self.budget))
            try:
                yield
            finally:
                self.budget.release(size)
        finally:
            self.callers.leave(peer)

    def _build(self, method: str) -> grpc.RpcMethodHandler | None:
        if method.startswith(HEALTH):
            return self.health.get(method)  # None: UNIMPLEMENTED
        if not method.startswith(SERVICE):
            return None  # UNIMPLEMENTED, as Triton would answer
        if method.endswith("/ModelStreamInfer"):
            async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for response in self._stream(method, requests, context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream)
        if method.endswith("/ModelInfer"):
            async def infer(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                return await self._infer(method, raw, context)

            return grpc.unary_unary_rpc_method_handler(infer)

        async def passthrough(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            forwarded: Any = _forwarded(context)
            if self.gate is not None:  # Triton model control is refused here, or admitted and audited
                client = self.router.pipeline.clients.of(grpcio_peer(context.peer()), _wire(forwarded))
                refused, details, forwarded = await self.gate.admit_grpc(method, raw, forwarded, client)
                if refused:
                    await context.abort(_STATUS[refused], details)
            code, details, answer = await self.router.pass_through(method, raw, forwarded,
                                                                   context.time_remaining())
            if code:
                await context.abort(_STATUS.get(code, grpc.StatusCode.UNKNOWN), self.router.details(code, details))
            return answer

        return grpc.unary_unary_rpc_method_handler(passthrough)

    async def _infer(self, method: str, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = context.invocation_metadata() or ()
        try:
            fields, policy, decision = self.router.route(raw, _wire(metadata))
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ModelInferRequest: {exc}")
            raise
        client = self.router.pipeline.clients.of(grpcio_peer(context.peer()), _wire(metadata))
        if decision is SEQUENCED:
            decision = await self.router.settle(fields, policy, _wire(metadata), client)
        exchange = self.router.new_infer(method, raw, fields, _forwarded(context, metadata), context.time_remaining(),
                                         client)
        decision = await self.router.infer(exchange, fields.model_name, policy, decision, client)
        # after any fallback: the version that answered
        await context.send_initial_metadata(self.router.announced(decision, exchange.response))
        if exchange.code:
            await context.abort(_STATUS.get(exchange.code, grpc.StatusCode.UNKNOWN),
                                self.router.details(exchange.code, exchange.details))
        return exchange.response

    async def _stream(self, method: str, requests: AsyncIterator[bytes],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        router = self.router
        metadata = context.invocation_metadata() or ()
        wire = _wire(metadata)
        # each reply charged to its own request's decision, and to the stream's client
        ledger = StreamLedger(router.pipeline.clients.of(grpcio_peer(context.peer()), wire))
        remaining = context.time_remaining()
        opened = time.monotonic()
        relay = _StreamRelay()
        try:
            upstream = await router.open_stream(ledger.client, method, relay, _forwarded(context, metadata), remaining)
        except GatewayError as exc:  # no server could take it: the gateway's own words, no address
            refusal = status_for(exc)
            await context.abort(_STATUS.get(refusal, grpc.StatusCode.UNKNOWN), router.details(refusal, exc.message))
            raise
        relay.upstream = upstream
        pump = asyncio.get_running_loop().create_task(self._pump(requests, upstream, relay, wire, ledger))
        announced = False
        try:
            while True:
                response = await relay.replies.get()
                if response is None:
                    break
                relay.taken(response)
                last = ledger.last
                if not announced and last is not None:
                    await context.send_initial_metadata(router.announced(last.decision))
                announced = True
                yield router.record_stream_reply(ledger, response)
            code, details = relay.closed or (int(StatusCode.UNKNOWN), "")
            if code:
                # a malformed message is the client's, the budget running out the gateway's: not a version's
                if code != StatusCode.INVALID_ARGUMENT and not relay.busy:
                    router.record_stream_end(ledger, code,
                                             client_deadline_ran_out(code, remaining, time.monotonic() - opened))
                await context.abort(_STATUS.get(code, grpc.StatusCode.UNKNOWN), router.details(code, details))
        except asyncio.CancelledError:  # the client went away, or grpcio ended the call at the client's deadline
            cancelled = grpc.StatusCode.CANCELLED.value[0]
            router.record_stream_end(ledger, cancelled,
                                     client_deadline_ran_out(cancelled, remaining, time.monotonic() - opened))
            raise
        finally:  # the call ended, or the client went away: nothing of it may stay open upstream
            pump.cancel()
            if relay.closed is None:
                upstream.cancel()

    async def _pump(self, requests: AsyncIterator[bytes], upstream: UpstreamStream, relay: _StreamRelay,
                    wire: list[tuple[bytes, bytes]], ledger: StreamLedger) -> None:
        """The client's messages, routed, up the stream; paused while Triton's window is full. Each
        message is charged to the budget until it is on its way (the next is not read before)."""
        router, budget = self.router, self.budget
        try:
            async for raw in requests:
                if not budget.try_take(len(raw)):
                    relay.busy = True
                    relay.on_close(StatusCode.UNAVAILABLE, over_budget(budget))
                    upstream.cancel()
                    return
                try:
                    fields, policy, decision = router.route(raw, wire)
                    if decision is SEQUENCED:
                        decision = await router.settle(fields, policy, wire, ledger.client)
                    upstream.send(router.stream_send(ledger, raw, fields.model_name, decision))
                    while upstream.backlog > STREAM_BACKLOG and relay.closed is None:
                        relay.drained.clear()
                        await relay.drained.wait()
                finally:
                    budget.release(len(raw))
            upstream.end()
        except WireError as exc:
            relay.on_close(StatusCode.INVALID_ARGUMENT, f"malformed ModelInferRequest: {exc}")
            upstream.cancel()
        except Exception as exc:  # a bug, or the client's side broke: the stream ends, never hangs
            if not isinstance(exc, grpc.aio.AbortError):
                log.exception("gRPC stream routing failed")
            relay.on_close(StatusCode.INTERNAL, f"gateway error: {type(exc).__name__}")
            upstream.cancel()

    async def aclose(self) -> None:
        """Nothing of its own to close: the upstream connections are the fleets'."""


class _StreamRelay:
    """Triton's side of one stream (a ``StreamListener``), handed to the grpcio handler: reply
    messages in order, then None; ``closed`` holds the first final status (Triton's or ours)."""

    __slots__ = ("replies", "drained", "buffer", "closed", "busy", "queued", "upstream")

    def __init__(self) -> None:
        self.replies: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.queued = 0  # bytes of the replies waiting in it
        self.upstream: UpstreamStream | None = None  # held while more than REPLY_BACKLOG waits
        self.drained = asyncio.Event()
        self.buffer = bytearray()
        self.closed: tuple[int, str] | None = None
        self.busy = False  # closed by the gateway's budget running out

    def on_headers(self, headers: Headers) -> None:
        """Nothing to do: the routing metadata goes out with the first reply."""

    def on_data(self, payload: bytes | memoryview) -> None:
        buffer = self.buffer
        buffer += payload
        messages, used = split_messages(buffer)  # Triton compresses nothing: we never ask it to
        for _, response in messages:
            self.replies.put_nowait(response)
            self.queued += len(response)
        del buffer[:used]
        if self.queued > REPLY_BACKLOG and self.upstream is not None:
            self.upstream.hold()

    def taken(self, response: bytes) -> None:
        """The handler took a reply to write: Triton's stream may send again once half the backlog is left."""
        self.queued -= len(response)
        upstream = self.upstream
        if upstream is not None and upstream.held and self.queued <= REPLY_BACKLOG // 2:
            upstream.release()

    def on_close(self, code: int, details: str) -> None:
        if self.closed is None:
            self.closed = (code, details)
            self.replies.put_nowait(None)
        self.drained.set()

    def on_drained(self) -> None:
        self.drained.set()


class CallingConnections:
    """The client connections with calls in flight, per client address, against ``cap`` each.

    A connection is its peer string (``ipv4:10.0.0.5:5555``: address and port), the only trace
    grpcio gives of it; it counts from its first call in flight to the end of its last."""

    __slots__ = ("cap", "calls")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: dict[str, dict[str, int]] = {}  # address -> peer -> calls in flight

    def enter(self, peer: str) -> str:
        """Count one call on ``peer``; or, if that connection would be one too many for its
        address, count nothing and say why."""
        address = client_key(grpcio_peer(peer))
        connections = self.calls.get(address)
        if connections is None:
            connections = self.calls[address] = {}
        calls = connections.get(peer, 0)
        if not calls and len(connections) >= self.cap:
            if not connections:
                del self.calls[address]
            return (f"this client address has {self.cap} gRPC connections open (max_connections_per_client): "
                    "retry shortly")
        connections[peer] = calls + 1
        return ""

    def leave(self, peer: str) -> None:
        address = client_key(grpcio_peer(peer))
        connections = self.calls[address]
        calls = connections[peer] - 1
        if calls:
            connections[peer] = calls
            return
        del connections[peer]
        if not connections:
            del self.calls[address]


def over_budget(budget: ByteBudget) -> str:
    """The lean server's words (http2.server) when a message does not fit the budget."""
    return f"the gateway holds {budget.limit} bytes of requests already: retry shortly"


def _wire(metadata: tuple[Any, ...]) -> list[tuple[bytes, bytes]]:
    """grpcio's (str, str | bytes) metadata as wire pairs, for routing on header values."""
    return [(key.encode(), value if isinstance(value, bytes) else value.encode()) for key, value in metadata]


def _forwarded(context: grpc.aio.ServicerContext, metadata: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """The client's metadata minus what gRPC sets itself (user-agent, grpc-*)."""
    source = metadata if metadata is not None else (context.invocation_metadata() or ())
    return tuple((key, value) for key, value in source if key != "user-agent" and not key.startswith("grpc-"))


async def start_server(proxy: GrpcProxy, host: str, port: int, credentials: grpc.ServerCredentials | None = None,
                       limits: Limits | None = None) -> grpc.aio.Server:
    limits = limits or Limits()
    # what grpcio's core may hold before the handler sees it (see the module's docstring)
    options = [*CHANNEL_OPTIONS, ("grpc.max_receive_message_length", limits.max_message),
               ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
               # a silent connection is closed after the preface timeout, one without calls after the idle one
               ("grpc.server_handshake_timeout_ms", int(limits.preface_timeout * 1000)),
               ("grpc.max_connection_idle_ms", int(limits.idle_timeout * 1000))]
    server = grpc.aio.server(handlers=[proxy], options=options)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
