"""The HTTP port's front: uvicorn's httptools protocol, bounded against what one client can send.

Two changes that the hot path measured as worth it: writes made in one event-loop iteration go
out as one ``send()`` (``gateway.http_output``), and the proxy can register a callback for
"client connection lost" instead of running a watcher task per request to notice a client that
went away.

What one client can make the port hold or do is bounded, and every refusal is answered in
Triton's JSON error shape ``{"error": "..."}`` (uvicorn answers text/plain or nothing):

- **the head, while it is parsed**: a URL past ``max_url_bytes`` is answered 414, header lines
  past ``max_header_bytes`` together or ``max_header_count`` 431, as soon as the bytes that
  cross the bound arrive. httptools joins a header's pieces in memory until the line ends, so
  the raw bytes of a head are counted too and the parser is never fed past the bounds (one
  60 MB header line used to be read whole);
- **malformed requests** (a bad method, bad characters, a ``Transfer-Encoding`` other than
  chunked last): 400 with llhttp's reason. ``Transfer-Encoding: chunked`` with ``Content-Length``
  is served by the Transfer-Encoding alone, its Content-Length dropped, and the connection
  closes after the answer (RFC 9112 6.3), as Triton serves it;
- **time**: a request's headers must arrive within ``header_timeout_s``, counted from the
  connection's start or the request's first byte (slowloris); a body may pause at most
  ``body_idle_timeout_s`` between two pieces. Either answers 408;
- **connections**: past ``max_client_connections`` on the port, or past
  ``max_connections_per_client`` from one address, a connection is answered 503 with
  ``Retry-After`` and closed before its request reaches the application;
- **an answer the server cannot write** (a handler set a header value with a control
  character): the client gets a JSON 500 instead of a dropped connection.

An answer that ends a request early (the body unread) is followed by a lingering close: FIN,
then what the client still sends is read and dropped for ``linger_s`` (at most
64 MiB or ``max_body_bytes`` of it), so clients that send the whole body before reading (Python's
http.client, requests, tritonclient.http) read the answer instead of a connection reset.

No connection has a timer of its own for these bounds (nor for keep-alive, which uvicorn arms
per answer): the loop's one sweep (``gateway.sweep``) visits a connection when its earliest
bound may fall due, and a request only stamps the sweep's coarse clock on the connection. An
idle keep-alive connection costs one visit per ``keep_alive_timeout_s``. The head bounds cost a
comparison per read and per header line.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import types
import urllib.parse
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
from uvicorn._types import ASGIVersions
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.asgi import Dispatch
from gateway.client_address import PerAddress
from gateway.drain import DRAIN_GRACE_S, grace
from gateway.http_output import Arrival, CoalescingTransport, GatewayCycle, error_response
from gateway.proxy.http import CONNECTION_KEY
from gateway.settings import Settings
from gateway.sweep import Sweep

_IDLE, _HEADERS, _BODY = 0, 1, 2  # what the connection waits for from the client
# how a connection ends: normally; refused at a connection cap; no more requests read (a parse
# error while an answer is in flight); answered and lingering
_OPEN, _REFUSED, _STOPPED, _LINGERING = 0, 1, 2, 3
LINGER_BYTES = 64 << 20  # dropped at most while lingering (or max_body_bytes, if larger)
_HEAD_SLACK = 64  # the request line's method, version and line ends, and the blank line
# Every request's task has this name: asyncio names a task "Task-<n>" otherwise, a string
# formatted for each (Python 3.11 does it as the task is made, even if no one asks for it).
REQUEST_TASK = "gateway-request"


class _HeadRefused(Exception):
    """Raised inside a parser callback: the head crossed a bound (the parser stops there)."""

    def __init__(self, status: bytes, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"transfer-encoding" or name == b"content-length" and value != b"0" for name, value in headers)


def _direct(handler: Callable[..., Any]) -> Callable[..., Any]:
    """An object whose class defines ``__call__`` in Python, as that bound method: calling the object
    takes Python 3.11's slower way (a look-up and an argument tuple, ~1,000 CPU instructions more)."""
    call = inspect.getattr_static(type(handler), "__call__", None)
    return types.MethodType(call, handler) if isinstance(call, types.FunctionType) else handler


