"""``inference.GRPCInferenceService`` on our own HTTP/2 server (``grpc_server: lean``, the default).

Why not grpcio's server: per unary call it runs four completion-queue batches handed between
its poller thread and the event loop, plus one more for the routing metadata; measured on
the 2-core dev machine that was ~450 µs of the gateway's CPU per ModelInfer against ~130 µs
for this server (h2load, concurrency 32; see the closing note of issue 5). Requests and
responses stay raw bytes end to end:

- ``ModelInfer``: run through the shared pipeline (``GrpcRouter``) and answered in one write (headers with
  ``x-gateway-model-version`` / ``x-gateway-route``, the message, the status);
- ``ModelStreamInfer``: relayed message by message over one upstream stream, each request
  routed (sequence pins hold), each response recorded;
- every other method: forwarded unchanged;
- ``grpc.health.v1.Health``: answered here from the gateway's readiness (``grpc.health``).

The client's ``grpc-timeout`` goes upstream and is enforced here too: DEADLINE_EXCEEDED at the
deadline (a moment after it when Triton was told the same deadline), and for an answer that
comes after it. A client that resets its stream (or disconnects) hears nothing more of it, and
upstream its call is left to finish, its answers dropped, never reset (``grpc.upstream``: Triton
2.51 crashes on resets)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from functools import lru_cache
from typing import Any

from gateway.control_surface import ControlGate
from gateway.errors import GatewayError
from gateway.grpc.health import CHECK, WATCH, Health, HealthCall
from gateway.grpc.router import INFER, SERVICE, STREAM_INFER, GrpcRouter, StreamLedger, client_deadline_ran_out
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.grpc.status import StatusCode, status_for
from gateway.grpc.upstream import TRITON_DEADLINE_FLOOR_S, UpstreamStream
from gateway.grpc.wire import Message, Raw, RouteFields, WireError, message_size, metadata_block, split_messages
from gateway.http2.endpoint import Headers
from gateway.http2.server_stream import ServerStream, StreamHandler
from gateway.pipeline import SEQUENCED
from gateway.routing import Decision, Policy

log = logging.getLogger("gateway.grpc")
_NOT_FORWARDED = frozenset([b"te", b"content-type", b"user-agent"])
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


@lru_cache(maxsize=1024)
def decision_block(metadata: tuple[tuple[str, str], ...]) -> bytes:
    """The routing metadata, HPACK-encoded: a policy has a few decisions, each encoded once."""
    return metadata_block(metadata)


def client_metadata(headers: Headers) -> tuple[tuple[bytes, bytes], ...]:
    """What goes upstream: the client's own metadata, not HTTP/2 or gRPC framing headers."""
    return tuple((name, value) for name, value in headers
                 if name[:1] != b":" and name not in _NOT_FORWARDED and not name.startswith(b"grpc-"))


def deadline_of(headers: Headers) -> float | None:
    """The ``grpc-timeout`` header as an absolute ``loop.time()``; None without one.

    Raises ``ValueError`` for a value the gRPC spec does not allow (1-8 digits and a unit)."""
    for name, value in headers:
        if name == b"grpc-timeout":
            unit = _TIMEOUT_UNITS.get(value[-1:])
            if unit is None or not 2 <= len(value) <= 9 or not value[:-1].isdigit():
                raise ValueError(f"malformed grpc-timeout {value[:20]!r}")
            return asyncio.get_running_loop().time() + int(value[:-1]) * unit
    return None


