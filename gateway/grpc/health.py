"""``grpc.health.v1.Health`` (``Check`` and ``Watch``) on both gRPC servers, from the gateway's readiness.

The overall service (``""``) and ``inference.GRPCInferenceService`` are ``SERVING`` exactly when
``/readyz`` answers 200 (the same :meth:`gateway.endpoints.Probes.problem`: policies loaded, their
sync not failing for too long, a Triton of the default fleet live, asked over the servers' probe
connections, never queued behind inference). As the standard says, ``Check`` of any other service
answers ``NOT_FOUND``; ``Watch`` of one sends ``SERVICE_UNKNOWN`` and keeps the call open. Every
``Watch`` shares one readiness probe a second and hears when the status changes; one client holds
a bounded number of them (:class:`Health`).

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

from gateway.client_address import PerAddress, grpcio_peer
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
    """What both servers answer; ``readiness`` is ``Probes.problem``.

    Every open ``Watch`` shares one probe per :data:`WATCH_INTERVAL_S`, made by one poller task
    while any watch is open: each stream asking Triton for itself cost 2.9 CPU s per 10 s with
    4,000 watchers, and 8,000 from one address slowed ``/readyz`` (which asks Triton over the
    same probe connections) to 2.1 s and one false 503. Concurrent ``Check`` calls share the
    probe in flight. One client (its address, an IPv6 /64) holds at most
    ``max_watches_per_client`` watches; past it a watch is refused RESOURCE_EXHAUSTED."""

    def __init__(self, readiness: Readiness, max_watches_per_client: int = 64) -> None:
        self.readiness = readiness
        self.max_watches_per_client = max_watches_per_client
        self.draining = asyncio.Event()
        self._probe: asyncio.Task[int] | None = None  # the probe in flight, shared by whoever asks meanwhile
        self._watches = PerAddress()  # open watches per client
        self._watching = 0
        self._poller: asyncio.Task[None] | None = None
        self._latest = 0  # the status the poller published last (0: none yet)
        self._published = asyncio.Event()  # set (and replaced) at each publication, and at the drain
        self.probes = 0  # readiness probes made (for tests and the curious)

    def enter_graceful_shutdown(self) -> None:
        """The gRPC port drains: ``NOT_SERVING`` from now on, and every ``Watch`` says so and ends
        (OK), as grpcio's ``HealthServicer.enter_graceful_shutdown`` does. A watcher's client
        moves to another replica, and its connection does not hold the drain to its bound: an
        open ``Watch`` kept every shutdown waiting the whole ``drain_timeout_s``."""
        self.draining.set()
        self._published.set()

    async def status(self) -> int:
        if self.draining.is_set():
            return NOT_SERVING
        probe = self._probe
        if probe is None or probe.done():
            probe = self._probe = asyncio.get_running_loop().create_task(self._ask())
        return await asyncio.shield(probe)  # a caller that goes away leaves the probe to the others

    async def _ask(self) -> int:
        self.probes += 1
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

    def admit(self, client: str) -> str | None:
        """Count one more watch of ``client``'s; None, or why not (nothing counted)."""
        if not self._watches.admit(client, self.max_watches_per_client):
            return (f"this client has {self.max_watches_per_client} health watches open "
                    "(grpc_max_health_watches_per_client): end one first")
        return None

    def leave(self, client: str) -> None:
        self._watches.leave(client)

    async def watch(self, service: str) -> AsyncIterator[bytes]:
        """The status now, then each change, until the client ends the call or the port drains
        (``NOT_SERVING``, then the end). The caller admitted the watch (:meth:`admit`)."""
        if service not in SERVICES:
            yield status_message(SERVICE_UNKNOWN)
            await self.draining.wait()  # the set of services never changes: nothing more to say
            return
        self._watching += 1
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            last = 0
            while True:
                published = self._published
                if self._latest or self.draining.is_set():
                    status = NOT_SERVING if self.draining.is_set() else self._latest
                    if status != last:
                        last = status
                        yield status_message(status)
                    if self.draining.is_set():
                        return
                await published.wait()
        finally:
            self._watching -= 1

    async def _poll(self) -> None:
        """One probe per interval for every watch, while any is open; each publication wakes them."""
        try:
            while self._watching and not self.draining.is_set():
                try:
                    self._latest = await self.status()
                except Exception:  # a bug must not stop every watch's updates
                    log.exception("gRPC health probe failed")
                    self._latest = NOT_SERVING
                published, self._published = self._published, asyncio.Event()
                published.set()
                with contextlib.suppress(TimeoutError):  # a drain wakes the poller at once
                    async with asyncio.timeout(WATCH_INTERVAL_S):
                        await self.draining.wait()
        finally:
            self._poller = None
            self._latest = 0  # a watch opened later waits for a probe of its own time


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

    def on_message(self, message: bytes | bytearray) -> None:
        message = bytes(message)  # a few bytes
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

    def on_sent(self) -> None:
        """Nothing to pace: a watch sends a status when readiness changes."""

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
        transport = self.connection.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        client = str(peer[0]) if peer else ""
        refused = self.health.admit(client)
        if refused is not None:
            self.connection.finish(self.stream, StatusCode.RESOURCE_EXHAUSTED, refused)
            return
        try:
            async for answer in self.health.watch(service):
                self.connection.send_message(self.stream, answer)
        finally:
            self.health.leave(client)
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
        client = grpcio_peer(context.peer())
        refused = health.admit(client)
        if refused is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            return
        try:
            async for answer in health.watch(service):
                yield answer
        finally:
            health.leave(client)

    return {CHECK: grpc.unary_unary_rpc_method_handler(check), WATCH: grpc.unary_stream_rpc_method_handler(watch)}
