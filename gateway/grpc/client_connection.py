"""The client end of one HTTP/2 connection to Triton, carrying gRPC calls.

gRPC on top of the plain HTTP/2 layer: ``gateway.http2.endpoint`` does RFC 9113 (frames,
HPACK, flow control, stream states); this adds the calls, gRPC's message framing and its
status codes, so ``gateway.http2`` imports nothing of gRPC (``tests/unit/test_architecture.py``).

A unary call is one stream whose request goes out in a single ``write()`` (HEADERS + DATA)
when the windows allow, and whose reply is collected into ``(grpc status, message, response
bytes)`` (``grpc.reply``). A streaming call (``open``) hands every frame of the reply to a
``StreamListener`` as it arrives, and takes request messages one by one. GOAWAY, RST_STREAM
and a lost connection end the affected calls with ``UNAVAILABLE`` (or ``CANCELLED``) the way
grpcio does.

Triton may send a call ``STREAM_WINDOW`` ahead, given back on receipt at half of it. A
streaming call whose replies wait for its caller's client is held (``hold``: no credit) until
they go out (``release``): Triton waits, instead of the gateway queueing what a client that
does not read would never take (8 streams of tokens once grew it by ~9.5 MB a second). A unary
reply past half the window is a large one: its window opens to ``UNARY_WINDOW`` once.

A hung server (stopped, or lost without a reset: node death, a blackholed address) is found
by one timer per connection, never per call: every ``keepalive_s`` a keepalive ping goes out,
idle or busy, and one unanswered ``keepalive_timeout_s`` later drops the connection, failing its
calls with ``UNAVAILABLE`` (``LOST``: the fleet counts it toward the server's ejection). The
ping is an empty SETTINGS frame, which the peer must acknowledge at once (RFC 9113 §6.5.3),
not a PING frame: Triton's gRPC server (grpc core, default policy) counts a PING received
while it has sent nothing for 5 minutes as a strike and closes the connection with GOAWAY
``too_many_pings`` at the third, so PINGs every 10 s would cut every idle connection and every
quiet stream after ~30 s (seen against the real Triton). The same tick ends unary calls whose
deadline passed with no answer (a live Triton answers ``DEADLINE_EXCEEDED`` itself first: it
is told the deadline in ``grpc-timeout``).

Every status this module makes up itself starts with ``gateway: `` and names no address;
the prefixes below are how the fleet tells a call never sent from a connection that broke.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Protocol

from gateway.errors import OWN_ANSWER
from gateway.grpc.reply import Reply, status_of, unary_reply
from gateway.grpc.status import StatusCode
from gateway.grpc.wire import Message, grpc_parts
from gateway.http2.endpoint import (
    CANCEL,
    PREFACE,
    REFUSED_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Endpoint,
    Headers,
    StreamState,
    frame,
    open_windows,
    settings_frame,
)

CANCELLED, INTERNAL, UNAVAILABLE = StatusCode.CANCELLED, StatusCode.INTERNAL, StatusCode.UNAVAILABLE
DEADLINE_EXCEEDED = StatusCode.DEADLINE_EXCEEDED
# The beginnings of the gateway's own UNAVAILABLE details: nothing reached Triton ...
NOT_CONNECTED = OWN_ANSWER + "cannot connect to Triton"
GOING_AWAY = OWN_ANSWER + "Triton is going away"
# ... or the connection broke under the call (Triton may have run it: never re-sent).
LOST = OWN_ANSWER + "lost the connection to Triton"
_DEADLINE_GRACE_S = 0.5  # past a call's deadline before it is ended here: Triton's own answer comes first
# SETTINGS_INITIAL_WINDOW_SIZE: about what one held stream may park in the gateway (see above)
STREAM_WINDOW = 64 << 10
UNARY_WINDOW = 16 << 20  # a large unary reply's window: its throughput as before (16 MiB for every call)


class StreamListener(Protocol):
    def on_headers(self, headers: Headers) -> None: ...
    def on_data(self, payload: bytes | memoryview) -> None: ...  # a view of what was read, valid while referenced
    def on_close(self, code: int, details: str) -> None: ...
    def on_drained(self) -> None: ...  # part or all of the call's send queue went out (see ``backlog``)


class Slot(Protocol):
    """An admission slot a unary call holds (``fleet.members.Admitted``): given back once."""

    def release(self) -> None: ...


class _Call(StreamState):
    __slots__ = ("future", "headers", "trailers", "chunks", "listener", "deadline", "slot", "requests_ended", "wide")

    def __init__(self, stream_id: int, window: int, future: asyncio.Future[Reply] | None,
                 listener: StreamListener | None = None) -> None:
        super().__init__(stream_id, window)
        self.slot: Slot | None = None  # given back as the call ends here, before its caller runs again
        self.deadline = 0.0  # loop.time() after which the tick ends the call; 0.0: none
        self.future = future
        self.listener = listener
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.chunks: deque[memoryview] = deque()
        self.requests_ended = False  # END_STREAM sent (or queued behind the requests)
        self.wide = False  # a unary call's window opened to UNARY_WINDOW


class Http2Connection(Endpoint):
    def __init__(self, on_close: asyncio.Future[None], keepalive_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0) -> None:
        super().__init__()
        self.on_close = on_close
        self._next_id = 1
        self._waiters: list[asyncio.Future[None]] = []
        self.keepalive_s = keepalive_s  # 0: no keepalive pings (deadlines are still enforced)
        self.keepalive_timeout_s = keepalive_timeout_s
        self._tick_s = min(1.0, *(t for t in (keepalive_s, keepalive_timeout_s) if t > 0))
        self._timer: asyncio.TimerHandle | None = None
        self._last_ping = 0.0  # loop.time() the last keepalive ping went out
        self._ping_due = 0.0  # its ACK is due by then; 0.0: none outstanding
        self._settings_sent = self._settings_acked = 0  # SETTINGS ACKs come in order: count them
        self._ping_number = 0  # the SETTINGS frame whose ACK answers the outstanding ping

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.attach(transport)
        self.write(PREFACE + settings_frame(enable_push=0, initial_window=STREAM_WINDOW, max_frame=1 << 20)
                   + open_windows())
        self._settings_sent = 1
        loop = asyncio.get_running_loop()
        self._last_ping = loop.time()
        self._timer = loop.call_later(self._tick_s, self._tick)

    # -- keepalive and deadlines: one timer per connection ------------------------------------
    def _tick(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        now = asyncio.get_running_loop().time()
        if self._ping_due and now >= self._ping_due:
            self._drop(f"{LOST}: no answer to a keepalive ping within {self.keepalive_timeout_s:g}s")
            return
        if self.keepalive_s > 0 and not self._ping_due and now - self._last_ping >= self.keepalive_s:
            self._last_ping, self._ping_due = now, now + self.keepalive_timeout_s
            self._settings_sent += 1
            self._ping_number = self._settings_sent
            self.write(frame(SETTINGS, 0, 0))
        expired = [call for call in self.streams.values() if 0.0 < call.deadline <= now]  # type: ignore[attr-defined]
        for call in expired:
            self.reset(call)
            self._finish(call, (DEADLINE_EXCEEDED, OWN_ANSWER + "Triton did not answer before the deadline", b""))  # type: ignore[arg-type]
        self._timer = asyncio.get_running_loop().call_later(self._tick_s, self._tick)

    def _on_settings_ack(self) -> None:
        self._settings_acked += 1
        if self._settings_acked >= self._ping_number:
            self._ping_due = 0.0

    def _drop(self, reason: str) -> None:
        """The server stopped answering: fail every call now, and never use this connection again."""
        self.closing = True
        for call in list(self.streams.values()):
            self._finish(call, (UNAVAILABLE, reason, b""))  # type: ignore[arg-type]
        self._wake_all()
        if self.transport is not None:
            self.transport.abort()  # no FIN handshake with a peer that does not answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reason = f"{LOST}: {exc}" if exc else f"{LOST}: Triton closed it"
        for call in list(self.streams.values()):
            self._finish(call, (UNAVAILABLE, reason, b""))  # type: ignore[arg-type]
        self._wake_all()
        if not self.on_close.done():
            self.on_close.set_result(None)

    # -- frames in ------------------------------------------------------------------------------
    def _on_headers(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        call: _Call | None = self.streams.get(stream_id)  # type: ignore[assignment]
        if call is None:
            return
        if call.headers is None:
            call.headers = headers
            if call.listener is not None and not end_stream:
                call.listener.on_headers(headers)
        else:
            call.trailers = headers
        if end_stream:
            self._finish(call, _reply(call))

    def _data_target(self, stream_id: int, length: int) -> None:
        """Stream credit goes back on receipt at half the window, unless the call is held."""
        call = self._data_into = self.streams.get(stream_id)
        if call is None or self._data_end:
            return  # a call already finished or left: its data still counted for the connection
        call.unacked += length
        if call.unacked > STREAM_WINDOW // 2 and not call.held:
            self._credit(call)  # type: ignore[arg-type]

    def _credit(self, call: _Call) -> None:
        increment, call.unacked = call.unacked, 0
        if call.listener is None and not call.wide:
            call.wide = True
            increment += UNARY_WINDOW - STREAM_WINDOW
        self.write(frame(WINDOW_UPDATE, 0, call.id, struct.pack(">I", increment)))

    def _on_data(self, stream: StreamState, payload: memoryview, end_stream: bool) -> None:
        call: _Call = stream  # type: ignore[assignment]
        if call.listener is not None:
            if payload:
                call.listener.on_data(payload)
        else:
            call.chunks.append(payload)
        if end_stream:
            self._finish(call, _reply(call))

    def _on_reset(self, stream: StreamState, code: int) -> None:
        status = UNAVAILABLE if code == REFUSED_STREAM else CANCELLED if code == CANCEL else INTERNAL
        self._finish(stream, (status, f"{OWN_ANSWER}Triton reset the stream (HTTP/2 error {code})", b""))  # type: ignore[arg-type]

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.closing = True
        for call in [s for s in self.streams.values() if s.id > last_stream_id]:
            self._finish(call, (UNAVAILABLE, f"{GOING_AWAY} (HTTP/2 GOAWAY {code})", b""))  # type: ignore[arg-type]
        self._wake_all()
        if not self.streams and self.transport is not None:
            self.transport.close()

    def _on_settings(self) -> None:
        self._wake_all()

    def _on_drained(self, stream: StreamState) -> None:
        call: _Call = stream  # type: ignore[assignment]
        if call.listener is not None:  # a streaming call paces its client by what the upstream takes
            call.listener.on_drained()

    _on_flushed = _on_drained

    def _on_stream_error(self, stream: StreamState, code: int) -> None:
        self._finish(stream, (INTERNAL, f"{OWN_ANSWER}Triton broke HTTP/2 on the stream (reset with {code})", b""))  # type: ignore[arg-type]

    def _connection_error(self, code: int, reason: str) -> None:
        self.closing, self.reading = True, False
        for call in list(self.streams.values()):
            self._finish(call, (INTERNAL, f"{OWN_ANSWER}Triton broke HTTP/2: {reason}", b""))  # type: ignore[arg-type]
        if self.transport is not None:
            self.transport.close()

    def _finish(self, call: _Call, reply: Reply) -> None:
        if self.streams.pop(call.id, None) is None:
            return
        slot = call.slot
        if slot is not None:  # answered (or failed): the slot is free now, not when the caller's task runs
            call.slot = None
            slot.release()
        self.drop_pending(call)
        if call.future is not None and not call.future.done():
            call.future.set_result(reply)
        if call.listener is not None:
            call.listener.on_close(reply[0], reply[1])
        if self._waiters:
            self._wake_one()
        if self.closing and not self.streams and self.transport is not None:
            self.transport.close()

    # -- calls ----------------------------------------------------------------------------------
    def _new_call(self, future: asyncio.Future[Reply] | None, listener: StreamListener | None) -> _Call:
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id > 0x7FFFFFFF:
            self.closing = True  # stream ids exhausted: the next call opens a new connection
        call = _Call(stream_id, self._peer_initial_window, future, listener)
        self.streams[stream_id] = call
        return call

    def start(self, header_block: bytes, message: Message, timeout: float | None = None,
              slot: Slot | None = None) -> _Call:
        """A unary call: the request goes out now (as far as the windows allow); the tick ends it
        a little after ``timeout`` if Triton has not answered by then. ``slot``: released as it ends."""
        loop = asyncio.get_running_loop()
        call = self._new_call(loop.create_future(), None)
        call.slot = slot
        call.requests_ended = True
        if timeout is not None:
            call.deadline = loop.time() + timeout + _DEADLINE_GRACE_S
        self.send(call, grpc_parts(message), end=True, before=self.headers_frames(call.id, header_block))
        self.flush_alone(1)  # the only call on this upstream connection: nothing would join the request
        return call

    def open(self, header_block: bytes, listener: StreamListener) -> _Call:
        """A streaming call: HEADERS now, messages with ``send_message``, ``end_requests`` last."""
        call = self._new_call(None, listener)
        self.write(self.headers_frames(call.id, header_block))
        return call

    def send_message(self, call: _Call, message: Message) -> None:
        if call.id in self.streams:
            self.send(call, grpc_parts(message))

    @staticmethod
    def backlog(call: _Call) -> int:
        """Request bytes queued on the call, waiting for the upstream to grant window."""
        pending = call.pending
        return len(pending) if pending is not None else 0

    def hold(self, call: _Call) -> None:
        """The call's replies wait for its caller's client: Triton gets no more stream credit (it
        may send what is left of the window, ``STREAM_WINDOW`` at most) until ``release``."""
        call.held = True

    def release(self, call: _Call) -> None:
        """The caller took the replies: what was received meanwhile is credited back."""
        if call.held:
            call.held = False
            if call.unacked and call.id in self.streams:
                self._credit(call)

    def end_requests(self, call: _Call) -> None:
        if call.id in self.streams and not call.requests_ended:
            call.requests_ended = True
            self.send(call, b"", end=True)

    def leave(self, call: _Call, within_s: float) -> None:
        """The caller went away: it hears CANCELLED now, and the call is left to finish on Triton,
        its answers dropped, never reset (Triton 2.51 crashes on resets of its gRPC calls, unary and
        streaming: ``grpc.upstream``). A stream's requests are ended (END_STREAM after what was
        sent), so Triton ends it once it has answered them. The tick resets it only if it is still
        open at its deadline, or ``within_s`` from now without one: Triton is busy or hung then,
        and a reset in the middle of a request's work is not what crashes it. The call keeps its
        admission slot until it ends here (a stream its place in its client's streams:
        ``grpc.client_streams``): Triton is still working on it."""
        if call.id not in self.streams:
            return
        future, listener = call.future, call.listener
        call.future, call.listener = None, _LEFT
        if not call.requests_ended:  # a stream whose requests went on: no more will come
            self.end_requests(call)
        self.release(call)  # its answers are dropped from now on: none waits for the caller
        ends = asyncio.get_running_loop().time() + within_s
        if not 0.0 < call.deadline <= ends:
            call.deadline = ends
        if future is not None and not future.done():
            future.set_result((CANCELLED, "cancelled", b""))
        if listener is not None:
            listener.on_close(CANCELLED, "cancelled")

    # -- MAX_CONCURRENT_STREAMS -----------------------------------------------------------------
    @property
    def full(self) -> bool:
        return len(self.streams) >= self.peer_max_streams

    async def room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake_one(self) -> None:
        waiter = self._waiters.pop(0)
        if not waiter.done():
            waiter.set_result(None)

    def _wake_all(self) -> None:
        while self._waiters:
            self._wake_one()


class _Left:
    """The listener of a call its caller left (``Http2Connection.leave``): Triton's answers to it are dropped."""

    def on_headers(self, headers: Headers) -> None:
        pass

    def on_data(self, payload: bytes | memoryview) -> None:
        pass

    def on_close(self, code: int, details: str) -> None:
        pass

    def on_drained(self) -> None:
        pass


_LEFT = _Left()


def _reply(call: _Call) -> Reply:
    if call.listener is not None:  # a stream's messages went to its listener as they came
        return (*status_of(call.headers, call.trailers), b"")
    return unary_reply(call.headers, call.trailers, call.chunks)
