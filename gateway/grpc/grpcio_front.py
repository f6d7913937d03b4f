"""``inference.GRPCInferenceService`` on grpcio's server (``grpc_server: grpcio``), forwarded to Triton.

The fallback to our own HTTP/2 server (``grpc.front``): a generic handler with no
(de)serializers, so requests and responses stay raw bytes. ``ModelInfer`` goes through the
shared ``GrpcRouter``; ``ModelStreamInfer`` through a grpc.aio channel, each message routed;
every other unary method passes through unchanged. Deadlines and cancellation propagate.
``grpc.health.v1.Health`` is answered here from the gateway's readiness (``grpc.health``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from gateway.client_address import grpcio_peer
from gateway.control_surface import ControlGate
from gateway.grpc.health import HEALTH, Health, grpcio_handlers
from gateway.grpc.router import SERVICE, GrpcRouter, StreamLedger, client_deadline_ran_out
from gateway.grpc.wire import WireError
from gateway.http2.client import NOT_CONNECTED
from gateway.pipeline import SEQUENCED

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class GrpcProxy(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, router: GrpcRouter, gate: ControlGate | None = None,
                 upstream_credentials: grpc.ChannelCredentials | None = None, health: Health | None = None) -> None:
        self.router = router
        self.health = grpcio_handlers(health) if health is not None else {}
        self.gate = gate  # None: Triton control calls pass through (triton_control=allow)
        address = router.upstream.address
        self.channel = (grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) if upstream_credentials is None
                        else grpc.aio.secure_channel(address, upstream_credentials, options=CHANNEL_OPTIONS))
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
            upstream_stream = self.channel.stream_stream(method)

            async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for response in self._stream(upstream_stream, requests, context):
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
            code, details, answer = await self.router.upstream.unary(method, raw, forwarded,
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

    async def _stream(self, upstream: Any, requests: AsyncIterator[bytes],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        metadata = context.invocation_metadata() or ()
        wire = _wire(metadata)
        # each reply charged to its own request's decision, and to the stream's client
        ledger = StreamLedger(self.router.pipeline.clients.of(grpcio_peer(context.peer()), wire))
        remaining = context.time_remaining()
        opened = time.monotonic()

        async def routed() -> AsyncIterator[bytes]:
            async for raw in requests:
                fields, policy, decision = self.router.route(raw, wire)
                if decision is SEQUENCED:
                    decision = await self.router.settle(fields, policy, wire)
                ledger.sent(fields.model_name, decision)
                yield self.router.routed_message(raw, decision)

        call = upstream(routed(), metadata=_forwarded(context, metadata), timeout=remaining)
        announced = False
        try:
            async for response in call:
                last = ledger.last
                if not announced and last is not None:
                    await context.send_initial_metadata(self.router.announced(last.decision))
                announced = True
                self.router.record_stream_reply(ledger, response)
                yield response
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
            past = client_deadline_ran_out(code, remaining, time.monotonic() - opened)
            self.router.record_stream_end(ledger, code, past)
            await context.abort(exc.code(), self.router.details(code, _own_words(exc.details() or "")))
        except asyncio.CancelledError:  # the client went away, or grpcio ended the call at the client's deadline
            cancelled = grpc.StatusCode.CANCELLED.value[0]
            self.router.record_stream_end(ledger, cancelled,
                                          client_deadline_ran_out(cancelled, remaining, time.monotonic() - opened))
            raise

    async def aclose(self) -> None:
        await self.channel.close()


def _own_words(details: str) -> str:
    """grpcio's channel names the address it could not reach: said in the gateway's words instead."""
    if "ipv4:" in details or "ipv6:" in details or details.startswith("failed to connect"):
        return f"{NOT_CONNECTED}: the stream could not be opened"
    return details


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
