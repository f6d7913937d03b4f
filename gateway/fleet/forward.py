"""The fleet-aware stand-in for the single-server HTTP upstream client: same calls, one server per request.

``FleetHttp.request`` takes exactly what ``HttpUpstream`` takes. The request arrives addressed:
the HTTP front read its path and JSON header once and hands over what the fleet chooses by
(``model``, ``version``: the one it is sent to, ``sequence``); the fleet reads nothing of the
request again, path included. It picks a server with :meth:`Fleet.pick`, notes it on the
request's exchange (``exchange.server``: the access log names it), takes an admission slot, and
sends. Per request that is a dict lookup, a draw and an attribute set: no parsing, no locks, no
allocation. The gRPC stand-in, ``grpc.fleet_upstream.FleetGrpc``, follows the same rules below;
it lives on the gRPC side, so this package imports no front and no protocol of theirs
(``tests/unit/test_architecture.py``).

- A request that could not be sent at all (the connect was refused or timed out: nothing was
  written, and a streamed body was not read yet) is tried once more on another server.
- A connect failure or a broken exchange counts towards the server's passive ejection.
- A request in flight on a server that dies gets one clear error (HTTP 502/503, gRPC
  UNAVAILABLE) that says the gateway answered and names no server (the server's address goes
  to ``/admin/fleets`` and the log); it is not re-sent, since Triton may have run it.
- Triton's own answers pass as Triton sent them, its queue-full included (HTTP 503, gRPC
  UNAVAILABLE "Exceeds maximum queue size"): counted as the server's ``refused`` here, and
  recorded as overload (never against a version) by the recorder.
- The admission slot counts a request sent to Triton and not answered yet: the upstream
  connection gives it back as the response headers arrive (inference responses arrive whole; a
  streamed response, SSE, releases it then, not at its last chunk), before the request's task
  runs again. A request past ``max_inflight_per_server`` waits in order for a slot, within its
  deadline (``request_timeout_s``), or ``queue_timeout_ms`` when shedding is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from gateway.errors import ClientGone, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.fleet.balancer import Fleet
from gateway.fleet.members import Admitted, Server
from gateway.sequences import SequenceFields
from gateway.upstream import Body, HttpUpstream, NotesServer, Slot, UpstreamResponse

# Triton's answer when a model's queue is full (HTTP 503, gRPC UNAVAILABLE): passed on as it is.
TRITON_QUEUE_FULL = "Exceeds maximum queue size"
_QUEUE_FULL = TRITON_QUEUE_FULL.encode()


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
                      body: Body | AsyncIterator[bytes] = b"", *, content_length: int | None = None,
                      timeout_s: float | None = None, model: str = "", version: str | None = None,
                      sequence: SequenceFields | None = None, for_exchange: NotesServer | None = None,
                      slot: Slot | None = None) -> UpstreamResponse:
        """``model``, ``version`` and ``sequence``: what the front read of the request (see the
        module's docstring); ``for_exchange.server``: the server it went to, the last one tried.
        ``slot``: not for a fleet (it takes its servers' own)."""
        fleet = self.fleet
        server = fleet.single
        if server is None:  # several servers: choose by what the front handed over (one server reads none of it)
            server = fleet.pick(model, version) if sequence is None else fleet.pick_in_sequence(model, version,
                                                                                                 sequence)
        if server.limit and server.inflight >= server.limit:  # full: room elsewhere, else a wait for a slot in order
            found = None if server is fleet.single else fleet.room(server, model, version)
            if found is not None:
                server = found
            else:  # Fleet.admit's wait, in this frame: the queued request's wake resumes no coroutine more
                timeout = fleet.request_timeout_s if timeout_s is None else timeout_s
                shed = fleet.queue_timeout_s
                wait = timeout if shed is None or shed >= timeout else shed  # Fleet.queue_wait's, inline
                loop = server.running_loop()
                started = loop.time()
                waiter = server.queue(loop, started + wait, wait)
                if waiter is None:
                    raise fleet.refusal(server, timeout)
                try:
                    granted = await waiter
                except asyncio.CancelledError:
                    server.leave_queue(waiter)
                    raise
                if not granted:
                    server.leave_queue(waiter)
                    raise fleet.refusal(server, timeout)
                timeout_s = max(timeout - (loop.time() - started), 0.001)
        else:
            server.inflight += 1
        if for_exchange is not None:
            for_exchange.server = server.name
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
                other, timeout_s = await self._admit(other, model, version, timeout_s)
            else:
                other.inflight += 1
            if for_exchange is not None:
                for_exchange.server = other.name  # the one that answers (or fails) last
            return await self._on(other, method, target, headers, body, content_length, timeout_s)

    async def _admit(self, server: Server, model: str, version: str | None,
                     timeout_s: float | None) -> tuple[Server, float]:
        """A slot, waited for within the request's deadline; the server and what is left of the deadline."""
        timeout = self.fleet.request_timeout_s if timeout_s is None else timeout_s
        loop = server.running_loop()
        started = loop.time()
        server = await self.fleet.admit(server, model, version, timeout)
        return server, max(timeout - (loop.time() - started), 0.001)

    async def _on(self, server: Server, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                    body: Body | AsyncIterator[bytes], content_length: int | None,
                    timeout_s: float | None) -> UpstreamResponse:
        server.requests += 1
        try:  # the slot goes back as the answer's headers arrive (the connection does it), or on the way out
            response = await server.http.request(method, target, headers, body, content_length=content_length,
                                                 timeout_s=timeout_s, slot=Admitted(server))
        except (UpstreamTimeout, ClientGone):
            raise
        except UpstreamError as exc:  # refused, unreachable, or the connection broke: the server's fault
            self.fleet.failed(server, exc.message)
            raise
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