class _Call:
    """What every call has: its stream, its deadline, and the task doing its upstream work."""

    __slots__ = ("front", "connection", "stream", "opened", "deadline", "task", "timer", "client")
    streaming = False  # a unary request is held until END_STREAM (StreamHandler.streaming)

    def __init__(self, front: GrpcFront, connection: GrpcServerConnection, stream: ServerStream) -> None:
        self.front = front
        self.connection = connection
        self.stream = stream
        self.opened = asyncio.get_running_loop().time()
        self.deadline = deadline_of(stream.headers)
        self.client = client_of(front, connection, stream)  # for the rollout judge's per-client shares
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        if self.deadline is not None:
            # A little after the deadline, where Triton is told the same one and usually answers
            # first; at the deadline itself where Triton is told the floor instead (grpc.upstream)
            slack = 0.1 if self.deadline - self.opened >= TRITON_DEADLINE_FLOOR_S else 0.0
            self.timer = asyncio.get_running_loop().call_at(self.deadline + slack, self._expired)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - asyncio.get_running_loop().time(), 0.0)

    def finish(self, code: int, details: str = "", metadata: bytes = b"") -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.connection.finish(self.stream, code, details, metadata)

    def reply(self, response: bytes, metadata: bytes = b"") -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline:
            # an answer after the client's deadline is not an answer it waited for (the timer's
            # turn had not come yet): as a server enforcing the deadline would end the call
            self.timer = None
            self.connection.finish(self.stream, StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", metadata)
            return
        self.connection.reply(self.stream, response, metadata)

    def _expired(self) -> None:
        self.timer = None
        self.stop_upstream()
        self.connection.finish(self.stream, StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def on_reset(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.stop_upstream()

    def on_sent(self) -> None:
        """Answers went out to the client: only a stream relays more than one."""

    def stop_upstream(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """``work`` is called inside the task: a call reset before its task starts leaves no coroutine unawaited."""
        self.task = asyncio.get_running_loop().create_task(self._guarded(work))

    async def _guarded(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await work()
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug must not leave the client waiting
            log.exception("gRPC call %s failed", self.stream.path)
            self.finish(StatusCode.INTERNAL, f"gateway error: {type(exc).__name__}: {exc}")


class UnaryCall(_Call):
    __slots__ = ("message", "routed")

    def __init__(self, front: GrpcFront, connection: GrpcServerConnection, stream: ServerStream,
                 routed: bool) -> None:
        super().__init__(front, connection, stream)
        self.message: Raw | None = None
        self.routed = routed

    def on_message(self, message: Raw) -> None:
        if self.message is not None:
            self.finish(StatusCode.UNIMPLEMENTED, "a unary call got more than one request message")
            return
        self.message = message

    def on_end(self) -> None:
        if self.message is None:
            self.finish(StatusCode.UNIMPLEMENTED, "a unary call got no request message")
            return
        self.run(self._infer if self.routed else self._pass_through)

    async def _infer(self) -> None:
        router, raw, headers = self.front.router, self.message, self.stream.headers
        assert raw is not None
        try:
            fields, policy, decision = router.route(raw, headers)
        except WireError as exc:
            self.finish(StatusCode.INVALID_ARGUMENT, f"malformed ModelInferRequest: {exc}")
            return
        if decision is SEQUENCED:
            decision = await router.settle(fields, policy, headers, self.client)
        exchange = router.new_infer(INFER, raw, fields, client_metadata(headers), self.remaining(), self.client)
        decision = await router.infer(exchange, fields.model_name, policy, decision, self.client)
        metadata = decision_block(router.announced(decision, exchange.response))  # after any fallback: who answered
        if exchange.code:
            self.finish(exchange.code, router.details(exchange.code, exchange.details), metadata)
        else:
            self.reply(exchange.response, metadata)

    async def _pass_through(self) -> None:
        router, gate = self.front.router, self.front.gate
        assert self.message is not None
        metadata: Any = client_metadata(self.stream.headers)
        if gate is not None:  # Triton model control is refused here, or admitted and audited
            refused, details, metadata = await gate.admit_grpc(self.stream.path, bytes(self.message), metadata,
                                                               self.client)
            if refused:
                self.finish(refused, details)
                return
        code, details, answer = await router.pass_through(self.stream.path, self.message, metadata,
                                                          self.remaining())
        if code:
            self.finish(code, router.details(code, details))
        else:
            self.reply(answer)


class StreamCall(_Call):
    """ModelStreamInfer: client messages routed and sent up one stream, answers relayed back."""

    __slots__ = ("upstream", "waiting", "ended", "decision", "ledger", "replies", "settling", "settler")
    streaming = True

    def __init__(self, front: GrpcFront, connection: GrpcServerConnection, stream: ServerStream) -> None:
        super().__init__(front, connection, stream)
        self.upstream: UpstreamStream | None = None
        self.waiting: list[Message] = []  # routed requests that arrived before the upstream stream opened
        self.ended = False
        self.decision: Decision | None = None  # the last message's: the routing metadata the stream announces
        self.ledger = StreamLedger(self.client)  # each reply charged to its own request's decision
        self.replies = bytearray()
        # Messages behind one whose sequence pin is being read or written (store I/O): sent in
        # their order by the settler task; None when nothing waits.
        self.settling: list[tuple[Raw, RouteFields, Policy | None, Decision]] | None = None
        self.settler: asyncio.Task[None] | None = None
        self.run(self._open)

    async def _open(self) -> None:
        router = self.front.router
        try:
            opened = await router.open_stream(self.client, STREAM_INFER, self, client_metadata(self.stream.headers),
                                              self.remaining())
        except GatewayError as exc:
            code = status_for(exc)
            self.finish(code, router.details(code, exc.message))
            return
        self.upstream = opened
        for message in self.waiting:
            opened.send(message)
        self.waiting.clear()
        if self.ended and self.settling is None:
            opened.end()
        self.on_drained()

    # -- from the client ------------------------------------------------------------------------
    def on_message(self, message: Raw) -> None:
        router = self.front.router
        try:
            fields, policy, decision = router.route(message, self.stream.headers)
        except WireError as exc:
            self.stop_upstream()
            if self.upstream is not None:
                self.upstream.cancel()
            self.finish(StatusCode.INVALID_ARGUMENT, f"malformed ModelInferRequest: {exc}")
            return
        if decision is SEQUENCED or self.settling is not None:  # keep the stream's order
            if self.settling is None:
                self.settling = []
                self.settler = asyncio.get_running_loop().create_task(self._settle())
            self.settling.append((message, fields, policy, decision))
            if len(self.settling) > 1:
                self.connection.hold(self.stream)  # the client waits while a pin is read from the store
            return
        self._send(message, fields, decision)

    async def _settle(self) -> None:
        router = self.front.router
        try:
            while self.settling:
                message, fields, policy, decision = self.settling.pop(0)
                if decision is SEQUENCED:
                    decision = await router.settle(fields, policy, self.stream.headers, self.client)
                self._send(message, fields, decision)
        except Exception as exc:  # a bug must not leave the client waiting
            log.exception("gRPC stream routing failed")
            self.finish(StatusCode.INTERNAL, f"gateway error: {type(exc).__name__}: {exc}")
            return
        finally:
            self.settling = None
        window = self.connection.limits.stream_window
        if self.stream.held and (self.upstream is None or self.upstream.backlog <= window):
            self.connection.release(self.stream)
        if self.ended and self.upstream is not None:
            self.upstream.end()

    def _send(self, message: Raw, fields: RouteFields, decision: Decision) -> None:
        router = self.front.router
        self.decision = decision
        routed = router.stream_send(self.ledger, message, fields.model_name, decision)
        if self.upstream is not None:
            self.upstream.send(routed)
            backlog = self.upstream.backlog
        else:
            self.waiting.append(routed)
            backlog = sum(message_size(waiting) for waiting in self.waiting)
        if backlog > self.connection.limits.stream_window:
            self.connection.hold(self.stream)  # Triton reads slower than the client sends: pause the client

    def on_drained(self) -> None:
        """The upstream took requests (or the stream just opened): the client may send again once
        no more than one stream window waits upstream."""
        if self.upstream is None:
            return
        if self.upstream.backlog > self.connection.limits.stream_window:
            self.connection.hold(self.stream)
        elif self.stream.held and self.settling is None:
            self.connection.release(self.stream)

    def on_end(self) -> None:
        self.ended = True
        if self.upstream is not None and self.settling is None:  # else the settler ends it after the last message
            self.upstream.end()

    def on_reset(self) -> None:
        super().on_reset()
        if self.settler is not None and not self.settler.done():
            self.settler.cancel()
        if self.upstream is not None:
            self.upstream.cancel()

    # -- from Triton (the upstream stream's listener) -------------------------------------------
    def on_headers(self, headers: Headers) -> None:
        self.connection.send_headers(self.stream, self._routing_block())

    def _routing_block(self) -> bytes:
        return b"" if self.decision is None else decision_block(self.front.router.announced(self.decision))

    def on_data(self, payload: bytes | memoryview) -> None:
        replies = self.replies
        replies += payload
        messages, used = split_messages(replies)  # Triton compresses nothing: we never ask it to
        for _, response in messages:
            self.connection.send_message(self.stream, self.front.router.record_stream_reply(self.ledger, response))
        del replies[:used]
        # Replies waiting for the client (more than a stream window queued for its window, or its
        # socket full): Triton's stream gets no more credit until they go out (on_sent). Replies the
        # client leaves unread for grpc_stalled_stream_timeout_s end the stream (http2.stall), and
        # its reset stops the upstream call here (on_reset: left to finish on Triton).
        pending, upstream = self.stream.pending, self.upstream
        if upstream is not None and (self.connection.write_paused or pending is not None
                                     and len(pending) > self.connection.limits.stream_window):
            upstream.hold()

    def on_sent(self) -> None:
        upstream, pending = self.upstream, self.stream.pending
        if upstream is not None and upstream.held and not self.connection.write_paused \
                and (pending is None or len(pending) <= self.connection.limits.stream_window // 2):
            upstream.release()

    def on_close(self, code: int, details: str) -> None:
        if code:
            timeout = None if self.deadline is None else self.deadline - self.opened
            past = client_deadline_ran_out(code, timeout, asyncio.get_running_loop().time() - self.opened)
            self.front.router.record_stream_end(self.ledger, code, past)
        self.finish(code, self.front.router.details(code, details) if code else "", self._routing_block())


def client_of(front: GrpcFront, connection: GrpcServerConnection, stream: ServerStream) -> str:
    """The call's client: the connection's peer address, or whom a trusted proxy forwarded."""
    transport = connection.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return front.router.pipeline.clients.of(peer[0] if peer else None, stream.headers)


class GrpcFront:
    def __init__(self, router: GrpcRouter, gate: ControlGate | None = None, health: Health | None = None) -> None:
        self.router = router
        self.gate = gate  # None: Triton control calls pass through (triton_control=allow)
        self.health = health
        self.connections: set[GrpcServerConnection] = set()

    def on_stream(self, connection: GrpcServerConnection, stream: ServerStream) -> StreamHandler | None:
        path = stream.path
        try:  # the calls read grpc-timeout first thing
            if path == INFER:
                return UnaryCall(self, connection, stream, routed=True)
            if path == STREAM_INFER:
                return StreamCall(self, connection, stream)
            if path.startswith(SERVICE):
                return UnaryCall(self, connection, stream, routed=False)
            if (path == CHECK or path == WATCH) and self.health is not None:
                return HealthCall(self.health, connection, stream)
        except ValueError as exc:  # a malformed grpc-timeout: answered, never raised into the connection
            connection.finish(stream, StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        connection.finish(stream, StatusCode.UNIMPLEMENTED, f"Method not found: {path[:200]}")
        return None
