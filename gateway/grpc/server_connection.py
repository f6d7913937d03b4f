"""gRPC on the gateway's HTTP/2 server connections (the gRPC port's own server, ``grpc.front``).

``http2.server`` is plain RFC 9113; this adds what gRPC puts on it: the request DATA split into
length-prefixed messages (gzip/deflate ones inflated, a large one a slice per loop turn, within
the message bound and the gateway's budget of held request bytes), and the three ways a gRPC
response goes out: a whole unary answer in one write, or headers, messages and a status one
by one for streams. The answers the HTTP/2 layer asks for (a connection one too many, a header
list past the bound, no budget left) are gRPC statuses here.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.byte_budget import ByteBudget, inflation_limit
from gateway.client_address import PerAddress
from gateway.grpc.status import StatusCode
from gateway.grpc.wire import Raw, grpc_parts, peek, status_block, take
from gateway.http2.endpoint import StreamState
from gateway.http2.hpack_codec import literal, literal_indexed_name
from gateway.http2.server import Http2ServerConnection
from gateway.http2.server_stream import Limits, ServerStream, StreamHandler

log = logging.getLogger("gateway.grpc")
_RESPONSE_HEADERS = b"\x88" + literal_indexed_name(31, b"application/grpc")  # :status 200, content-type
_OK_TRAILER = literal(b"grpc-status", b"0")
_INFLATE_SLICE = 4 << 20  # inflated per loop turn (~10-20 ms)
FILL_FROM = 1 << 20  # a message spread over frames from this size gets a buffer of its own ...
FILL_AFTER = 256 << 10  # ... once this much of it came


class GrpcServerConnection(Http2ServerConnection):
    coding_header = b"grpc-encoding"
    protocol = "gRPC"
    max_connections_setting = "grpc_max_connections"

    def __init__(self, on_stream: Callable[[GrpcServerConnection, ServerStream], StreamHandler | None],
                 connections: set[GrpcServerConnection], limits: Limits | None = None,
                 per_client: PerAddress | None = None, budget: ByteBudget | None = None) -> None:
        super().__init__(on_stream, connections, limits, per_client, budget)
        self._inflations: set[asyncio.Task[None]] = set()

    def _answer_refused(self, stream_id: int, reason: str) -> None:
        """UNAVAILABLE with the reason: a GOAWAY alone (no call answered) makes gRPC clients such as
        tritonclient reconnect and retry quietly until their deadline (measured: DEADLINE_EXCEEDED
        after 5 s, where an answered call says why at once)."""
        self.write(self.headers_frames(stream_id, _RESPONSE_HEADERS + status_block(StatusCode.UNAVAILABLE, reason),
                                       end_stream=True))

    def cut_open_calls(self, details: str) -> int:
        """A drain's bound ran out: every call still open stops its upstream work and is answered
        UNAVAILABLE with ``details`` (a status a client retries on), not left to a connection
        abort. Returns how many were cut; one call's failure cuts the others all the same."""
        cut = 0
        for state in list(self.streams.values()):
            stream: ServerStream = state  # type: ignore[assignment]
            if stream.finished:
                continue  # answered, its last frames still flushing
            handler = stream.handler
            try:
                self.drop_pending(stream)  # the status is a HEADERS frame: it need not wait for the client's window
                self.finish(stream, StatusCode.UNAVAILABLE, details)  # before the work stops: it would answer late
                if handler is not None:
                    handler.on_reset()
            except Exception:  # the shutdown goes on: the connection is aborted next
                log.exception("cutting gRPC call %s at the drain bound", stream.path)
            cut += 1
        return cut

    def _announced(self, stream: ServerStream) -> int:
        """A length-prefixed message: 1 flag byte, 4 bytes of length, then the message."""
        if stream.filling is not None:
            return len(stream.filling) + 5
        if stream.gathered < 5 or stream.pieces is None:
            return 0
        return int.from_bytes(peek(stream.pieces, 5)[1:5], "big") + 5

    def _answer_too_large(self, stream_id: int, reason: str) -> None:
        answer = _RESPONSE_HEADERS + status_block(StatusCode.RESOURCE_EXHAUSTED, reason)
        self.write(self.headers_frames(stream_id, answer, end_stream=True))

    def _over_budget(self, stream: ServerStream) -> None:
        self.finish(stream, StatusCode.UNAVAILABLE,
                    f"the gateway holds {self.budget.limit} bytes of requests already: retry shortly")

    def _charge(self, stream: ServerStream, size: int) -> bool:
        """Charge ``size`` held bytes to the stream until it ends; False (and the call answered) if they do not fit."""
        if not self.budget.try_take(size):
            self._over_budget(stream)
            return False
        stream.charged += size
        return True

    def _hand(self, call: ServerStream, handler: StreamHandler, message: Raw) -> None:
        """A whole message to the handler. A unary handler holds it until the call ends: charged till then."""
        if handler.streaming or self._charge(call, len(message)):
            handler.on_message(message)

    def _on_data(self, stream: StreamState, payload: memoryview, end_stream: bool) -> None:
        """DATA into messages, each copied exactly once on its way in. ``payload`` is a view of what
        was read: a message within it is copied out of it; one that goes on past it is copied
        into a buffer of its own as its bytes come (``_fill``: once it holds its reservation),
        so the reads it came in are let go at once; until then (a prefix cut short, a message
        waiting for its reservation) the views wait in the call's pieces."""
        call: ServerStream = stream  # type: ignore[assignment]
        handler = call.handler
        if call.finished or handler is None:
            if call.reserved:
                self._unreserve(call)  # answered already: the rest of the request is dropped
            if end_stream:
                call.remote_closed = True
            return
        if call.inflating:  # what follows waits, in order, for the message being inflated
            self._keep(call, payload)
            if end_stream:
                call.remote_closed = call.end_pending = True
            return
        view, limit = payload, self.limits.max_message
        while True:
            filling = call.filling
            if filling is not None:  # the rest of a large message spread over frames, copied in as it comes
                at = call.filled
                take_now = min(len(filling) - at, len(view))
                if take_now:  # through a view: a bytearray's own slice assignment copies the piece to a temporary first
                    memoryview(filling)[at:at + take_now] = view[:take_now]
                    call.filled = at + take_now
                    view = view[take_now:]
                if call.filled < len(filling):
                    break
                call.filling = None
                if not self._message(call, handler, call.fill_compressed, filling, view, end_stream):
                    return
                continue
            if call.gathered:  # what came before: a prefix cut short, or a message waiting for its reservation
                if view:
                    self._keep(call, view)
                    view = view[:0]
                pieces = call.pieces
                assert pieces is not None
                if call.gathered < 5:
                    break
                length = int.from_bytes(peek(pieces, 5)[1:5], "big")
                if length > limit:
                    self._too_large(call, length)
                    return
                if call.gathered >= 5 + length:  # whole already: its pieces joined once
                    compressed = take(pieces, 5)[0] != 0
                    message = take(pieces, length)
                    call.gathered -= 5 + length
                    if not self._message(call, handler, compressed, message, None, end_stream):
                        return
                    continue
                if self._fill(call, length):
                    continue
                break
            if len(view) < 5:  # messages read in place from the front of this payload
                if view:
                    self._keep(call, view)
                break
            length = int.from_bytes(view[1:5], "big")
            if length > limit:
                self._too_large(call, length)
                return
            if len(view) - 5 < length:
                self._keep(call, view)  # goes on past this payload: to its own buffer as soon as it may
                view = view[:0]
                continue
            compressed = view[0] != 0
            message = bytes(view[5:5 + length])  # the one copy
            view = view[5 + length:]
            if not self._message(call, handler, compressed, message, view, end_stream):
                return
        if end_stream:
            if call.gathered or call.filling is not None:
                self.finish(call, StatusCode.INTERNAL, "the request ended inside a message")
            else:
                self._end_of_request(call)
            return
        if (call.gathered >= 5 or call.filling is not None) and not call.reserved:  # a message spread over frames
            self._reserve(call, self._announced(call))

    @staticmethod
    def _keep(call: ServerStream, view: memoryview) -> None:
        """Bytes that cannot be read yet wait, as views, in the call's pieces."""
        if view:
            pieces = call.pieces
            if pieces is None:
                pieces = call.pieces = deque()
            pieces.append(view)
            call.gathered += len(view)

    def _fill(self, call: ServerStream, length: int) -> bool:
        """A large message (FILL_FROM), once FILL_AFTER bytes of it are here, gets a buffer of its
        own, of its announced size: the pieces are copied in and let go, and so is every read
        after them as it is copied in. Until then (and for a small message, joined once when whole) the views
        wait in the pieces: a buffer is made for bytes that came, never for a size only
        announced (a 5-byte prefix buys nothing), and one of exactly the message's size is
        reused as it is by the next (a buffer grown as bytes came left the heap fragmented:
        RSS twice the bytes in flight, as with the held reads). False while it cannot be yet."""
        if length < FILL_FROM or call.gathered - 5 < FILL_AFTER or call.handed:
            return False
        pieces = call.pieces
        assert pieces is not None
        compressed = take(pieces, 5)[0] != 0
        buffer = bytearray(length)
        into = memoryview(buffer)  # a bytearray's own slice assignment copies each piece to a temporary first
        at = 0
        while pieces:
            piece = pieces.popleft()
            into[at:at + len(piece)] = piece
            at += len(piece)
        into.release()
        call.gathered = 0
        call.filling, call.filled, call.fill_compressed = buffer, at, compressed
        return True

    def _too_large(self, call: ServerStream, length: int) -> None:
        self.finish(call, StatusCode.RESOURCE_EXHAUSTED,
                    f"gateway: the request message of {length} bytes is above the limit (grpc_max_message_bytes)")

    def _message(self, call: ServerStream, handler: StreamHandler, compressed: bool, message: Raw,
                 rest: memoryview | None, end_stream: bool) -> bool:
        """A whole message to the handler (inflated first); False when the call was answered, or
        inflation goes on a slice per loop turn: ``rest`` (what followed it in the payload read in
        place) then waits in the call's pieces, with the END_STREAM that came."""
        if compressed:
            inflated = self._decompress(call, message)
            if inflated is None:
                if call.inflating:
                    if rest:
                        self._keep(call, rest)
                    call.remote_closed = call.end_pending = end_stream
                return False
            message = inflated
        self._hand(call, handler, message)
        if handler.streaming and call.reserved and not call.handed:
            if call.held:
                call.handed = True  # the upstream has not taken it yet: the reservation stays until release
            else:
                self._unreserve(call)  # on its way upstream
        return not call.finished

    def _decompress(self, call: ServerStream, message: Raw) -> bytes | None:
        """The inflated message, if one slice inflates all of it; else None: the call was answered
        (RESOURCE_EXHAUSTED past the limit, a deflate bomb included) or inflation goes on a slice
        per loop turn, so one large message never holds the other clients for long."""
        if call.compression == b"gzip":
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif call.compression == b"deflate":
            inflater = zlib.decompressobj()
        else:
            self.finish(call, StatusCode.UNIMPLEMENTED,
                        f"compression {call.compression[:40].decode(errors='replace')!r} is not supported")
            return None
        limit = inflation_limit(len(message), self.limits.max_message, self.limits.max_inflation_ratio)
        first = min(_INFLATE_SLICE, limit + 1)  # a limit below one slice is the bound of the first one too
        try:
            inflated = inflater.decompress(message, first)
        except zlib.error as exc:
            self.finish(call, StatusCode.INTERNAL, f"gateway: cannot decompress the request message: {exc}")
            return None
        if len(inflated) > limit:
            self.finish(call, StatusCode.RESOURCE_EXHAUSTED, self._inflates_above(limit, len(message)))
            return None
        if inflater.eof or len(inflated) < first and not inflater.unconsumed_tail:
            return inflated
        call.inflating = True
        task = asyncio.get_running_loop().create_task(self._inflate(call, inflater, bytearray(inflated), limit,
                                                                    len(message)))
        self._inflations.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._inflations.discard)
        return None

    async def _inflate(self, call: ServerStream, inflater: Any, inflated: bytearray, limit: int,
                       compressed: int) -> None:
        """The rest of a large message, a slice per loop turn; what it inflates to is charged to the
        budget as it grows (RSS follows the budget, not the number of streams inflating at once)."""
        budget = self.budget
        charged = 0
        try:
            while len(inflated) <= limit:
                grown = min(len(inflated) + _INFLATE_SLICE, limit + 1)  # what the next slice may grow it to
                if not budget.try_take(grown - charged):
                    self._over_budget(call)
                    return
                charged = grown
                await asyncio.sleep(0)
                if call.finished:
                    return
                piece = inflater.decompress(inflater.unconsumed_tail, grown - len(inflated))
                inflated += piece
                if inflater.eof or not piece and not inflater.unconsumed_tail:
                    break
            if call.finished:
                return
            if len(inflated) > limit:
                self.finish(call, StatusCode.RESOURCE_EXHAUSTED, self._inflates_above(limit, compressed))
                return
            call.inflating = False
            assert call.handler is not None
            self._hand(call, call.handler, bytes(inflated))
        except zlib.error as exc:
            self.finish(call, StatusCode.INTERNAL, f"gateway: cannot decompress the request message: {exc}")
            return
        finally:
            del inflated[:]  # the handler has its own copy
            budget.release(charged)
        if not call.finished:
            call.remote_closed = False  # set again, now in order, by what waited
            self._on_data(call, memoryview(b""), call.end_pending)
            if not call.remote_closed and not call.finished and not call.held \
                    and (call.admitted or not call.reserved):
                self._stream_credit(call, 1)

    def _inflates_above(self, limit: int, compressed: int) -> str:
        if limit < self.limits.max_message:
            return (f"gateway: the request message inflates above {limit} bytes ({self.limits.max_inflation_ratio} "
                    f"times its {compressed} bytes: max_inflation_ratio)")
        return f"gateway: the request message inflates above {limit} bytes (grpc_max_message_bytes)"

    def reply(self, stream: ServerStream, message: bytes, metadata: bytes = b"") -> None:
        """A whole unary answer: headers, the message and an OK status, in one write."""
        if stream.finished:
            return
        stream.responded = stream.finished = True
        self._pings = 0
        before = self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata)
        trailer = self.headers_frames(stream.id, _OK_TRAILER, end_stream=True)
        self.send(stream, grpc_parts(message), trailer=trailer, before=before)
        if stream.pending is None:
            self._forget(stream)
        self.flush_alone(0)  # no other call on this connection: nothing would join the answer

    def send_headers(self, stream: ServerStream, metadata: bytes = b"") -> None:
        if not stream.responded and not stream.finished:
            stream.responded = True
            self._pings = 0
            self.write(self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata))

    def send_message(self, stream: ServerStream, message: bytes) -> None:
        if stream.finished:
            return
        self.send_headers(stream)
        self.send(stream, grpc_parts(message))

    def finish(self, stream: ServerStream, code: int, details: str = "", metadata: bytes = b"") -> None:
        """The status; a trailers-only response when no headers went out yet."""
        if stream.finished:
            return
        stream.finished = True
        self._pings = 0
        if stream.responded:
            trailer = self.headers_frames(stream.id, status_block(code, details), end_stream=True)
        else:
            stream.responded = True
            trailer = self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata + status_block(code, details),
                                          end_stream=True)
        self.send(stream, b"", trailer=trailer)
        if stream.pending is None:
            self._forget(stream)

