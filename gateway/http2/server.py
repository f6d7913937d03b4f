"""The server end of an HTTP/2 connection facing clients: plain RFC 9113, no gRPC.

Each request stream gets a handler from the application (``on_stream``); the connection
enforces flow control, stream states and the client's bounds, tells the handler when the
client half-closes or resets, and holds back stream credit while a request message is being
assembled (its reservation) or its upstream is full (``hold``). A client that breaks the
protocol gets the RFC's error: RST_STREAM for a stream error, GOAWAY and the close for a
connection error.

Layering: what the request DATA carries and how an answer is framed belong to the protocol
on top. ``grpc.server_connection.GrpcServerConnection`` adds gRPC's length-prefixed messages
(inflating compressed ones), its statuses and trailers, and the answers this layer asks of it
(``_answer_refused``, ``_answer_too_large``, ``_over_budget``, ``_on_data``), so this module
imports nothing of gRPC (``tests/unit/test_architecture.py``).

The port faces every client, so every resource a client can make this hold has a bound
(``server_stream.Limits``): header list, message size before and after decompression,
concurrent streams, flow-control windows, unread answers, control-frame rates, and the time
before the preface, inside a header block and while idle.

Past ~400 lines because it is one state machine: streams, credit, reservations and the
lingering close all read and change the same connection state; what stands apart from it
(the bounds, a stream's state, the request check) is in ``server_stream``.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from gateway.byte_budget import ByteBudget
from gateway.client_address import PerAddress
from gateway.http2.endpoint import (
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Endpoint,
    Headers,
    ProtocolError,
    StreamState,
    frame,
    open_windows,
    settings_frame,
)
from gateway.http2.hpack_codec import HeaderListTooLarge
from gateway.http2.server_stream import Limits, ServerStream, StreamHandler, read_request
from gateway.http2.stall import StallWatch
from gateway.sweep import TICKS_PER_S, Sweep

_RESET_MEMORY = 64  # streams we reset whose late frames are ignored
# After a connection error the socket stays half-open this long, reading and dropping, so the
# GOAWAY is read before the close (Go's x/net/http2 server waits 1 s too, see _linger).
_LINGER_S = 1.0


def _goaway_frame(last_stream_id: int, code: int, reason: str) -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, code) + reason.encode()[:200])


class Http2ServerConnection(Endpoint):
    expects_preface = True
    coding_header = b"content-encoding"  # names how a request's messages are compressed (ServerStream.compression)
    protocol = "HTTP/2"  # named in a refusal's reason: the port's protocol, and its setting of max_connections
    max_connections_setting = "max_connections"
    frames_per_slice = 500  # ~10-20 ms of work at most before other clients get the loop

    def __init__(self, on_stream: Callable[[Any, ServerStream], StreamHandler | None],
                 connections: set[Any], limits: Limits | None = None,
                 per_client: PerAddress | None = None, budget: ByteBudget | None = None) -> None:
        limits = limits or Limits()
        # a raw block can only be smaller than its header list by the few bytes of table size updates
        super().__init__(limits.max_frame, limits.max_header_list + 64, limits.max_header_list)
        self.on_stream = on_stream
        self.connections = connections
        self.per_client = PerAddress() if per_client is None else per_client  # open connections per client address
        self._address: str | None = None  # counted in per_client under this address
        self.limits = limits
        # The gateway's one budget of bytes held for requests (byte_budget), shared with the HTTP
        # port: a message being assembled (its reservation), inflated, or held for its unary call.
        self.budget = budget if budget is not None else ByteBudget(1 << 62)
        self.closed = asyncio.get_running_loop().create_future()
        self._last_stream_id = 0
        self._recv_window = limits.connection_window  # what the client may still send on the connection
        self._owed = 0  # received bytes not yet given back to the client as connection window
        self._credit_at = limits.connection_window // 2
        self._reserved = 0  # admitted reservations (see Limits)
        self._reserve_limit = limits.max_message + 5
        self._waiting: list[ServerStream] = []  # reservations not admitted yet, oldest first
        self._calm_pings = max(1, limits.pings_per_s)  # per second: the counters' window (see data_received)
        self._calm_settings = max(1, limits.settings_per_s)
        self._calm_empty = max(1, limits.empty_frames_per_s)
        self._calm_resets = max(1, limits.resets_per_s)
        # Time bounds: the loop's one sweep visits this connection when the earliest may fall due
        # (gateway.sweep); bytes in stamp the coarse clock, no timer of its own.
        self._sweep = Sweep.of(asyncio.get_running_loop())
        self.sweep_due = 0
        self._born = self._seen = self._sweep.tick  # connected; the last bytes in
        self._block_started = 0  # when the header block being continued began
        self._window = self._born // TICKS_PER_S  # the second the flood counters count in
        self._timer: asyncio.TimerHandle | None = None  # a refusal's answer, a lingering close's end
        self._reset_ids: dict[int, None] = {}
        self.write_paused = False  # the client is not reading: its socket is past write_high_water
        # answers the client leaves unread; one tick more: a stamp is the sweep's clock, up to a tick behind
        self._stall = StallWatch(Sweep.ticks(limits.stalled_timeout) + 1)
        self._refused = ""  # why this connection is one too many (a cap's reason): see _refuse
        self.write_closed = False  # our FIN is sent (a lingering close): the transport is shut, reads are dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.attach(transport)
        limits = self.limits
        transport.set_write_buffer_limits(high=limits.write_high_water)  # type: ignore[attr-defined]
        self.write(settings_frame(max_concurrent_streams=limits.max_concurrent_streams,
                                  initial_window=limits.stream_window, max_frame=limits.max_frame,
                                  max_header_list=limits.max_header_list) + open_windows(limits.connection_window))
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else ""
        if len(self.connections) >= limits.max_connections:
            self._refused = (f"the gateway has {limits.max_connections} {self.protocol} client connections open "
                             f"({self.max_connections_setting}): retry shortly")
        elif not self.per_client.admit(address, limits.max_connections_per_client):
            self._refused = (f"this client address has {limits.max_connections_per_client} {self.protocol} "
                             "connections open (max_connections_per_client): retry shortly")
        if self._refused:  # not counted; its first call is answered, or GOAWAY comes within 1 s
            self._timer = loop.call_later(min(limits.preface_timeout, _LINGER_S), self._refuse)
            return
        self._address = address
        self.connections.add(self)
        self._sweep.at(self, Sweep.ticks(limits.preface_timeout))

    def _refuse(self, stream_id: int = 0) -> None:
        """One connection too many. Its first request is answered with the reason
        (``_answer_refused``), then GOAWAY and the lingering close, as after a connection error."""
        reason = self._refused
        if stream_id:
            self._new_stream_id(stream_id)  # a bad id is a connection error like any other
            self._answer_refused(stream_id, reason)
        self._connection_error(NO_ERROR, reason)

    # -- what the protocol on top answers (grpc.server_connection) --------------------------------
    def _answer_refused(self, stream_id: int, reason: str) -> None:
        """A whole answer, ending the stream, to the first request of a connection one too many."""
        raise NotImplementedError

    def _answer_too_large(self, stream_id: int, reason: str) -> None:
        """A whole answer, ending the stream, to a request whose header list is past the bound."""
        raise NotImplementedError

    def _over_budget(self, stream: ServerStream) -> None:
        """Answer the stream: the gateway's budget of held request bytes has no room for it."""
        raise NotImplementedError

    def _announced(self, stream: ServerStream) -> int:
        """The size of the message the stream has begun, framing included (0: none begun, or not known yet)."""
        raise NotImplementedError

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing, self.reading = True, False
        self._sweep.cancel(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.connections.discard(self)
        address, self._address = self._address, None
        if address is not None:
            self.per_client.leave(address)
        for stream in list(self.streams.values()):
            self._drop(stream)  # type: ignore[arg-type]
        if not self.closed.done():
            self.closed.set_result(None)

    # -- backpressure: a client that does not read its answers is not read either, and the
    # handlers relaying answers to it pause their source (write_paused; on_sent once they may go on)
    # pause_writing is called by the transport from inside a write, as its buffer passes the
    # high-water mark: the frame loop stops after the current frame, so frames already read wait too.
    def pause_writing(self) -> None:
        self.write_paused = True
        self._stop_reading()
        assert self.transport is not None
        self._stall.paused(self._sweep.tick, self.transport.get_write_buffer_size())
        self._file_stall(self._stall.bound)

    def resume_writing(self) -> None:
        self.write_paused = False
        self._continue_reading()
        for stream in list(self.streams.values()):  # their answers may flow again (the handlers' on_sent)
            self._tell_sent(stream)

    def _yield_reading(self) -> None:
        """Thousands of tiny requests in one read must not hold the loop: the rest wait one turn."""
        self._stop_reading()
        asyncio.get_running_loop().call_soon(self._continue_reading)

    def _stop_reading(self) -> None:
        if self.reading and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self.reading = False

    def _continue_reading(self) -> None:
        if self.reading or self.write_paused or self.transport is None or self.transport.is_closing():
            return
        self.reading = True
        self.transport.resume_reading()
        if self._buffer:
            self.data_received(b"")  # the frames that waited

    # -- timeouts and flood counters ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.write_closed:
            return  # lingering after a connection error: what the client still sends is dropped
        tick = self._seen = self._sweep.tick
        if tick // TICKS_PER_S != self._window:  # a new second: the flood counters start again
            self._window = tick // TICKS_PER_S
            self._pings = self._settings_frames = self._empty_frames = self._resets = 0
        super().data_received(data)

    def _block_begun(self) -> None:
        """A header block left open: its own bound, from now."""
        self._block_started = self._sweep.tick
        self._sweep.at(self, Sweep.ticks(self.limits.header_timeout))

    def swept(self) -> None:
        """The sweep's visit (``gateway.sweep``): the preface, an unfinished header block and
        idleness are checked against the coarse clock; the connection is filed again for the
        earliest bound still ahead."""
        if self.transport is None or self.transport.is_closing() or self.write_closed:
            return
        limits, now = self.limits, self._sweep.tick
        if not self._preface_seen:
            due = self._born + Sweep.ticks(limits.preface_timeout)
            if now >= due:
                self.transport.close()  # not an HTTP/2 client, or a slow one holding a socket
                return
            self._sweep.at(self, due - now)
            return
        if self._continuation is not None:
            block_due = self._block_started + Sweep.ticks(limits.header_timeout)
            if now >= block_due:
                self._connection_error(PROTOCOL_ERROR, f"a header block unfinished after {limits.header_timeout:g} s")
                return
        else:
            block_due = 0
        stall_due = self._stalls(now)
        if self.transport.is_closing():
            return
        idle_ticks = Sweep.ticks(limits.idle_timeout)
        if self.streams:  # not idle while a call is open: looked at again an idle bound from now
            idle_due = now + idle_ticks
        else:
            idle_due = self._seen + idle_ticks
            if now >= idle_due:
                self.goaway(NO_ERROR, "idle")
                return
        self._sweep.at(self, min(due for due in (idle_due, block_due, stall_due) if due) - now)

    def _stalls(self, now: int) -> int:
        """Answers the client left unread past ``stalled_timeout`` (``http2.stall``): a stream whose
        queue did not move is reset ENHANCE_YOUR_CALM (gRPC clients read RESOURCE_EXHAUSTED; a reset
        needs no window and may cut a message half sent, where a status may not), and a paused socket
        that took nothing is closed. Returns the tick the next may fall due (0: none)."""
        blocked: list[ServerStream] = self._blocked  # type: ignore[assignment]  # this role's streams
        stalled, due = self._stall.streams_due(blocked, now)
        for stream in stalled:
            self.reset_id(stream.id, ENHANCE_YOUR_CALM)
            self._drop(stream)  # its queue is dropped; a call still running stops (left to finish upstream)
        if self.closing and not self.streams and self.transport is not None:
            self.transport.close()
        if self.write_paused and self.transport is not None:
            socket_due = self._stall.socket_due(now, self.transport.get_write_buffer_size())
            if socket_due <= now:
                self.transport.abort()  # nothing taken: what waits for it (and any status) would never be read
                return 0
            due = min(due, socket_due) if due else socket_due
        return due

    def _file_stall(self, ticks: int) -> None:
        """The sweep visits no later than ``ticks`` from now (it may be filed earlier already)."""
        due = self._sweep.tick + ticks
        if not self.sweep_due or due < self.sweep_due:
            self._sweep.at(self, ticks)

    # -- frames in ------------------------------------------------------------------------------
    def _on_headers(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        if self._refused:
            self._refuse(stream_id)
            return
        stream: ServerStream | None = self.streams.get(stream_id)  # type: ignore[assignment]
        if stream is not None:
            self._trailers(stream, headers, end_stream)
            return
        self._new_stream_id(stream_id)
        if self.closing:
            self.stream_error(stream_id, REFUSED_STREAM)
            return
        if len(self.streams) >= self.limits.max_concurrent_streams:
            self.stream_error(stream_id, REFUSED_STREAM)
            return
        request = read_request(headers, self.coding_header)
        if isinstance(request, str):
            self.stream_error(stream_id, PROTOCOL_ERROR)  # a malformed request (RFC 9113 8.1.1)
            return
        stream = ServerStream(stream_id, self._peer_initial_window, headers, request[0], request[1],
                              self.limits.stream_window)
        stream.remote_closed = end_stream
        self.streams[stream_id] = stream
        stream.handler = self.on_stream(self, stream)
        if end_stream and stream.handler is not None and not stream.finished:
            stream.handler.on_end()

    def _new_stream_id(self, stream_id: int) -> None:
        if stream_id % 2 == 0:
            raise ProtocolError(f"stream {stream_id}: clients open odd-numbered streams")
        if stream_id <= self._last_stream_id:
            # a closed stream, or one skipped and so implicitly closed (RFC 9113 5.1.1)
            raise ProtocolError(f"HEADERS on stream {stream_id}, not above the last one opened")
        self._last_stream_id = stream_id

    def _trailers(self, stream: ServerStream, headers: Headers, end_stream: bool) -> None:
        if stream.remote_closed:
            self.stream_error(stream.id, STREAM_CLOSED)
        elif not end_stream or any(name[:1] == b":" for name, _ in headers):
            self.stream_error(stream.id, PROTOCOL_ERROR)  # trailers end the stream and carry no pseudo-headers
        else:
            self._end_of_request(stream)

    def _on_header_list_too_large(self, stream_id: int, end_stream: bool, error: HeaderListTooLarge) -> None:
        stream: ServerStream | None = self.streams.get(stream_id)  # type: ignore[assignment]
        if stream is None:
            self._new_stream_id(stream_id)
            self._answer_too_large(stream_id, str(error))
            if not end_stream:
                self.reset_id(stream_id, NO_ERROR)  # the answer is complete: the client need not send more
            return
        self._drop(stream)
        self.stream_error(stream_id, PROTOCOL_ERROR)

    def _unknown_stream(self, kind: int, stream_id: int) -> None:
        if stream_id > self._last_stream_id:
            raise ProtocolError(f"frame type {kind} on idle stream {stream_id}")
        # RST_STREAM or WINDOW_UPDATE on a closed stream: may cross our own close, nothing to do

    # DATA (``Endpoint._data``: a whole frame is head, target, one piece; a frame spanning reads, pieces as they come)
    def _data_head(self, flags: int, stream_id: int, length: int) -> None:
        """Connection flow control, enforced on receipt on the frame's whole length."""
        if length > self._recv_window:
            raise ProtocolError("DATA beyond the connection's flow-control window", FLOW_CONTROL_ERROR)
        self._data_end = bool(flags & END_STREAM)
        self._data_into = None
        self._recv_window -= length
        self._owed += length
        if self._owed >= self._credit_at:
            self.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._owed)))
            self._recv_window += self._owed
            self._owed = 0

    def _data_target(self, stream_id: int, length: int) -> None:
        """The stream's state and flow control; a frame on a stream that takes none is dropped."""
        stream: ServerStream | None = self.streams.get(stream_id)  # type: ignore[assignment]
        if stream is None or stream.remote_closed:
            if stream_id > self._last_stream_id:
                raise ProtocolError(f"DATA on idle stream {stream_id}")
            if stream is not None or stream_id not in self._reset_ids:
                self.stream_error(stream_id, STREAM_CLOSED)
            return
        if length > stream.recv_window:
            self.stream_error(stream_id, FLOW_CONTROL_ERROR)
            return
        stream.recv_window -= length
        self._data_into = stream

    def _data_piece(self, payload: memoryview, last: bool) -> None:
        """Stream credit goes back once the frame is whole, and only while the stream's message is admitted."""
        stream: ServerStream | None = self._data_into  # type: ignore[assignment]
        if stream is None:
            return
        if last:
            self._data_into = None
        self._on_data(stream, payload, last and self._data_end)
        if last and not stream.remote_closed and not stream.finished and not stream.inflating and not stream.held \
                and (stream.admitted or not stream.reserved):
            self._stream_credit(stream, self.limits.stream_window >> 1)

    def _stream_credit(self, stream: ServerStream, threshold: int) -> None:
        unacked = self.limits.stream_window - stream.recv_window
        if unacked >= threshold and unacked > 0:
            stream.recv_window += unacked
            self.write(frame(WINDOW_UPDATE, 0, stream.id, struct.pack(">I", unacked)))

    def _reserve(self, stream: ServerStream, size: int) -> None:
        if not self.budget.try_take(size):
            self._over_budget(stream)
            return
        stream.reserved = size
        if not self._reserved or self._reserved + size <= self._reserve_limit:
            stream.admitted = True
            self._reserved += size
        else:
            self._waiting.append(stream)

    def _unreserve(self, stream: ServerStream) -> None:
        stream.handed = False
        self.budget.release(stream.reserved)
        if stream.admitted:
            self._reserved -= stream.reserved
            stream.admitted = False
        elif stream.reserved:
            self._waiting.remove(stream)
        stream.reserved = 0
        waiting = self._waiting
        while waiting and (not self._reserved or self._reserved + waiting[0].reserved <= self._reserve_limit):
            admitted = waiting.pop(0)
            admitted.admitted = True
            self._reserved += admitted.reserved
            if not admitted.held:
                self._stream_credit(admitted, 1)  # it may be blocked on a window used up

    def hold(self, stream: ServerStream) -> None:
        """A streaming handler's upstream queue is full: the client gets no more stream credit, and
        a message handed over keeps its reservation, until ``release``."""
        stream.held = True

    def release(self, stream: ServerStream) -> None:
        """The upstream took what it was handed: credit and reservations go on as before ``hold``."""
        if not stream.held:
            return
        stream.held = False
        if stream.finished:
            return
        if stream.handed:
            self._unreserve(stream)
            if not stream.inflating:  # the next message, if already begun, reserves now
                size = self._announced(stream)
                if size:
                    self._reserve(stream, size)
        if not stream.remote_closed and not stream.inflating and (stream.admitted or not stream.reserved):
            self._stream_credit(stream, 1)

    def _discharge(self, stream: ServerStream) -> None:
        self.budget.release(stream.charged)
        stream.charged = 0

    def _end_of_request(self, stream: ServerStream) -> None:
        """END_STREAM: exactly once per stream, so one request stream starts one upstream call."""
        stream.remote_closed = True
        if stream.reserved and not stream.handed:
            self._unreserve(stream)  # the upstream call takes it from here
        if stream.handler is not None and not stream.finished:
            stream.handler.on_end()

    def _on_reset(self, stream: StreamState, code: int) -> None:
        # A rapid reset (CVE-2023-44487) is made of resets before the answer: each costs the client a
        # frame and the gateway a call's setup, and the call goes on upstream. A stream reset once
        # answered (response HEADERS sent; from Triton they come with a stream's first reply: a
        # generation cut short after its first tokens) is not counted: its client waited for that
        # answer, so it churns no faster than Triton answers, and what Triton still does for it is
        # bounded by the client's streams (grpc_max_streams_per_client). Counting those sent a GOAWAY
        # every ~200 streams to a client cancelling after a first reply ~560 times a second.
        served: ServerStream = stream  # type: ignore[assignment]
        if not served.responded:
            self._resets += 1
            if self._resets > self._calm_resets:
                raise ProtocolError("too many stream resets", ENHANCE_YOUR_CALM)
        self._drop(served)

    def _on_stream_error(self, stream: StreamState, code: int) -> None:
        self._drop(stream)  # type: ignore[arg-type]

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.closing = True  # the client opens no more streams here; ours finish as they are
        if not self.streams and self.transport is not None:
            self.transport.close()

    def _connection_error(self, code: int, reason: str) -> None:
        self.reading = False
        self.closing = True
        self.write(_goaway_frame(self._last_stream_id, code, reason))
        self._linger()  # first: what dropping the streams would still write (window credit) stays unsent
        for stream in list(self.streams.values()):
            self._drop(stream)  # type: ignore[arg-type]

    def _linger(self) -> None:
        """Close after a connection error so that the client reads the GOAWAY saying why.

        Closing a socket with the client's bytes unread (a flood always leaves some) makes the
        kernel answer with a reset, and a reset can destroy our GOAWAY in the client's receive
        buffer before it is read. So: send our FIN after the GOAWAY, keep reading and dropping
        what still comes, and close when the client closes or after ``_LINGER_S`` at most (an
        abort then: a client that neither reads nor closes gets no more of our time)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.write_closed:
            return
        self.write_closed = True
        transport.shut()  # the GOAWAY goes out; what dropping the streams writes (window credit) does not
        if self._timer is not None:
            self._timer.cancel()
        # the bound holds on every path: TLS's close waits for the client's close_notify (30 s by default)
        self._timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)
        self._buffer.clear()
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return
        transport.resume_reading()

    def _drop(self, stream: ServerStream) -> None:
        """The stream is reset or the client went away: the handler stops its upstream work."""
        self.streams.pop(stream.id, None)
        self.drop_pending(stream)
        self._discharge(stream)
        if stream.reserved:
            self._unreserve(stream)
        if not stream.finished:
            stream.finished = True
            if stream.handler is not None:
                stream.handler.on_reset()
        stream.handler = None  # see _forget

    def _on_flushed(self, stream: StreamState) -> None:
        call: ServerStream = stream  # type: ignore[assignment]
        if call.finished:
            self._forget(call)
        else:
            self._on_drained(call)

    def _on_drained(self, stream: StreamState) -> None:
        stream.moved = self._sweep.tick  # type: ignore[attr-defined]  # a ServerStream: the client took some
        self._tell_sent(stream)

    def _tell_sent(self, stream: StreamState) -> None:
        handler = stream.handler  # type: ignore[attr-defined]  # a ServerStream
        if handler is not None:
            handler.on_sent()

    def _on_blocked(self, stream: StreamState) -> None:
        stream.moved = self._sweep.tick  # type: ignore[attr-defined]  # a ServerStream: its queue's wait begins
        self._file_stall(self._stall.bound)

    # -- frames out -----------------------------------------------------------------------------
    def _forget(self, stream: ServerStream) -> None:
        """Our half is closed; the client's too, or it is told it need not send more (RFC 9113 8.1)."""
        if self.streams.pop(stream.id, None) is not None and not stream.remote_closed:
            self.reset_id(stream.id, NO_ERROR)
        # the handler keeps its stream, not the other way round: a cycle per call would be left to
        # the garbage collector (with the call's task, coroutine and context: a collection every ~100 calls)
        stream.handler = None
        self._discharge(stream)
        if stream.reserved:
            self._unreserve(stream)
        if self.closing and not self.streams and self.transport is not None:
            self.transport.close()

    def reset_id(self, stream_id: int, code: int) -> None:
        self.write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
        self._remember_reset(stream_id)

    def stream_error(self, stream_id: int, code: int) -> None:
        super().stream_error(stream_id, code)
        self._remember_reset(stream_id)

    def _remember_reset(self, stream_id: int) -> None:
        """Frames already in flight on a stream we reset are ignored (RFC 9113 5.1), not answered:
        the last few such streams are remembered, in order, so the memory is bounded."""
        reset = self._reset_ids
        reset[stream_id] = None
        if len(reset) > _RESET_MEMORY:
            del reset[next(iter(reset))]

    def announce_goaway(self) -> None:
        """A graceful shutdown's first GOAWAY (RFC 9113 6.8): the client opens no more streams
        here, and those it is opening now (ids up to the largest) are still served."""
        if not self.closing:
            self.write(_goaway_frame(0x7FFFFFFF, NO_ERROR, ""))

    def goaway(self, code: int = NO_ERROR, reason: str = "") -> None:
        """No new streams: the ones open finish, then the connection closes."""
        self.closing = True
        self.write(_goaway_frame(self._last_stream_id, code, reason))
        if not self.streams and self.transport is not None:
            self.transport.close()

