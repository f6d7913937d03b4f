"""``inference.GRPCInferenceService`` on grpcio's server (``grpc_server: grpcio``), forwarded to Triton.

The fallback to our own HTTP/2 server (``grpc.front``): a generic handler with no
(de)serializers, so requests and responses stay raw bytes. ``ModelInfer`` goes through the
shared ``GrpcRouter``; ``ModelStreamInfer`` through the same upstream client as the lean front
(``GrpcUpstream.open`` / the fleet's ``FleetGrpc.open``), each message routed: so a stream gets
its server picked across the fleet, keepalive PINGs that find a hung Triton, and only the
gateway's own words when the connection fails (a grpc.aio channel had none of these: a SIGSTOPped
Triton held streams for ever, and a DNS failure put Triton's host name in the client's status).
Every other unary method passes through unchanged. Deadlines and cancellation propagate.
``grpc.health.v1.Health`` is answered here from the gateway's readiness (``grpc.health``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from gateway.client_address import grpcio_peer
from gateway.control_surface import ControlGate
from gateway.errors import GatewayError
from gateway.grpc.health import HEALTH, Health, grpcio_handlers
from gateway.grpc.router import SERVICE, GrpcRouter, StreamLedger, client_deadline_ran_out
from gateway.grpc.status import StatusCode, status_for
from gateway.grpc.upstream import UpstreamStream
from gateway.grpc.wire import WireError, split_messages
from gateway.http2.endpoint import Headers
from gateway.pipeline import SEQUENCED

log = logging.getLogger("gateway.grpc")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
# Request bytes a stream may have waiting for Triton's flow-control window before the client's
# next message is read: Triton reading slower than the client sends pauses the client.
STREAM_BACKLOG = 1 << 20


class GrpcProxy(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, router: GrpcRouter, gate: ControlGate | None = None, health: Health | None = None) -> None:
        self.router = router
        self.health = grpcio_handlers(health) if health is not None else {}
        self.gate = gate  # None: Triton control calls pass through (triton_control=allow)
        self._handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._handlers.get(method, False)
        if handler is False:
            handler = self._handlers[method] = self._build(method)
        return handler

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
                refused, details, forwarded = await self.gate.admit_grpc(method, raw, forwarded)
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
        if decision is SEQUENCED:
            decision = await self.router.settle(fields, policy, _wire(metadata))
        exchange = self.router.new_infer(method, raw, fields, _forwarded(context, metadata), context.time_remaining())
        client = self.router.pipeline.clients.of(grpcio_peer(context.peer()), _wire(metadata))
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
            upstream = await router.upstream.open(method, relay, _forwarded(context, metadata), remaining)
        except GatewayError as exc:  # no server could take it: the gateway's own words, no address
            refusal = status_for(exc)
            await context.abort(_STATUS.get(refusal, grpc.StatusCode.UNKNOWN), router.details(refusal, exc.message))
            raise
        pump = asyncio.get_running_loop().create_task(self._pump(requests, upstream, relay, wire, ledger))
        announced = False
        try:
            while True:
                response = await relay.replies.get()
                if response is None:
                    break
                last = ledger.last
                if not announced and last is not None:
                    await context.send_initial_metadata(router.announced(last.decision))
                announced = True
                router.record_stream_reply(ledger, response)
                yield response
            code, details = relay.closed or (int(StatusCode.UNKNOWN), "")
            if code:
                if code != StatusCode.INVALID_ARGUMENT:  # a malformed message is the client's, not a version's
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
        """The client's messages, routed, up the stream; paused while Triton's window is full."""
        router = self.router
        try:
            async for raw in requests:
                fields, policy, decision = router.route(raw, wire)
                if decision is SEQUENCED:
                    decision = await router.settle(fields, policy, wire)
                ledger.sent(fields.model_name, decision)
                upstream.send(router.routed_message(raw, decision))
                while upstream.backlog > STREAM_BACKLOG and relay.closed is None:
                    relay.drained.clear()
                    await relay.drained.wait()
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

    __slots__ = ("replies", "drained", "buffer", "closed")

    def __init__(self) -> None:
        self.replies: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.drained = asyncio.Event()
        self.buffer = bytearray()
        self.closed: tuple[int, str] | None = None

    def on_headers(self, headers: Headers) -> None:
        """Nothing to do: the routing metadata goes out with the first reply."""

    def on_data(self, payload: bytes) -> None:
        buffer = self.buffer
        buffer += payload
        messages, used = split_messages(buffer)  # Triton compresses nothing: we never ask it to
        for _, response in messages:
            self.replies.put_nowait(response)
        del buffer[:used]

    def on_close(self, code: int, details: str) -> None:
        if self.closed is None:
            self.closed = (code, details)
            self.replies.put_nowait(None)
        self.drained.set()

    def on_drained(self) -> None:
        self.drained.set()


def _wire(metadata: tuple[Any, ...]) -> list[tuple[bytes, bytes]]:
    """grpcio's (str, str | bytes) metadata as wire pairs, for routing on header values."""
    return [(key.encode(), value if isinstance(value, bytes) else value.encode()) for key, value in metadata]


def _forwarded(context: grpc.aio.ServicerContext, metadata: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """The client's metadata minus what gRPC sets itself (user-agent, grpc-*)."""
    source = metadata if metadata is not None else (context.invocation_metadata() or ())
    return tuple((key, value) for key, value in source if key != "user-agent" and not key.startswith("grpc-"))


async def start_server(proxy: GrpcProxy, host: str, port: int,
                       credentials: grpc.ServerCredentials | None = None) -> grpc.aio.Server:
    server = grpc.aio.server(handlers=[proxy], options=CHANNEL_OPTIONS)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
