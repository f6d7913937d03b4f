"""Keep-alive HTTP/1.1 connection pool to Triton, on asyncio.Protocol + httptools.

Why our own client: on the hot path the upstream client is where a Python proxy spends its
CPU. Measured on these machines, httpx costs 1,000-2,500 µs per request, aiohttp's client
170-380 µs, and a minimal protocol with httptools' parser ~30 µs (uvicorn's server is
built the same way). This module is that minimal client, with what a proxy needs:

- a bounded pool per upstream (LIFO idle list, waiters handed connections directly, their
  deadlines under one timer: :class:`WaiterDeadlines`);
- request bodies as bytes (one write) or streamed (``Content-Length`` kept, else chunked);
- responses buffered when they arrive whole, streamed chunk by chunk otherwise (SSE), with
  read back-pressure;
- one deadline per exchange, kept by the pool's one timer (:class:`Deadlines`: no timer handle,
  no task per request) and :meth:`UpstreamResponse.abort` for a client that went away;
- a connection seen closed (idle, or handed over as Triton closed it) is never used; a request
  on a reused connection that Triton closed before any byte of an answer is sent once more,
  on one that did not sit idle (why that is safe for a POST: ``_connection_for_resend``).

Every low-level error leaves here as a :mod:`gateway.errors` exception: the gateway's own answer,
which names no address (a fleet records which server it was, for the log and ``/admin/fleets``).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

import httptools

from gateway.errors import ClientGone, UpstreamError, UpstreamTimeout, UpstreamUnavailable, os_reason
from gateway.sequences import SequenceFields

Headers = list[tuple[bytes, bytes]]
# A request body held whole: bytes, or the bytearray a large one was read into as it came
# (``http_output.GatewayCycle.rest_of_body``); written as it is, never copied.
Body = bytes | bytearray
# Not forwarded: hop-by-hop (RFC 9110 §7.6.1) and what this client sets itself (Host, framing, Expect).
_HOP_BY_HOP = frozenset(
    [b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"transfer-encoding", b"te", b"trailer", b"upgrade", b"host", b"content-length", b"expect"]
)
_IDEMPOTENT = frozenset([b"GET", b"HEAD", b"OPTIONS"])
_HIGH_WATER = 1 << 20  # buffered streaming bytes before we stop reading from Triton


def named_by_connection(value: bytes) -> frozenset[bytes]:
    """The header names a ``Connection`` header lists: hop-by-hop too (RFC 9110 §7.6.1)."""
    return frozenset(token.strip().lower() for token in value.split(b",")) - {b"close", b"keep-alive", b""}


class Slot(Protocol):
    """An admission slot the request holds (``fleet.members.Admitted``): given back once, as the
    answer's headers arrive or on the request's way out, whichever comes first."""

    def release(self) -> None: ...


class NotesServer(Protocol):
    """What a request is sent for (its exchange): a fleet notes there the server it chose, the
    last one tried when a retry moved it (``pipeline.Exchange.server``)."""

    server: str


class UpstreamResponse:
    """One exchange on one connection: status and headers first, then the body.

    ``complete`` is True when the whole body arrived with the headers (the common case for
    inference): ``body()`` returns it and the connection is already back in the pool.
    Otherwise iterate :meth:`chunks`.
    """

    __slots__ = ("_conn", "_waiter", "_deadlines", "deadline", "timeout", "_chunks", "_buffered", "status", "headers",
                 "complete", "error", "keep_alive", "got_bytes", "dropped", "_loop", "_slot")

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn: _Connection | None = conn
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self._deadlines: Deadlines | None = None  # kept there until it ends (Deadlines.keep)
        self.deadline = 0.0  # loop time
        self.timeout = 0.0  # the seconds it was given, for the error
        self._chunks: list[bytes] = []
        self._buffered = 0
        self.status = 0
        self.headers: Headers = []
        self.complete = False
        self.error: UpstreamError | None = None
        self.keep_alive = False
        self.got_bytes = False
        self.dropped = False  # Triton closed the connection before sending a byte of the answer
        self._slot: Slot | None = None  # given back when the headers arrive

    def body(self) -> bytes:
        """The whole body of a complete response: its reads joined once (later calls, as for its
        outcome or a shadow's comparison, take the same bytes; the reads go)."""
        assert self.complete, "body() on a response still streaming"
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        body = b"".join(chunks)
        self._chunks = [body]
        return body

    async def read(self) -> bytes:
        """The whole body, waiting for it if it is still arriving; body() works afterwards."""
        if self.complete:
            return self.body()
        data = b"".join([chunk async for chunk in self.chunks()])
        self._chunks = [data]
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as Triton sends them; raises UpstreamError if the exchange breaks."""
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                for chunk in chunks:
                    yield chunk
                continue
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            await self._wait()

    def abort(self, error: UpstreamError | None = None) -> None:
        """Give up on this exchange (client gone, deadline): its connection is closed."""
        if not self.complete and self.error is None:
            self._fail(error or ClientGone("the client closed the connection"))
        conn, self._conn = self._conn, None
        if conn is not None and not self.complete:
            conn.close()

    # -- called by the connection -------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER and self._conn is not None:
            self._conn.pause()
        waiter = self._waiter  # _wake's, inline: an answer's body arrives with its headers, whose wake came first
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        self.complete = True
        deadlines = self._deadlines  # _cancel_timer's and _wake's, inline (once per exchange)
        if deadlines is not None:
            self._deadlines = None
            deadlines.pending.discard(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        self._cancel_timer()
        self._wake()

    def _cancel_timer(self) -> None:
        deadlines = self._deadlines
        if deadlines is not None:
            self._deadlines = None
            deadlines.pending.discard(self)


class EarliestTimer:
    """Deadlines of many under one timer, armed for the earliest: a timer handle per deadline
    (armed, cancelled, its libuv handle closed) was ~2.4 µs of a request's CPU. Deadlines kept
    together mostly share their timeout, so a later one's is later: keeping one is a set or dict
    insertion, and the timer is re-armed only when the earliest moves earlier (a shorter timeout)
    or when it fires. Each is met as exactly as a timer of its own would meet it. A subclass
    keeps the deadlines (``keep``, calling :meth:`_arm` only when one comes before ``_at``) and
    says in :meth:`_expire` what to do with those past due."""

    __slots__ = ("loop", "_timer", "_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # when the timer fires

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = deadline
        self._timer = self.loop.call_at(deadline, self._due)

    def close(self) -> None:
        """Its owner closes: the timer goes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        now = self.loop.time() + 0.001  # the loop's clock counts milliseconds: a timer may fire just short of it
        earliest = self._expire(now)
        if earliest is not None:
            self._arm(earliest)

    def _expire(self, now: float) -> float | None:
        """End what is due by ``now``; the earliest deadline still kept, if any."""
        raise NotImplementedError


class Deadlines(EarliestTimer):
    """The deadlines of one pool's exchanges in flight (once a timeout at most at c=1), under one
    timer (:class:`EarliestTimer`); an exchange past its own is aborted with UpstreamTimeout. The
    pool closing drops the timer; an exchange still in flight ends with its connection."""

    __slots__ = ("pending",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.pending: set[UpstreamResponse] = set()

    def keep(self, exchange: UpstreamResponse, deadline: float, timeout: float) -> None:
        """Abort ``exchange`` with UpstreamTimeout at ``deadline`` unless it ends before."""
        exchange.deadline, exchange.timeout, exchange._deadlines = deadline, timeout, self
        self.pending.add(exchange)
        if self._timer is None or deadline < self._at:
            self._arm(deadline)

    def _expire(self, now: float) -> float | None:
        for exchange in [exchange for exchange in self.pending if exchange.deadline <= now]:
            exchange.abort(UpstreamTimeout(f"Triton did not answer within {exchange.timeout:g}s"))
        return min((exchange.deadline for exchange in self.pending), default=None)


class WaiterDeadlines(EarliestTimer):
    """Waiters (futures a task awaits) with a deadline each, under one timer (:class:`EarliestTimer`):
    ``wait_for`` per waiter armed a timer and cost two more futures and loop turns. A waiter past
    its own is ended by :meth:`_timed_out`; its owner drops it from ``pending`` when it ends first."""

    __slots__ = ("pending",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.pending: dict[asyncio.Future[Any], float] = {}  # waiter -> its deadline (loop time)

    def keep(self, waiter: asyncio.Future[Any], deadline: float) -> None:
        self.pending[waiter] = deadline
        if self._timer is None or deadline < self._at:
            self._arm(deadline)

    def _expire(self, now: float) -> float | None:
        pending = self.pending
        for waiter in [waiter for waiter, deadline in pending.items() if deadline <= now]:
            del pending[waiter]
            if not waiter.done():
                self._timed_out(waiter)
        return min(pending.values(), default=None)

    def _timed_out(self, waiter: asyncio.Future[Any]) -> None:
        raise NotImplementedError


class _ConnectionWaits(WaiterDeadlines):
    """Requests waiting for one of a full pool's connections, each until its exchange's deadline."""

    __slots__ = ()

    def _timed_out(self, waiter: asyncio.Future[Any]) -> None:
        waiter.set_exception(UpstreamTimeout("no free connection to Triton before the deadline"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; feeds httptools and routes callbacks to the exchange."""

    def __init__(self, pool: HttpUpstream) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: UpstreamResponse | None = None
        self.closed = False
        self.paused = False
        self.used = False
        self.head_request = False
        self.sending = False  # a streamed request body is still being written
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the pool once connected

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection is out of sync
            self.close()
            return
        exchange.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            exchange._fail(UpstreamError(f"Triton sent an invalid HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange, self.exchange = self.exchange, None
        if exchange is not None and not exchange.complete and exchange.error is None:  # not our own close
            exchange.dropped = not exchange.got_bytes
            exchange._fail(UpstreamError("Triton closed the connection before the response ended"))
        self.pool._discard(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.exchange.headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        assert exchange is not None
        exchange.status = self.parser.get_status_code()
        exchange.keep_alive = self.parser.should_keep_alive()
        slot = exchange._slot
        if slot is not None:  # answered: the slot is free now, not when the request's task runs again
            exchange._slot = None
            slot.release()
        exchange._wake()
        if self.head_request:  # httptools would wait for a body a HEAD response never has
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        self.exchange._feed(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        exchange._conn = None
        exchange._finish()
        # Triton may answer (e.g. 400) before a streamed body is fully sent: such a connection
        # is out of sync and must not be reused.
        if exchange.keep_alive and not self.head_request and not self.closed and not self.sending:
            self.pool._release(self)
        else:
            self.close()

    # used by the pool and the exchange
    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class HttpUpstream:
    """A pool of keep-alive connections to one Triton HTTP endpoint; one per process."""

    def __init__(self, url: str, *, max_connections: int = 128, connect_timeout_s: float = 2.0,
                 request_timeout_s: float = 60.0, tls: ssl.SSLContext | None = None) -> None:
        secure = url.startswith("https://")
        rest = url.removeprefix("https://" if secure else "http://").rstrip("/")
        host, _, port = rest.partition(":")
        self.name = url
        self.host, self.port = host or "127.0.0.1", int(port or (443 if secure else 80))
        if secure and tls is None:  # verified against the system's trust store
            tls = ssl.create_default_context()
        self.tls = tls if secure else None  # one fleet may mix https:// and plain servers
        self.host_header = rest.encode()
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._closing = False
        self._deadlines: Deadlines | None = None
        self._waits: _ConnectionWaits | None = None  # the waiters' deadlines
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it serves, once a request waited

    reads_sequences = False  # one server: a request's sequence fields choose nothing (see FleetHttp)

    async def request(self, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                      body: Body | AsyncIterator[bytes] = b"", *, content_length: int | None = None,
                      timeout_s: float | None = None, model: str = "", version: str | None = None,
                      sequence: SequenceFields | None = None, for_exchange: NotesServer | None = None,
                      slot: Slot | None = None) -> UpstreamResponse:
        """Send one request; return once the status line and headers are in.

        ``headers`` are the client's; hop-by-hop ones and ``Host`` are replaced. A streamed
        ``body`` keeps ``content_length`` when given, else goes chunked. ``model``, ``version``
        (the one sent: the path's, else None) and ``sequence``: what the front read of the request,
        once (a fleet of several servers chooses by them and never reads the request itself);
        ``for_exchange``: where a fleet notes the server it chose. One server reads none of them.
        ``slot``: the admission slot the request holds on this server (a fleet's), given back as the
        response headers arrive, or on the way out if none arrive.
        """
        exchange: UpstreamResponse | None = None
        try:
            head = self._head(method, target, headers, body, content_length)
            timeout = self.request_timeout_s if timeout_s is None else timeout_s
            conn = self._idle_connection()
            if conn is not None:  # its loop is the running one (asking for that makes a getpid() call in 3.11)
                loop = conn.loop
                assert loop is not None
                deadline = loop.time() + timeout
            else:
                loop = self._running_loop()
                deadline = loop.time() + timeout
                conn = await self._acquire(deadline, once=not isinstance(body, Body))
            deadlines = self._deadlines
            if deadlines is None or deadlines.loop is not loop:
                deadlines = self._deadlines = Deadlines(loop)
            resent = False
            while True:
                reused, conn.used = conn.used, True
                conn.head_request = method == b"HEAD"
                exchange = UpstreamResponse(conn, loop)
                exchange._slot = slot
                conn.exchange = exchange
                deadlines.keep(exchange, deadline, timeout)
                try:
                    if isinstance(body, Body):  # the usual case: written at once, no coroutine
                        self._write(conn, head, body)
                    else:
                        await self._send(conn, exchange, head, body, chunked=content_length is None)
                    while exchange.status == 0 and exchange.error is None:
                        waiter = exchange._waiter = loop.create_future()
                        try:
                            await waiter
                        finally:
                            exchange._waiter = None
                except BaseException:
                    exchange.abort()
                    raise
                if exchange.error is None:
                    return exchange
                if resent or not (reused and exchange.dropped) or not isinstance(body, Body):  # a stream is consumed
                    exchange.abort()
                    raise exchange.error
                resent = True
                conn = await self._connection_for_resend(method, exchange.error, deadline)
        finally:
            if slot is not None and (exchange is None or exchange._slot is not None):  # not given back by the answer
                slot.release()


    async def _connection_for_resend(self, method: bytes, dropped: UpstreamError, deadline: float) -> _Connection:
        """Triton closed a reused connection without a byte of an answer: the request goes once more.

        Safe for a POST too (inference is not idempotent): Triton's HTTP server runs a request
        only once it has parsed all of it, holds the connection while it runs, and writes the
        answer before it reads on. It closes a connection without answering when it did not run
        the request: it closed the kept-alive connection as we wrote on it, or its parser failed
        on our bytes (Triton 2.51's libevhtp reads one byte past a 4 KB read that ends inside the
        URL and drops the connection when that stale byte is a space or CR/LF). The one way a
        request it ran ends so is its process dying before the answer: nobody listens for the
        resend (unless a new process already shares the port: Triton's --reuse-http-port), and
        a POST gets the first error, not "unavailable", which a fleet would send to another
        server (a GET may go). Not on a fresh connection (the idle-close race needs a kept-alive
        one), and on one that did not sit idle (the others sat as long as this one).
        """
        try:
            return await self._acquire(deadline, fresh=True)
        except UpstreamUnavailable:
            if method in _IDEMPOTENT:
                raise
            raise dropped from None

    def _head(self, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
              body: Body | AsyncIterator[bytes], content_length: int | None) -> bytes:
        lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n"]
        named = None
        for name, value in headers:
            if name not in _HOP_BY_HOP:
                lines += (name, b": ", value, b"\r\n")
            elif name == b"connection":
                named = named_by_connection(value) | (named or frozenset())
        if named and named - _HOP_BY_HOP:  # rare: the client's Connection header names more hop-by-hop headers
            kept = [(name, value) for name, value in headers if name not in named and name != b"connection"]
            return self._head(method, target, kept, body, content_length)
        if isinstance(body, Body):
            if body or method not in _IDEMPOTENT:
                lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        elif content_length is not None:
            lines += (b"content-length: ", str(content_length).encode(), b"\r\n")
        else:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _send(self, conn: _Connection, exchange: UpstreamResponse, head: bytes,
                    body: Body | AsyncIterator[bytes], chunked: bool) -> None:
        if isinstance(body, Body):
            self._write(conn, head, body)
            return
        transport = conn.transport
        assert transport is not None
        transport.write(head)
        conn.sending = True
        try:
            await self._send_stream(transport, exchange, body, chunked)
        finally:
            conn.sending = False

    @staticmethod
    def _write(conn: _Connection, head: bytes, body: Body) -> None:
        transport = conn.transport
        assert transport is not None
        if len(body) < 65536:
            transport.write(head + body)
        else:  # one writev, the body as it is (uvloop keeps a view of what the socket did not take)
            transport.writelines((head, body))

    @staticmethod
    async def _send_stream(transport: asyncio.Transport, exchange: UpstreamResponse,
                           body: AsyncIterator[bytes], chunked: bool) -> None:
        async for chunk in body:
            if exchange.error is not None:
                raise exchange.error
            if exchange.complete:  # Triton answered early; the rest of the body is moot
                return
            if not chunk:
                continue
            if chunked:
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                transport.write(chunk)
        if chunked:
            transport.write(b"0\r\n\r\n")

    # -- pool ----------------------------------------------------------------------------
    def _idle_connection(self) -> _Connection | None:
        """The connection idle the shortest that is still open, if any."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
        return None

    async def _acquire(self, deadline: float, fresh: bool = False, once: bool = False) -> _Connection:
        """The connection idle the shortest, else a new one, else the next one released.
        ``fresh``: not one that sat idle (a resend; the others sat idle as long as the dropped one).
        ``once``: the request cannot be sent again (a streamed body): a connection handed over
        waits for the loop to poll once, so a FIN Triton sent right after its answer is seen
        (read in the next poll, not with the answer) before the body goes on a dying connection.
        A whole body needs no wait: it is sent again on a fresh connection if dropped unanswered."""
        idle = self._idle
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
        if self._open < self.max_connections:
            self._open += 1
            return await self._connect()
        loop = self._running_loop()
        if deadline <= loop.time():
            raise UpstreamTimeout("no free connection to Triton before the deadline")
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        waits = self._waits
        if waits is None or waits.loop is not loop:
            waits = self._waits = _ConnectionWaits(loop)
        waits.keep(waiter, deadline)  # past it, the waiter raises UpstreamTimeout
        try:
            handed = await waiter
        except asyncio.CancelledError:
            waits.pending.pop(waiter, None)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:  # handed over as it went
                given = waiter.result()
                if given is None:
                    self._slot_freed()  # its slot, to the next waiter
                else:
                    self._release(given)
            raise
        waits.pending.pop(waiter, None)
        if once and handed is not None:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                self._release(handed)
                raise
        if handed is None:  # a slot freed up: open a new connection in it
            return await self._connect()
        if handed.closed or handed.transport.is_closing():  # type: ignore[union-attr]
            return await self._acquire(deadline, fresh, once)  # Triton closed it as it answered: its slot comes back
        return handed

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this pool serves, asked for once (asyncio.get_running_loop makes a getpid()
        system call per call in 3.11; one loop owns a pool)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.tls),
                self.connect_timeout_s)
        except TimeoutError:
            self._slot_freed()
            raise UpstreamUnavailable(
                f"Triton did not accept a connection within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            self._slot_freed()
            raise UpstreamUnavailable(f"Triton is unreachable: {os_reason(exc)}") from exc
        except BaseException:
            self._slot_freed()
            raise
        conn.loop = loop
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closing:
            conn.close()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _discard(self, conn: _Connection) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        self._slot_freed()

    def _slot_freed(self) -> None:
        self._open -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._open += 1
                waiter.set_result(None)
                return

    @property
    def open_connections(self) -> int:
        return self._open

    async def aclose(self) -> None:
        self._closing = True
        deadlines, self._deadlines = self._deadlines, None
        if deadlines is not None:
            deadlines.close()
        waits, self._waits = self._waits, None
        if waits is not None:
            waits.close()
        # Their deadlines went with the timer: each is ended now, not left to wait for a place
        # that a closing pool would fill with a new connection or never.
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamUnavailable("the connection pool to Triton is closing"))
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        await asyncio.sleep(0)