class GatewayHttpProtocol(HttpToolsProtocol):
    cycle: GatewayCycle  # uvicorn's attribute, always ours here (on_headers_complete)
    on_lost: Callable[[], None] | None = None  # set by the proxy while a request is in flight
    # the bounds: protocol_for(settings) sets them
    header_timeout_s: ClassVar[float] = 10.0
    body_idle_timeout_s: ClassVar[float] = 10.0
    header_ticks: ClassVar[int] = Sweep.ticks(10.0)  # the bounds in the sweep's ticks
    body_ticks: ClassVar[int] = Sweep.ticks(10.0)
    keep_alive_ticks: ClassVar[int] = Sweep.ticks(75.0)
    max_connections: ClassVar[int] = 16384
    max_per_client: ClassVar[int] = 4096
    max_url_bytes: ClassVar[int] = 4000
    max_header_bytes: ClassVar[int] = 64 << 10
    max_header_count: ClassVar[int] = 100
    linger_s: ClassVar[float] = 2.0
    linger_bytes: ClassVar[int] = 64 << 20
    drain_grace_s: ClassVar[float] = DRAIN_GRACE_S
    per_client: ClassVar[PerAddress] = PerAddress()  # open connections per client address (one per gateway)
    _phase = _IDLE
    _timer: asyncio.TimerHandle | None = None  # a refusal's answer, a lingering close's end
    sweep_due = 0  # the sweep's tick this connection is filed under (gateway.sweep)
    _since = 0  # the tick the current wait began: the connection or a request's head, or keep-alive idle
    _seen = 0  # the tick bytes last came in
    _ending = _OPEN
    _address: str | None = None  # counted in per_client under this address
    _head_bytes = 0  # raw bytes of the head being read (from the end of the previous one)
    _header_bytes = 0
    _header_count = 0
    _refusal: _HeadRefused | None = None
    _lingered = 0
    _reason = ""  # why a connection at a cap is refused
    _forwarded = False  # the request carries X-Forwarded-* (uvicorn's proxy-headers middleware may act)
    _framing = 0  # which of Content-Length (1) and Transfer-Encoding (2, 4: ending in chunked) the head has
    _inference: Callable[..., Any] | None = None  # the data-plane handler, served without the app's wrappers
    task: asyncio.Task[None] | None = None  # the task serving the current request
    # the bounds as each connection's own (connection_made)
    _head_room = _url_room = _header_lines = _header_room = _header_ticks = _body_ticks = _keep_alive_ticks = 0
    _fresh_context = False  # each request's task runs in a new contextvars.Context (uvicorn's reset_contextvars)
    _task_factory: Any = None  # the loop's (none: the gateway sets none), asked once per connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Transfer-Encoding with Content-Length: read by the Transfer-Encoding (RFC 9112 6.3);
        # llhttp's default refuses it, while Triton serves it (NVIDIA's own HTTP QA sends it)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._sweep = Sweep.of(self.loop)
        # The bounds each request reads, as the connection's own attributes: Python 3.11 reads an
        # instance's own attribute with a specialized instruction, one of its class with a full
        # look-up each time (~10 per request)
        self._ending = _OPEN
        self._head_room = self.max_url_bytes + self.max_header_bytes + _HEAD_SLACK
        self._url_room, self._header_lines, self._header_room = (
            self.max_url_bytes, self.max_header_count, self.max_header_bytes)
        self._header_ticks, self._body_ticks, self._keep_alive_ticks = (
            self.header_ticks, self.body_ticks, self.keep_alive_ticks)
        self._fresh_context = getattr(self.config, "reset_contextvars", False)  # uvicorn's option, once per connection
        # every request's scope["asgi"] (read only): one per connection instead of one per request
        self._asgi: ASGIVersions = {"version": self.asgi_version, "spec_version": "2.3"}
        self._task_factory = self.loop.get_task_factory()
        self._raw = transport
        self._out = CoalescingTransport(transport, self.loop, self.closing)
        super().connection_made(self._out)
        app = self.app
        if isinstance(app, ProxyHeadersMiddleware):
            app = app.app
        if isinstance(app, Dispatch):
            self._inference = _direct(app.proxy)
        if len(self.connections) > self.max_connections:
            self._refuse_later(f"the gateway has {self.max_connections} client connections open "
                               "(max_client_connections): retry shortly")
            return
        address = self.client[0] if self.client else ""
        if not self.per_client.admit(address, self.max_per_client):
            self._refuse_later(f"this client address has {self.max_per_client} connections open "
                               "(max_connections_per_client): retry shortly")
            return
        self._address = address
        self._phase = _HEADERS
        self._since = self._seen = self._sweep.tick
        self._sweep.at(self, self.header_ticks)

    def _refuse_later(self, reason: str) -> None:
        """Answered once its request arrives (or within a second): a client that gets its answer
        before it has sent anything may read a reset instead."""
        self._ending = _REFUSED
        self._reason = reason
        self._timer = self.loop.call_later(min(self.header_timeout_s, 1.0), self._refuse)

    def data_received(self, data: bytes) -> None:
        if self._ending:
            if self._ending == _REFUSED:
                self._refuse()
            else:  # lingering, or no more requests read: what the client still sends is dropped
                self._lingered += len(data)
                if self._lingered > self.linger_bytes:
                    self._raw.close()
            return
        self._seen = self._sweep.tick
        if self._phase != _BODY:  # a head: never fed to the parser past its bounds
            room = self._head_room - self._head_bytes
            if len(data) > room:
                self._feed_past_bound(data, max(room, 0))
                return
            self._head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol to upgrade to here (uvicorn runs with ws="none"): Upgrade is not honoured
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            if refusal is not None:
                self._answer_and_close(error_response(refusal.status, refusal.message))
            else:
                self._malformed(str(exc))

    def _feed_past_bound(self, data: bytes, room: int) -> None:
        """More head bytes than the bounds allow arrived: parse up to the bound only."""
        self._head_bytes += room
        self._feed(data[:room])
        if self._ending:
            return
        if self._phase != _BODY:  # still no end of the head; the URL was checked piece by piece (on_url)
            self._answer_and_close(error_response(*self._headers_too_large()))
            return
        self.data_received(data[room:])  # the head ended within the bound: the rest is its body

    def _url_too_long(self) -> tuple[bytes, str]:
        return b"414 URI Too Long", f"request URL over {self.max_url_bytes} bytes (max_url_bytes)"

    def _headers_too_large(self) -> tuple[bytes, str]:
        return (b"431 Request Header Fields Too Large",
                f"request header lines over {self.max_header_bytes} bytes together (max_header_bytes)")

    def _malformed(self, reason: str) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._phase != _BODY or cycle.response_started or self.pipeline:
                cycle.keep_alive = False  # answering now would cut into an answer on its way: after it, close
                self._ending = _STOPPED
                return
            cycle.disconnected = True  # this request's own body is malformed: its handler stops reading
            cycle.message_event.set()
        self._answer_and_close(error_response(b"400 Bad Request", f"malformed HTTP request: {reason}"))

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._phase == _IDLE:  # a request after another: its head is due within header_timeout_s of its first byte
            sweep = self._sweep
            self._since = sweep.tick  # (a connection's first is due within it of the connection's start)
            if self.sweep_due - sweep.tick > self._header_ticks:  # filed for a later bound (keep-alive): sooner
                sweep.at(self, self._header_ticks)
        self._phase = _HEADERS
        self._header_bytes = self._header_count = 0
        self._forwarded = False
        self._framing = 0
        # uvicorn's, inline (a call less per request)
        self.url = b""
        self.expect_100_continue = False
        headers: list[tuple[bytes, bytes]] = []
        self.headers = headers
        self.scope = {
            "type": "http", "asgi": self._asgi, "http_version": "1.1",
            "server": self.server, "client": self.client, "root_path": self.root_path, "headers": headers,
            "scheme": self.scheme, "state": self.app_state.copy()}  # type: ignore[typeddict-item]

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self._url_room:
            self._refusal = _HeadRefused(*self._url_too_long())
            raise self._refusal

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # ": " and the line end
        if self._header_count > self._header_lines:
            self._refusal = _HeadRefused(b"431 Request Header Fields Too Large", (
                f"more than {self.max_header_count} request header lines (max_header_count)"))
            raise self._refusal
        if self._header_bytes > self._header_room:
            self._refusal = _HeadRefused(*self._headers_too_large())
            raise self._refusal
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which RFC 9110 5.5 excludes
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name.startswith(b"x-forwarded-"):
            self._forwarded = True
        elif name == b"content-length":
            self._framing |= 1
        elif name == b"transfer-encoding":  # 4: its last coding is chunked (the last line's, as llhttp reads it)
            chunked = value.rpartition(b",")[2].strip().lower() == b"chunked"
            self._framing = self._framing | 6 if chunked else (self._framing | 2) & ~4
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._head_bytes = 0
        if self.sweep_due - self._sweep.tick > self._body_ticks:
            self._sweep.at(self, self._body_ticks)
        parser = self.parser
        upgrade = parser.should_upgrade()
        if upgrade and _has_body(self.headers):
            # httptools hands whatever follows an Upgrade request's headers to the new protocol,
            # so the application would see an empty body: say so instead of forwarding nothing.
            self._answer_and_close(error_response(b"400 Bad Request", (
                "a request with a body cannot carry Upgrade on this port (no HTTP/2 upgrade, h2c, here): "
                "send it without the Upgrade and Connection: upgrade headers")))
            return
        both = self._framing & 3 == 3
        if both and not self._framing & 4:  # llhttp, told to read such a body, would read it to the connection's end
            self._answer_and_close(error_response(b"400 Bad Request",
                                                  "malformed HTTP request: Request has invalid `Transfer-Encoding`"))
            return
        if both:  # the body is the chunked one: its Content-Length goes (RFC 9112 6.3), and so does the connection
            self.headers[:] = [(name, value) for name, value in self.headers if name != b"content-length"]
        scope = self.scope
        http_version = parser.get_http_version()
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        url = self.url
        # origin-form, no query: the path as sent. Searched with find: ``b"?" in url`` first tries the
        # needle as an integer, building and dropping a TypeError with its message (~1,500 instructions)
        if url[:1] == b"/" and url.find(b"?") < 0 and url.find(b"#") < 0:
            raw_path, query = url, b""
        else:
            parsed_url = httptools.parse_url(url)
            raw_path, query = parsed_url.path, parsed_url.query or b""
        path = raw_path.decode("ascii")
        scope["path"] = urllib.parse.unquote(path) if "%" in path else path
        scope["raw_path"] = raw_path
        scope["query_string"] = query
        scope[CONNECTION_KEY] = self  # type: ignore[literal-required]
        existing = self.cycle
        self.cycle = GatewayCycle(
            scope, self.transport, self.flow, self.logger, self.access_logger, self.access_log,  # type: ignore[arg-type]
            self.server_state.default_headers, Arrival(), self.expect_100_continue,
            http_version != "1.0" and parser.should_keep_alive() and not both, self.on_response_complete)
        # Inference goes straight to the data-plane handler: what the app's wrappers (uvicorn's
        # proxy-headers middleware, the /v2 dispatch) would do to it is nothing, unless it carries
        # X-Forwarded-* headers (then the middleware may name another client).
        app = self._inference if self._inference is not None and path.startswith("/v2") and not self._forwarded \
            else self.app
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:  # pipelined: queued until the previous answer is out
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """uvicorn's, and the task is kept: the proxy cancels it when the client leaves (asking
        asyncio.current_task() costs a Python call per request in 3.11). A pipelined request's task
        starts only once the previous answer is out, so ``task`` is always the request being served."""
        context = contextvars.Context() if self._fresh_context else None
        if self._task_factory is None:  # the loop's create_task, less its argument parsing and a per-task name
            task = self.task = asyncio.Task(cycle.run_asgi(app), loop=self.loop, name=REQUEST_TASK, context=context)
        else:
            task = self.task = self.loop.create_task(cycle.run_asgi(app), context=context)
        # the server's set of requests in progress (what a drain waits for): the task leaves it as its
        # handler ends (GatewayCycle.run_asgi), where a done callback cost a loop turn per request
        cycle.task, cycle.tasks = task, self.tasks
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        """uvicorn's, but the piece is kept as httptools handed it (``GatewayCycle.pieces``), not
        appended to a bytearray that ``receive`` copies again: a body is copied once, when read whole
        (a large one into its own buffer as it comes: ``GatewayCycle.keep``)."""
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        if cycle.charge is not None:  # the handler reads the rest whole (GatewayCycle.rest_of_body): no pause, no wake
            try:
                cycle.keep(body)
            except Exception as refused:  # over a byte bound: its handler answers why; nothing more is read
                cycle.charge = None
                cycle.refusal = refused
                self.flow.pause_reading()
                cycle.message_event.set()
            return
        cycle.pieces.append(body)
        cycle.pending += len(body)
        if cycle.pending > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        if self._ending:
            return
        cycle = self.cycle  # uvicorn's, inline (a call less per request)
        if cycle.response_complete or self.parser.should_upgrade() and self._should_upgrade():
            return
        cycle.more_body = False
        cycle.message_event.set()

    def on_response_complete(self) -> None:
        """uvicorn's, but keep-alive is a bound the sweep checks: no timer armed per answer."""
        self.server_state.total_requests += 1
        if self._raw.is_closing():  # (what the coalescing transport would ask, a call less)
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        sweep = self._sweep
        self._since = sweep.tick  # idle from now: closed after keep_alive_timeout_s without a request
        if self.sweep_due - sweep.tick > self._keep_alive_ticks:
            sweep.at(self, self._keep_alive_ticks)

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn logs two warnings per such request, inline: a client could flood the log. The
        Upgrade header is simply not honoured (nor forwarded)."""

    # -- the end of a connection ----------------------------------------------------------------
    def connection_lost(self, exc: Exception | None) -> None:
        callback, self.on_lost = self.on_lost, None
        if self.sweep_due:
            self._sweep.cancel(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        address, self._address = self._address, None
        if address is not None:
            self.per_client.leave(address)
        super().connection_lost(exc)
        if callback is not None:
            callback()

    def shutdown(self) -> None:
        """The server drains. A request in progress is its connection's last (uvicorn's). A
        connection waiting for a request, new or kept alive, gets ``drain_grace_s`` for it: its
        client may be sending it now (closing would fail it). That request is answered with
        ``connection: close``; a connection still idle after the grace closes."""
        if self._ending or self.cycle is not None and not self.cycle.response_complete:
            super().shutdown()
            return
        self._start_asgi_task = self._start_last_task  # type: ignore[method-assign]  # drain time, not per request
        self.loop.call_later(self.drain_grace_s, super().shutdown)

    def _start_last_task(self, cycle: Any, app: Any) -> None:
        cycle.keep_alive = False
        GatewayHttpProtocol._start_asgi_task(self, cycle, app)

    def closing(self) -> None:
        """The server closes the connection (uvicorn, after an answer with ``connection: close``,
        or our own bounds). A client still sending its request gets the lingering close."""
        if self._ending == _LINGERING or self._raw.is_closing():
            return
        if self._ending == _STOPPED or self._phase == _BODY or self._phase == _HEADERS and self._head_bytes:
            self._linger()
        else:
            self._raw.close()

    def swept(self) -> None:
        """The sweep's visit (``gateway.sweep``): the bound of what the connection waits for,
        against the coarse clock; filed again for it when it is still ahead."""
        if self._ending or self._raw.is_closing():
            return
        sweep, phase, cycle = self._sweep, self._phase, self.cycle
        now = sweep.tick
        if self.flow.read_paused:  # we stopped reading (the application is busy, pipelining): not the client
            sweep.at(self, self.body_ticks)
            return
        if phase == _BODY:
            due = self._seen + self.body_ticks
            if now >= due:
                if cycle is not None and not cycle.response_started:
                    self._answer_and_close(error_response(b"408 Request Timeout", (
                        f"request body stalled: no data for {self.body_idle_timeout_s:g}s (body_idle_timeout_s)")))
                else:
                    self._raw.close()
                return
        elif phase == _HEADERS:
            due = self._since + self.header_ticks
            if now >= due:
                if cycle is None or cycle.response_complete:
                    self._answer_and_close(error_response(b"408 Request Timeout", (
                        f"request headers not received within {self.header_timeout_s:g}s (header_timeout_s)")))
                else:
                    self._raw.close()
                return
        elif cycle is not None and not cycle.response_complete:  # answering: not idle, looked at again later
            due = now + self.keep_alive_ticks
        else:  # kept alive between requests
            due = self._since + self.keep_alive_ticks
            if now >= due:
                self.transport.close()
                return
        sweep.at(self, due - now)

    def _refuse(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._answer_and_close(error_response(b"503 Service Unavailable", self._reason, b"retry-after: 1\r\n"))

    def _answer_and_close(self, answer: bytes) -> None:
        """Answer, then close gently (see :meth:`_linger`)."""
        if self._raw.is_closing():
            return
        self.transport.write(answer)
        self._linger()

    def _linger(self) -> None:
        """Closing with the client's bytes still unread would send a reset, and the client would
        lose the answer. So: send FIN, drop what still comes, close after ``linger_s`` or
        ``linger_bytes`` (nginx's lingering_close). Over TLS there is no half-close: the same
        without the FIN."""
        raw = self._raw
        self._ending = _LINGERING
        self._out.shut()  # what was written before goes out; nothing after
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # its handler stops: no client to answer now
            cycle.disconnected = True
            cycle.message_event.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.linger_s <= 0:
            raw.close()
            return
        if raw.can_write_eof():
            raw.write_eof()
        raw.resume_reading()  # flow control may have paused it while a body was buffered
        self._timer = self.loop.call_later(self.linger_s, raw.close)


def protocol_for(settings: Settings) -> type[GatewayHttpProtocol]:
    """The protocol class with this gateway's bounds (uvicorn instantiates it per connection)."""

    class BoundedHttpProtocol(GatewayHttpProtocol):
        header_timeout_s = settings.header_timeout_s
        body_idle_timeout_s = settings.body_idle_timeout_s
        header_ticks = Sweep.ticks(settings.header_timeout_s)
        body_ticks = Sweep.ticks(settings.body_idle_timeout_s)
        keep_alive_ticks = Sweep.ticks(settings.keep_alive_timeout_s)
        max_connections = settings.max_client_connections
        max_per_client = settings.max_connections_per_client
        max_url_bytes = settings.max_url_bytes
        max_header_bytes = settings.max_header_bytes
        max_header_count = settings.max_header_count
        linger_s = settings.linger_s
        linger_bytes = max(settings.max_body_bytes, LINGER_BYTES)
        drain_grace_s = grace(settings.drain_timeout_s)
        per_client: ClassVar[PerAddress] = PerAddress()

    return BoundedHttpProtocol
