"""A fleet: its servers, and the per-request choice among them.

The choice is power-of-two-choices on outstanding requests: draw two servers among those
where the routed version is READY, take the one with clearly fewer requests in flight
(at least ``STEER_GAP`` fewer, and the busier one has half again as many), else the first
drawn. Compared with round-robin it steers away from a slow or overloaded server at once;
compared with a full least-outstanding scan it costs the same for 2 servers or 200.

Why a gap, not "fewer": under a closed loop (N clients, each sending when its answer
comes), steering on every difference of one makes each server's share follow its momentary
speed. Two equal Tritons on a busy node differ by 20-30% for seconds at a time (which one the
scheduler runs), and a strict comparison turned that into 55/45 splits. Alternating, a server
k times slower holds k times the other's requests in flight; the balancer leaves shares even
up to k = 1.5 and steers past it (a server twice as slow gets ~43% of a closed loop, a hung
one nothing once its gap opens). A difference of one request is arrival-timing noise and
never steers. With two servers the "draw" is a strict alternation, so equal servers get
equal shares exactly.

The candidate lists per (model, version) are computed once after every health change and
kept in a dict of dicts: the hot path does two dict lookups, a draw (a flip for two servers,
a random number past two) and a compare, and allocates nothing. Health changes (control
plane, ~1/s at most) drop the whole cache by swapping in an empty dict; readers never see a
half-built list.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError, Overloaded, UpstreamUnavailable
from gateway.fleet.config import ServerSpec
from gateway.fleet.members import GrpcConnect, Server
from gateway.sequences import SequenceFields, SequencePins

# /readyz's answer on Triton's liveness comes within this, under a probe's usual 1 s budget.
LIVE_BUDGET_S = 0.8
_NO_VERSION = ""  # cache key for unversioned requests (Triton picks its default version)
Key = str | bytes
STEER_GAP = 2  # the other server must have at least this many fewer requests in flight to be preferred
_CACHE_LIMIT = 4096  # distinct (model, version) pairs cached between two health changes
log = logging.getLogger("gateway.fleet")


class Fleet:
    """Named group of Triton servers; ``pick`` is the only call on the request path."""

    def __init__(self, name: str, *, grpc_connect: GrpcConnect, pool_size: int = 128, connect_timeout_s: float = 2.0,
                 request_timeout_s: float = 60.0, max_inflight: int = 0, queue_timeout_s: float | None = None,
                 eject_after: int = 3, http_tls: ssl.SSLContext | None = None, max_sequence_pins: int = 100_000,
                 max_sequence_pins_per_client: int = 1_000) -> None:
        self.name = name
        self.grpc_connect = grpc_connect  # makes each server's gRPC connection (TLS and keepalive are its own)
        self.http_tls = http_tls  # to every server of the fleet, for https:// URLs
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_inflight = max_inflight  # per server: admitted requests not answered yet
        self.queue_timeout_s = queue_timeout_s  # None: a request waits for a slot until its deadline
        self.eject_after = eject_after
        self.servers: dict[str, Server] = {}
        self.retired: list[Server] = []  # left the fleet (DNS): closed once their requests ended
        self.on_change: Callable[[Fleet], None] | None = None
        # Called by the health monitor before a server takes traffic (applies the loaded set).
        self.on_join: Callable[[Fleet, Server], Awaitable[None]] | None = None
        self._cache: dict[Key, dict[Key, tuple[Server, ...]]] = {}
        self._all: tuple[Server, ...] = ()
        self.single: Server | None = None  # a one-server fleet: the request path skips the choice
        self._random = random.Random().random
        self._turn = False  # two-server fleets alternate which one is drawn first
        # (model, sequence id) -> server name: Triton keeps a sequence's state in one server. The
        # policy's pin table's kind and bounds: a pin is its client's, one client's starts evict
        # its own least recently used pins only (see pick_in_sequence).
        self.sequences = SequencePins(max_sequence_pins, max_per_client=max_sequence_pins_per_client)

    # -- membership (control plane) -------------------------------------------------------------
    def add(self, spec: ServerSpec) -> Server:
        server = self.servers.get(spec.name)
        if server is None:
            server = Server(self.name, spec, grpc_connect=self.grpc_connect, pool_size=self.pool_size,
                            connect_timeout_s=self.connect_timeout_s, request_timeout_s=self.request_timeout_s,
                            max_inflight=self.max_inflight, http_tls=self.http_tls)
            self.servers[spec.name] = server
            self.changed()
        return server

    def remove(self, name: str) -> Server | None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.in_service = False
            self.retired.append(server)
            self.changed()
        return server

    def changed(self) -> None:
        """Health, readiness or membership moved: recompute candidates on next use."""
        self._all = tuple(self.servers.values())
        self.single = self._all[0] if len(self._all) == 1 else None
        self._cache = {}
        if self.on_change is not None:
            self.on_change(self)

    # -- the request path ---------------------------------------------------------------------
    def candidates(self, model: Key, version: Key | None) -> tuple[Server, ...]:
        """In-service servers where ``version`` is READY; in-service ones if it is READY nowhere
        (Triton then answers for itself, and the version fallback applies); every server when
        none is in service (a single-server fleet behaves as before fleets: try, fail clearly).
        ``model`` and ``version`` may be bytes straight off the wire (cached as given)."""
        key = version or _NO_VERSION
        by_version = self._cache.get(model)
        if by_version is not None:
            found = by_version.get(key)
            if found is not None:
                return found
        name = model.decode("utf-8", "replace") if isinstance(model, bytes) else model
        wanted = version.decode("latin-1") if isinstance(version, bytes) else version
        serving = tuple(s for s in self._all if s.in_service)
        if wanted:
            ready = tuple(s for s in serving if wanted in s.ready.get(name, ()))
            found = ready or serving or self._all
        else:
            found = serving or self._all
        cache = self._cache
        if len(cache) >= _CACHE_LIMIT:
            cache = self._cache = {}
        cache.setdefault(model, {})[key] = found
        return found

    def pick(self, model: Key, version: Key | None, avoid: Server | None = None) -> Server:
        """Power of two choices on in-flight requests (a clear gap steers), among the
        candidates (``avoid`` excluded when there is another one: the retry after a failed connect)."""
        by_version = self._cache.get(model)
        servers = by_version.get(version or _NO_VERSION) if by_version is not None else None
        if servers is None:
            servers = self.candidates(model, version)
        count = len(servers)
        if count == 2:  # the common fleet: alternate the order, take the clearly less busy
            turn = self._turn = not self._turn
            a, b = (servers[0], servers[1]) if turn else (servers[1], servers[0])
        elif count == 1:
            only = servers[0]
            if only is avoid:
                raise UpstreamUnavailable(f"fleet '{self.name}' has no other server to try")
            return only
        elif count == 0:
            raise UpstreamUnavailable(f"fleet '{self.name}' has no servers (none discovered yet)")
        else:
            draw = self._random() * count
            first = int(draw)
            second = int((draw - first) * (count - 1))  # the fractional part: a second draw for free
            if second >= first:
                second += 1
            a, b = servers[first], servers[second]
        if a is avoid:
            return b
        if b is avoid:
            return a
        gap = a.inflight - b.inflight
        return b if gap >= STEER_GAP and gap + gap >= b.inflight else a

    def pick_in_sequence(self, model: str, version: Key | None, sequence: SequenceFields) -> Server:
        """The server for a request of a sequence: the one its pin names while that one is in
        service, else a :meth:`pick`. A start pins its pick for its client (``sequence.client``:
        past the client's quota its own least recently used pin goes, never another client's).
        A continuing request with a live pin only refreshes it (its owner stays the start's). One
        whose pin is gone (evicted by its own client's quota, expired, or lost with a restart) or
        names a server that left pins its pick too, kept by the pin's owner if there was a pin,
        else its own client's: the rest of the sequence then stays on one server (it may not be
        the one holding the state: Triton then says the sequence is unknown, the one clear
        error it can get), and the pin is bounded like a start's, so a stream of made-up
        continuations evicts only its sender's pins. An end lets the pin go."""
        sequences, sequence_id = self.sequences, sequence.id
        name = None if sequence.start else sequences.lookup(model, sequence_id)
        server = self.servers.get(name) if name is not None else None
        if server is None or not server.in_service:
            server = self.pick(model, version)
            if sequence.end:
                sequences.release(model, sequence_id)
            elif sequence.start:
                sequences.pin(model, sequence_id, server.name, sequence.client)
            else:
                sequences.repin(model, sequence_id, server.name, sequence.client)
        elif sequence.end:
            sequences.release(model, sequence_id)
        return server

    async def admit(self, server: Server, model: Key, version: Key | None, deadline_s: float | None) -> Server:
        """A slot on ``server``, or on the least busy other candidate with room (:meth:`room`), or a
        wait in order for one on ``server``: until the request's own deadline (``deadline_s`` from
        now; None: until the caller gives up, e.g. the gRPC front at the client's deadline), or at
        most ``queue_timeout_s`` when shedding is set (:meth:`queue_wait`). ``Overloaded`` (429 +
        Retry-After) when none came. ``inflight`` counts it. (The HTTP fleet does the same in its
        request's own frame: ``FleetHttp.request``.)"""
        found = self.room(server, model, version)
        if found is not None:
            return found
        if await server.wait_for_slot(self.queue_wait(deadline_s)):
            return server
        raise self.refusal(server, deadline_s)

    def room(self, server: Server, model: Key, version: Key | None) -> Server | None:
        """A slot taken on ``server``, else on the least busy other candidate with room
        (``inflight`` counts it); None when every one is full."""
        if server.has_room:
            server.inflight += 1
            return server
        best = server
        if self.single is None:  # one server: no other could take it (and no candidates looked up per request)
            for other in self.candidates(model, version):
                if other.has_room and other.inflight < best.inflight:
                    best = other
        if best is server:
            return None
        best.inflight += 1
        return best

    def queue_wait(self, deadline_s: float | None) -> float | None:
        """How long a request with ``deadline_s`` left waits for a slot: its deadline, or
        ``queue_timeout_s`` when shedding is set and comes first."""
        shed = self.queue_timeout_s
        return shed if shed is not None and (deadline_s is None or shed < deadline_s) else deadline_s

    def refusal(self, server: Server, deadline_s: float | None) -> Overloaded:
        """No slot came on ``server`` within :meth:`queue_wait`: counted, and why."""
        server.refused += 1
        sheds_first = self.queue_wait(deadline_s) != deadline_s
        why = "the queue wait (queue_timeout_ms) ran out" if sheds_first else "the request's deadline ran out"
        return Overloaded(f"fleet '{self.name}': every server is at its limit of {self.max_inflight} requests in "
                          f"flight and {why}; retry later")

    def failed(self, server: Server, error: str) -> None:
        if server.transport_failed(error, self.eject_after):
            # the client was told only that the gateway could not reach Triton: which one, here
            log.warning("fleet %s: server %s ejected after %d failures in a row: %s", self.name, server.name,
                        server.failures, error)
            self.changed()

    async def live(self, timeout_s: float) -> str | None:
        """None when a server of the fleet answers ``/v2/health/live`` (in-service ones asked),
        else why not. Every server is asked at once and the first 200 answers, all within
        ``LIVE_BUDGET_S`` (a probe's budget is about 1 s: one after another, a hung first server
        once held /readyz for ``connect_timeout_s``). Over each server's probe connection: never
        queued behind inference, never counted against ``max_inflight_per_server``. The reason
        names no address."""
        servers = self.in_service() or list(self._all)
        if not servers:
            return f"fleet '{self.name}': no Triton server is live (it has no servers)"
        budget = min(timeout_s, LIVE_BUDGET_S)
        loop = asyncio.get_running_loop()
        pending = {loop.create_task(_live(server, budget)) for server in servers}
        deadline = loop.time() + budget
        reason = f"none answered within {budget:g} s"
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=max(deadline - loop.time(), 0),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
                for task in done:
                    answer = task.result()
                    if answer is None:
                        return None
                    reason = answer
        finally:
            for task in pending:
                task.cancel()
        return f"fleet '{self.name}': no Triton server is live ({reason})"

    # -- views -------------------------------------------------------------------------------
    def in_service(self) -> list[Server]:
        return [s for s in self._all if s.in_service]

    def describe(self) -> list[dict[str, object]]:
        """Per server: health, in-flight, counters and loaded versions (``gateway ctl fleets``)."""
        return [{"server": s.name, "http": s.spec.http, "grpc": s.spec.grpc, "up": s.up, "ejected": s.ejected,
                 "in_service": s.in_service, "inflight": s.inflight, "queued": len(s.waiters),
                 "requests": s.requests, "errors": s.errors, "ejections": s.ejections, "refused": s.refused,
                 "last_error": s.last_error,
                 "ready": {m: sorted(v, key=int) for m, v in sorted(s.ready.items())}} for s in self._all]

    async def aclose(self) -> None:
        for server in [*self._all, *self.retired]:
            await server.aclose()
        self.retired.clear()


async def _live(server: Server, timeout_s: float) -> str | None:
    """None if ``server`` answers ``/v2/health/live`` with 200, else why not (no address)."""
    try:
        response = await server.probe.request(b"GET", b"/v2/health/live", [], timeout_s=timeout_s)
        await response.read()
    except GatewayError as exc:
        return exc.message
    return None if response.status == 200 else f"/v2/health/live answered {response.status}"
