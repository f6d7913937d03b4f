"""One Triton server of a fleet: its connections, its health, its admission slots, its counters.

Everything the hot path touches is a plain attribute (``inflight``, ``failures``, counters):
one event loop owns a server, so no lock is needed and a request costs a few attribute
updates. Health flags are written by the health monitor and by passive ejection only.

A server's gRPC connection is made by the factory the fleet is given (``GrpcConnect``: the app
passes ``grpc.upstream.GrpcUpstream`` with its settings), so the fleet holds and closes it
without importing the gRPC side; the gRPC calls over a fleet live there (``grpc.fleet_upstream``).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from gateway.fleet.config import ServerSpec
from gateway.fleet.reads import ServerReads
from gateway.upstream import HttpUpstream, WaiterDeadlines


class GrpcClient(Protocol):
    """A server's gRPC connection, as ``grpc.upstream.GrpcUpstream`` is: the fleet names and closes
    it; the gRPC side makes the calls (a stream's listener and handle are its own types)."""

    @property
    def address(self) -> str: ...

    async def unary(self, path: str, message: Any, metadata: Any = (),
                    timeout: float | None = None, *, slot: Any = None) -> tuple[int, str, bytes]: ...

    async def open(self, path: str, listener: Any, metadata: Any = (), timeout: float | None = None) -> Any: ...

    async def aclose(self) -> None: ...


GrpcConnect = Callable[[str], GrpcClient]  # a server's gRPC address -> its connection


class Server:
    """A Triton server: ``http`` and ``grpc`` carry data-plane requests, ``control`` the health
    checks and model control (its own small pool, so they never wait behind inference), and
    ``probe`` the gateway's own readiness answers (``/readyz``, gRPC health): a connection of their
    own, outside admission control, so a saturated server still answers them at once."""

    __slots__ = ("fleet", "spec", "name", "http", "grpc", "control", "probe", "limit", "inflight",
                 "waiters", "failures", "probe_failures", "up", "ejected", "in_service", "ready", "requests", "errors",
                 "ejections", "refused", "last_error", "reads", "loop", "_wait_deadlines", "__weakref__")

    def __init__(self, fleet: str, spec: ServerSpec, *, grpc_connect: GrpcConnect, pool_size: int = 128,
                 connect_timeout_s: float = 2.0, request_timeout_s: float = 60.0, max_inflight: int = 0,
                 http_tls: ssl.SSLContext | None = None) -> None:
        self.fleet = fleet
        self.spec = spec
        self.name = spec.name
        self.http = HttpUpstream(spec.http, max_connections=pool_size, connect_timeout_s=connect_timeout_s,
                                 request_timeout_s=request_timeout_s, tls=http_tls)
        self.grpc = grpc_connect(spec.grpc)
        self.control = HttpUpstream(spec.http, max_connections=4, connect_timeout_s=connect_timeout_s,
                                    request_timeout_s=request_timeout_s, tls=http_tls)
        self.probe = HttpUpstream(spec.http, max_connections=2, connect_timeout_s=connect_timeout_s,
                                  request_timeout_s=request_timeout_s, tls=http_tls)
        self.limit = max_inflight  # 0: no admission limit
        self.inflight = 0  # admitted and not answered yet: sent to Triton, or about to be
        # Requests waiting for a slot, in order. No bound of its own: the clients bound it (one
        # request per HTTP connection, the streams of a gRPC one), as Triton's own queue would be.
        self.waiters: deque[asyncio.Future[bool]] = deque()  # True: a slot; False: timed out
        self.failures = 0  # consecutive connect/transport failures (passive health)
        self.probe_failures = 0  # consecutive failed active health checks
        self.up = False  # the last active health check passed
        self.ejected = False  # passive ejection: out until a health check passes again
        self.in_service = False  # joined: healthy and the fleet's loaded set applied; takes traffic
        self.ready: dict[str, frozenset[str]] = {}  # model -> versions READY here (repository index)
        self.requests = 0
        self.errors = 0
        self.ejections = 0
        self.refused = 0
        self.last_error = ""
        self.reads = ServerReads()  # what the control plane read of it lately, shared (gateway.fleet.reads)
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop that owns it, once a request waited
        self._wait_deadlines: WaitDeadlines | None = None

    def __repr__(self) -> str:
        return f"Server({self.fleet}/{self.name}, inflight={self.inflight}, in_service={self.in_service})"

    @property
    def has_room(self) -> bool:
        return not self.limit or self.inflight < self.limit

    # -- admission ---------------------------------------------------------------------------
    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that owns this server, asked for once (asyncio.get_running_loop makes a
        getpid() system call per call in 3.11; one loop owns a server)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            loop = self.loop = asyncio.get_running_loop()
        return loop

    async def wait_for_slot(self, timeout_s: float | None) -> bool:
        """Queue for a slot, at most ``timeout_s`` (None: until the caller is cancelled); True once
        one is ours (``inflight`` counts it). The HTTP fleet awaits :meth:`queue`'s waiter in its
        own frame instead (``fleet.forward``): this coroutine is a frame more per queued request."""
        loop = self.running_loop()
        waiter = self.queue(loop, None if timeout_s is None else loop.time() + timeout_s, timeout_s)
        if waiter is None:
            return False
        try:
            granted = await waiter
        except asyncio.CancelledError:
            self.leave_queue(waiter)
            raise
        if not granted:
            self.leave_queue(waiter)
        return granted

    def queue(self, loop: asyncio.AbstractEventLoop, deadline: float | None,
              timeout_s: float | None = None) -> asyncio.Future[bool] | None:
        """A place in the queue for a slot: a future the caller awaits, True once the slot is its own
        (``inflight`` counts it), False past ``deadline`` (``loop``'s time, from :meth:`running_loop`;
        None: none); None when ``timeout_s`` leaves no time to wait (refused at once). A waiter that ends otherwise than
        True (cancelled, False) goes through :meth:`leave_queue`.

        The request's task awaits its waiter itself: a handed slot wakes it in one step, and a
        timeout answers the waiter False. ``asyncio.wait_for`` over a shield cost three more
        futures and three more loop turns per queued request (at 1,000 HTTP connections every
        request queues: that was a tenth of the gateway's CPU); a timer armed and cancelled per
        queued request, ~2 µs more: the queue's deadlines share one timer (:class:`WaitDeadlines`);
        and a coroutine between the request and its waiter, a frame made and resumed per queued
        request: the caller awaits the future in its own frame."""
        if timeout_s is not None and timeout_s <= 0:
            return None
        waiter: asyncio.Future[bool] = loop.create_future()
        self.waiters.append(waiter)
        if deadline is not None:
            deadlines = self._wait_deadlines
            if deadlines is None or deadlines.loop is not loop:
                deadlines = self._wait_deadlines = WaitDeadlines(loop)
            deadlines.keep(waiter, deadline)
        return waiter

    def leave_queue(self, waiter: asyncio.Future[bool]) -> None:
        """A queued request goes (cancelled, or past its deadline): out of the queue; a slot handed
        to it as it went is passed on."""
        deadlines = self._wait_deadlines
        if deadlines is not None:
            deadlines.pending.pop(waiter, None)
        if waiter.done() and not waiter.cancelled() and waiter.result():
            self.release()  # the slot was handed to a caller that went away: pass it on
            return
        waiter.cancel()
        try:
            self.waiters.remove(waiter)  # O(queue), on the overload path only
        except ValueError:
            pass

    def release(self) -> None:
        """A request on this server was answered (or failed): hand its slot to the first live
        waiter (its deadline dropped), or free it. Called through its ``Admitted`` once, by the
        upstream connection as the answer arrives, not when the request's task next runs: on a busy
        loop that is later, and the slot would count a request Triton has finished."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                deadlines = self._wait_deadlines
                if deadlines is not None:
                    deadlines.pending.pop(waiter, None)
                return
        self.inflight -= 1

    def admitted(self) -> Admitted:
        """A slot taken on this server (``inflight`` counts it already), to be released once."""
        return Admitted(self)

    # -- passive health ----------------------------------------------------------------------
    def transport_failed(self, error: str, eject_after: int) -> bool:
        """A connect failure or a broken exchange; True when this one ejects the server."""
        self.errors += 1
        self.failures += 1
        self.last_error = error
        if self.failures >= eject_after and not self.ejected:
            self.ejected = True
            self.in_service = False  # back only through a health check and the join sync
            self.ejections += 1
            return True
        return False

    async def aclose(self) -> None:
        deadlines, self._wait_deadlines = self._wait_deadlines, None
        if deadlines is not None:
            deadlines.close()
        for waiter in self.waiters:
            waiter.cancel()
        self.waiters.clear()
        await self.http.aclose()
        await self.control.aclose()
        await self.probe.aclose()
        await self.grpc.aclose()


class WaitDeadlines(WaiterDeadlines):
    """The deadlines of one server's queued requests under one timer (:class:`~gateway.upstream.WaiterDeadlines`,
    as a pool's waiters for a connection); a waiter past its own is answered False."""

    __slots__ = ()

    def _timed_out(self, waiter: asyncio.Future[Any]) -> None:
        waiter.set_result(False)


class Admitted:
    """One request's admission slot on a server, released exactly once whoever gets there first:
    the upstream connection when Triton's answer arrives (its response headers, a gRPC call's
    end), or the request's own way out (a failure, a cancel) when no answer came."""

    __slots__ = ("server",)

    def __init__(self, server: Server | None) -> None:
        self.server = server

    def release(self) -> None:
        server = self.server
        if server is not None:
            self.server = None
            server.release()
