"""``grpc.health.v1.Health`` (``Check`` and ``Watch``) on both gRPC servers, from the gateway's readiness.

The overall service (``""``) and ``inference.GRPCInferenceService`` are ``SERVING`` exactly when
``/readyz`` answers 200 (the same :meth:`gateway.endpoints.Probes.problem`: policies loaded, their
sync not failing for too long, a Triton of the default fleet live, asked over the servers' probe
connections, never queued behind inference). As the standard says, ``Check`` of any other service
answers ``NOT_FOUND``; ``Watch`` of one sends ``SERVICE_UNKNOWN`` and keeps the call open. ``Watch``
re-reads readiness every second and sends a message when the status changes.

Why the two messages are encoded here rather than with grpcio-health-checking's classes: each
has one field (``HealthCheckRequest.service = 1``, a string; ``HealthCheckResponse.status = 1``,
an enum), both servers handle raw bytes already, and that package's current releases need a
protobuf runtime (7) that tritonclient's generated code is not on. The tests decode the answers
with the official ``grpc_health`` protos, as ``grpc_health_probe`` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.grpc.server_connection import GrpcServerConnection
from gateway.grpc.status import StatusCode
from gateway.http2.server_stream import ServerStream

log = logging.getLogger("gateway.grpc")
HEALTH = "/grpc.health.v1.Health/"
CHECK = HEALTH + "Check"
WATCH = HEALTH + "Watch"
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3  # HealthCheckResponse.ServingStatus
SERVICES = frozenset(["", "inference.GRPCInferenceService"])
WATCH_INTERVAL_S = 1.0

Readiness = Callable[[], Awaitable["str | None"]]  # None when ready, else why not (Probes.problem)


def requested_service(message: bytes) -> str:
    """``HealthCheckRequest.service``; ValueError for bytes that are not that message."""
    service = b""
    pos, size = 0, len(message)
    while pos < size:
        tag, pos = _varint(message, pos)
        kind = tag & 7
        if kind == 2:
            length, pos = _varint(message, pos)
            if pos + length > size:
                raise ValueError("truncated field")
            if tag >> 3 == 1:
                service = message[pos:pos + length]
            pos += length
        elif kind == 0:
            _, pos = _varint(message, pos)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise ValueError(f"unexpected wire type {kind}")
    if pos > size:
        raise ValueError("truncated field")
    return service.decode()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def status_message(status: int) -> bytes:
    """A ``HealthCheckResponse`` with ``status`` set (field 1, varint)."""
    return bytes((0x08, status))


class Health:
    """What both servers answer; ``readiness`` is ``Probes.problem``."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness
        self.draining = asyncio.Event()

    def enter_graceful_shutdown(self) -> None:
        """The gRPC port drains: ``NOT_SERVING`` from now on, and every ``Watch`` says so and ends
        (OK), as grpcio's ``HealthServicer.enter_graceful_shutdown`` does. A watcher's client
        moves to another replica, and its connection does not hold the drain to its bound: an
        open ``Watch`` kept every shutdown waiting the whole ``drain_timeout_s``."""
        self.draining.set()

    async def status(self) -> int:
        if self.draining.is_set():
            return NOT_SERVING
        return SERVING if await self.readiness() is None else NOT_SERVING

    async def check(self, message: bytes) -> tuple[int, str, bytes]:
        """(gRPC status, details, HealthCheckResponse)."""
        try:
            service = requested_service(message)
        except ValueError as exc:
            return StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {exc}", b""
        if service not in SERVICES:
            return StatusCode.NOT_FOUND, f"unknown service {service[:200]!r}", b""
        return StatusCode.OK, "", status_message(await self.status())

    async def watch(self, service: str) -> AsyncIterator[bytes]:
        """The status now, then each change, until the client ends the call or the port drains
        (``NOT_SERVING``, then the end)."""
        if service not in SERVICES:
            yield status_message(SERVICE_UNKNOWN)
            await self.draining.wait()  # the set of services never changes: nothing more to say
            return
        last = 0
        while True:
            status = await self.status()
            if status != last:
                last = status
                yield status_message(status)
            if self.draining.is_set():
                return
            with contextlib.suppress(TimeoutError):  # a drain wakes the watcher at once
                async with asyncio.timeout(WATCH_INTERVAL_S):
                    await self.draining.wait()


class HealthCall:
    """A health call on the lean server (``grpc.front``): one request message, then the answer
    (``Check``) or a stream of answers (``Watch``) until the client resets it or leaves."""

    streaming = False  # the request is one small message: held until END_STREAM

    def __init__(self, health: Health, connection: GrpcServerConnection, stream: ServerStream) -> None:
        self.health = health
        self.connection = connection
        self.stream = stream
        self.message: bytes | None = None
        self.task: asyncio.Task[None] | None = None

    def on_message(self, message: bytes) -> None:
        if self.message is not None:
            self.connection.finish(self.stream, StatusCode.UNIMPLEMENTED, "a unary call got more than one message")
            return
        self.message = message

    def on_end(self) -> None:
        if self.message is None:
            self.connection.finish(self.stream, StatusCode.UNIMPLEMENTED, "a unary call got no request message")
            return
        work = self._check() if self.stream.path == CHECK else self._watch()
        self.task = asyncio.get_running_loop().create_task(self._guarded(work))

    def on_reset(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def _guarded(self, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug must not leave the prober waiting
            log.exception("gRPC health call failed")
            self.connection.finish(self.stream, StatusCode.INTERNAL, f"gateway error: {type(exc).__name__}")

    async def _check(self) -> None:
        assert self.message is not None
        code, details, answer = await self.health.check(self.message)
        if code:
            self.connection.finish(self.stream, code, details)
        else:
            self.connection.reply(self.stream, answer)

    async def _watch(self) -> None:
        assert self.message is not None
        try:
            service = requested_service(self.message)
        except ValueError as exc:
            self.connection.finish(self.stream, StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {exc}")
            return
        async for answer in self.health.watch(service):
            self.connection.send_message(self.stream, answer)
        self.connection.finish(self.stream, StatusCode.OK)  # the port drains: the watch is over


def grpcio_handlers(health: Health) -> dict[str, Any]:
    """The two methods as grpcio method handlers (raw bytes in and out), for ``grpc.grpcio_front``."""
    import grpc
    import grpc.aio

    async def check(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        code, details, answer = await health.check(raw)
        if code:
            await context.abort(next(c for c in grpc.StatusCode if c.value[0] == code), details)
        return answer

    async def watch(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            service = requested_service(raw)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {exc}")
            return
        async for answer in health.watch(service):
            yield answer

    return {CHECK: grpc.unary_unary_rpc_method_handler(check), WATCH: grpc.unary_stream_rpc_method_handler(watch)}
