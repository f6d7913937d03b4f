"""What the HTTP port writes: the client transport that joins one loop iteration's writes into
one ``send()`` (``gateway.batched_transport``; uvicorn writes the status line + headers and
the body separately) and leaves the close to the front, the request/response cycle that
turns an answer uvicorn cannot write into a JSON 500, and the front's own whole answers in
Triton's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle

from gateway.batched_transport import JOIN_BELOW, BatchedTransport
from gateway.drain import cut_by_drain


class CoalescingTransport(BatchedTransport):
    """The client transport, writes joined per loop iteration (``BatchedTransport``), but a close
    is the front's to decide: at once, or a lingering close while the client still sends its request."""

    __slots__ = ("_on_close",)

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 on_close: Callable[[], None]) -> None:
        super().__init__(transport, loop)
        self._on_close = on_close

    def close(self) -> None:
        self.flush()
        self._on_close()


class Arrival:
    """``asyncio.Event``'s ``set``/``clear``/``wait`` for one request's cycle (uvicorn's
    ``message_event``: the body arrived, the client left, the answer is out), with less work:
    one request makes one, sets it about three times and waits on it at most a few times, and
    has one waiter at most (its handler's task). No future is made unless it waits unset."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[bool] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        waiter = self._waiter
        if waiter is None or waiter.done():  # a waiter cancelled before leaves a done future
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        return await waiter


FILL_FROM = 1 << 20  # a request body announced at this size or more is copied into a buffer of its own ...
FILL_AFTER = 256 << 10  # ... once this much of it came (GatewayCycle.rest_of_body)


# Header lines found writable by uvicorn's checks (its two regular expressions, ~1.7 µs an answer
# run on each), each with its line as written (the name in lower case): the same lines come back
# with every answer (Triton's content type, the routing headers of each version, the server's date
# of this second), so each distinct one is checked and written out once. Bounded: full, it starts
# again empty. A content-length of digits is writable without a look-up (GatewayCycle.answer).
_WRITABLE: dict[tuple[bytes, bytes], bytes] = {}
WRITABLE_KEPT = 1024


def _writable(name: bytes, value: bytes) -> bool:
    """uvicorn's checks of a header line it writes (lower case changes none of the bytes refused)."""
    if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
        return False
    _keep((name, value))
    return True


def _keep(header: tuple[bytes, bytes]) -> bytes:
    """A writable header's line, kept for the next answers."""
    if len(_WRITABLE) >= WRITABLE_KEPT:
        _WRITABLE.clear()
    line = _WRITABLE[header] = b"".join((header[0].lower(), b": ", header[1], b"\r\n"))
    return line


def _answered() -> None:
    """What ``on_response`` is once the request's handler is done (uvicorn leaves a no-op there)."""


def error_response(status: bytes, message: str, *extra: bytes) -> bytes:
    """A whole HTTP/1.1 answer in Triton's error shape, closing the connection."""
    body = json.dumps({"error": message}).encode()
    return b"".join([b"HTTP/1.1 ", status, b"\r\ncontent-type: application/json\r\ncontent-length: ",
                     str(len(body)).encode(), b"\r\n", *extra, b"connection: close\r\n\r\n", body])


class GatewayCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, but an answer it cannot write becomes a JSON 500."""

    transport: BatchedTransport  # the front's CoalescingTransport (GatewayHttpProtocol.connection_made)
    message_event: Arrival  # type: ignore[assignment]  # asyncio.Event's calls, lighter
    cut_by_drain = False  # drain_timeout_s ended while this request ran: its handler is cancelled
    # uvicorn's state, as its __init__ starts it: read from the class until a request changes it
    # (what every request reads is set in __init__: a class attribute read through the instance is
    # a full look-up each time in Python 3.11, an instance's own a specialized instruction)
    chunked_encoding: bool | None = None
    expected_content_length = 0
    refusal: BaseException | None = None  # what ``charge`` raised for a piece: rest_of_body raises it
    fill_size = 0  # the announced size of a large body rest_of_body collects (0: its pieces are joined)
    gathered = 0  # the body's bytes kept in ``pieces`` while it is collected
    filling: bytearray | None = None  # a large body's own buffer, of its announced size, as its bytes come
    # a view of it, copied into: a bytearray's own slice assignment copies bytes into a temporary first
    filling_view: memoryview | None = None
    filled = 0  # bytes of it copied in
    task: asyncio.Task[None] | None = None  # the task running the handler, in the server's set ``tasks``
    tasks: set[asyncio.Task[None]] | None = None

    def __init__(self, scope: Any, transport: BatchedTransport, flow: FlowControl, logger: logging.Logger,
                 access_logger: logging.Logger, access_log: bool, default_headers: list[tuple[bytes, bytes]],
                 message_event: Arrival, expect_100_continue: bool, keep_alive: bool,
                 on_response: Callable[..., None]) -> None:
        """uvicorn's, positional and without its body buffer (``pieces`` instead): one cycle per
        request, and its keyword arguments, passed on through ``super().__init__``, cost two dicts."""
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.logger = logger
        self.access_logger = access_logger
        self.access_log = access_log
        self.default_headers = default_headers
        self.message_event = message_event
        self.on_response = on_response
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.pieces: list[bytes] = []  # the body's pieces not yet received (GatewayHttpProtocol.on_body)
        self.pending = 0  # their bytes
        self.disconnected = False
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.replaced = False  # the handler's answer could not be written: the JSON 500 went instead
        self.charge: Callable[[int], None] | None = None  # set while rest_of_body collects (on_body calls keep)

    async def run_asgi(self, app: Any) -> None:
        """uvicorn's, but the callback it leaves behind is a function, not a new lambda per request."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        else:
            if result is not None:
                self.logger.error("ASGI callable should return None, but returned '%s'.", result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                self.logger.error("ASGI callable returned without starting response.")
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                self.logger.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = _answered
            tasks = self.tasks
            if tasks is not None:  # (one cancelled before it ran stays: only the drain cancels so, and waits no more)
                tasks.discard(self.task)

    async def receive(self) -> Any:
        """uvicorn's, but the body's pieces are handed on as they came: one piece as it is, several
        joined once (uvicorn appended each to a bytearray and copied that again into bytes; with the
        whole-body join after it, an 8 MB body was copied three times)."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            flow = self.flow
            if flow.read_paused:  # (uvicorn's call to find it was not, per request)
                flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        pieces = self.pieces
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.pending = 0
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    def whole_body(self) -> bytes | None:
        """The request's body when all of it is in already (an inference request's usually came
        with its head, in one read), taken as :meth:`receive` would hand it, without a coroutine,
        a message dict or a wait; None: not yet (or the client left), :meth:`receive` it."""
        if self.more_body or self.disconnected or self.response_complete or self.waiting_for_100_continue:
            return None
        flow = self.flow
        if flow.read_paused:  # as receive() does: the body is the handler's now, the next request may come
            flow.resume_reading()
        self.message_event.clear()
        pieces = self.pieces
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.pending = 0
        return body

    async def rest_of_body(self, first: bytes, charge: Callable[[int], None],
                           announced: int | None) -> bytes | bytearray | None:
        """The whole request body, ``first`` being what was received of it (and charged) already,
        once all of it is in (None: the client went away first). Each piece is passed to ``charge``
        (its size) as it arrives, before it is kept: ``charge`` counts it against the byte bounds and
        raises to refuse it, and the refusal is raised here. Since every byte held is charged,
        reading is not paused on the way, and the handler's task wakes once for the whole body:
        reading by ``receive()`` paused and resumed the socket and woke the task every 64 KB
        (uvicorn's high-water mark), 128 times for an 8 MB body, and joined the pieces of each wake.

        A body ``announced`` (Content-Length) of FILL_FROM or more is copied, once FILL_AFTER
        bytes of it came, into a buffer of its own of exactly that size (the rest charged then), and
        so is every piece after it as it comes (:meth:`keep`): the reads are let go at once instead
        of being held until a join copies them whole. Held reads then the join of them left two
        copies of the body in memory at its end, and a heap fragmented by the reads (an 8 MB body's
        peak RSS 1.4-1.7x the bytes in flight); the gRPC port's messages fill a buffer the same way.
        A smaller body, or a chunked one, is joined once when whole."""
        if self.disconnected or self.response_complete:
            return None
        pieces, self.pieces = self.pieces, [first] if first else []
        self.pending = 0
        self.gathered = len(first)
        self.fill_size = announced if announced is not None and announced >= FILL_FROM else 0
        self.charge = charge
        try:
            for piece in pieces:  # what came after ``first`` was received
                self.keep(piece)
            if self.more_body:
                self.flow.resume_reading()
                while self.more_body and not self.disconnected and self.refusal is None:
                    await self.message_event.wait()
                    self.message_event.clear()
        finally:
            self.charge = None
            pieces, self.pieces, filling, self.filling = self.pieces, [], self.filling, None
            if self.filling_view is not None:
                self.filling_view.release()  # the buffer is the body's alone from here
                self.filling_view = None
            self.gathered = self.fill_size = 0
        refusal, self.refusal = self.refusal, None
        if refusal is not None:  # given back to the budget by the caller: not kept either
            raise refusal
        if self.disconnected:
            return None
        if filling is not None:
            return filling
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def keep(self, piece: bytes) -> None:
        """A piece of the body rest_of_body collects (``GatewayHttpProtocol.on_body``): copied into the
        body's buffer if it has one, else charged (``charge`` raises to refuse it) and kept as it is."""
        view = self.filling_view
        if view is not None:  # charged whole when it was made
            at = self.filled
            view[at:at + len(piece)] = piece
            self.filled = at + len(piece)
            return
        self.charge(len(piece))  # type: ignore[misc]  # set while rest_of_body collects
        self.pieces.append(piece)
        self.gathered += len(piece)
        if self.fill_size and self.gathered >= FILL_AFTER:
            self._fill()

    def _fill(self) -> None:
        """The large body's buffer, of its announced size: the rest of it charged now (raises if it
        does not fit), the pieces kept so far copied in and let go. Made once FILL_AFTER bytes came,
        never for a size only announced (a head alone buys no buffer)."""
        size, gathered = self.fill_size, self.gathered
        self.charge(size - gathered)  # type: ignore[misc]
        buffer = bytearray(size)
        view = memoryview(buffer)
        at = 0
        for piece in self.pieces:
            view[at:at + len(piece)] = piece
            at += len(piece)
        self.pieces = []
        self.gathered = 0
        self.filling, self.filling_view, self.filled = buffer, view, at

    async def send(self, message: Any) -> None:
        if self.replaced:
            return  # the rest of the answer that could not be written
        try:
            await RequestResponseCycle.send(self, message)
        except (RuntimeError, ValueError) as exc:
            if message["type"] != "http.response.start" or not self.response_started:
                raise
            # uvicorn checks every header before it writes any: nothing of this answer went out
            self.response_started, self.chunked_encoding, self.expected_content_length = False, None, 0
            self.keep_alive, self.replaced = False, True
            await self._json_answer(500, f"the gateway could not write the answer ({exc}): nothing was sent")

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer (``headers`` carry its content-length) in one write, at once: what the
        two ASGI messages ``http.response.start`` + ``http.response.body`` do, without building
        them, without uvicorn's regular expressions on a header line already found writable
        (``_WRITABLE``) and without waiting for the loop's next turn to join the two writes. An
        answer uvicorn would refuse to write takes the ASGI way (a JSON 500)."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_started or self.replaced or self.access_log:  # uvicorn's own access log: its way
            await self.send({"type": "http.response.start", "status": status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})
            return
        parts = [STATUS_LINE[status]]
        lines = _WRITABLE
        for header in self.default_headers:  # the server's own (its date): written as uvicorn writes them, unchecked
            line = lines.get(header)
            parts.append(line if line is not None else _keep(header))
        for header in headers:
            line = lines.get(header)
            if line is None:
                name, value = header
                if value.isdigit() and name == b"content-length":  # (not kept: each answer's size)
                    line = b"content-length: " + value + b"\r\n"
                elif _writable(name, value):
                    line = lines[header]
                else:
                    await self.send({"type": "http.response.start", "status": status, "headers": headers})
                    await self.send({"type": "http.response.body", "body": body})
                    return
            parts.append(line)
        self.response_started = True
        self.waiting_for_100_continue = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if len(body) < JOIN_BELOW:
            if self.scope["method"] != "HEAD":
                parts.append(body)
            self.transport.write_now(b"".join(parts))  # the whole answer: no wait for the loop's next turn
        elif self.scope["method"] != "HEAD":  # a large body goes out as it is after its head (one writev), never
            self.transport.write_now(b"".join(parts), body)  # copied into one with it (an 8 MB answer was, whole)
        else:
            self.transport.write_now(b"".join(parts))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    async def send_500_response(self) -> None:
        if self.cut_by_drain:
            await self._json_answer(503, cut_by_drain("request"))
            return
        await self._json_answer(500, "the gateway failed while answering this request")

    async def _json_answer(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        await RequestResponseCycle.send(self, {"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await RequestResponseCycle.send(self, {"type": "http.response.body", "body": body})
