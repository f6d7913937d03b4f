"""One client-side HTTP/2 connection carrying unary gRPC calls (RFC 9113, the parts a client needs).

Frames are parsed straight from the receive buffer; each call is one stream whose request goes
out in a single ``write()`` (HEADERS + DATA) when the flow-control windows allow, and whose
reply is collected into a ``(grpc status, message, response bytes)`` tuple. Flow control both
ways, SETTINGS, PING, GOAWAY, RST_STREAM, CONTINUATION and padding are handled; server push is
refused in our SETTINGS.
"""

from __future__ import annotations

import asyncio
import struct
from urllib.parse import unquote

from gateway.http2.hpack_codec import Decoder, HpackError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
OK, CANCELLED, UNKNOWN, INTERNAL, UNAVAILABLE = 0, 1, 2, 13, 14
RECEIVE_WINDOW = 1 << 24  # per stream; the connection window is opened to 1 GiB
_CONNECTION_WINDOW = 1 << 30
_HEADER = struct.Struct(">BHBBI")
_HTTP_TO_GRPC = {400: INTERNAL, 401: 16, 403: 7, 404: 12, 429: UNAVAILABLE, 502: UNAVAILABLE,
                 503: UNAVAILABLE, 504: UNAVAILABLE}

Reply = tuple[int, str, bytes]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id) + payload


class _Stream:
    __slots__ = ("id", "future", "headers", "trailers", "chunks", "pending", "window", "unacked")

    def __init__(self, stream_id: int, future: asyncio.Future[Reply], window: int) -> None:
        self.id = stream_id
        self.future = future
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.chunks: list[bytes] = []
        self.pending: memoryview | None = None  # request bytes still waiting for window
        self.window = window
        self.unacked = 0


class Http2Connection(asyncio.Protocol):
    def __init__(self, on_close: asyncio.Future[None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self.on_close = on_close
        self.streams: dict[int, _Stream] = {}
        self.peer_max_streams = 1 << 31
        self._next_id = 1
        self._buffer = bytearray()
        self._decoder = Decoder()
        self._send_window = 65535
        self._peer_initial_window = 65535
        self._peer_max_frame = 16384
        self._recv_unacked = 0
        self._blocked: list[_Stream] = []
        self._continuation: tuple[int, int, bytearray] | None = None
        self._waiters: list[asyncio.Future[None]] = []

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HIHIHI", 2, 0, 4, RECEIVE_WINDOW, 5, 1 << 20)  # no push, windows, frames
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", _CONNECTION_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        reason = f"connection lost: {exc}" if exc else "connection closed by the upstream"
        for stream in list(self.streams.values()):
            self._finish(stream, (UNAVAILABLE, reason, b""))
        self._wake_all()
        if not self.on_close.done():
            self.on_close.set_result(None)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos, size = 0, len(buffer)
        try:
            while size - pos >= 9:
                high, low, kind, flags, stream_id = _HEADER.unpack_from(buffer, pos)
                length = high << 16 | low
                end = pos + 9 + length
                if end > size:
                    break
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, bytes(buffer[pos + 9:end]))
                pos = end
        except (ValueError, struct.error, IndexError) as exc:  # HpackError, a bad grpc-status: drop it all
            self._protocol_error(f"unreadable HTTP/2 from the upstream: {exc}")
            return
        del buffer[:pos]

    # -- frames in ----------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise HpackError("header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._headers(stream_id, flags, payload)
            else:
                self._continuation = (stream_id, flags, bytearray(payload))
        elif kind == CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise HpackError("unexpected CONTINUATION")
            self._continuation[2].extend(payload)
            if flags & END_HEADERS:
                _, first_flags, block = self._continuation
                self._continuation = None
                self._headers(stream_id, first_flags, bytes(block))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream_id == 0:
                self._send_window += increment
            elif (stream := self.streams.get(stream_id)) is not None:
                stream.window += increment
            if self._blocked:
                self._flush_blocked()
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK and self.transport is not None:
                self.transport.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if (stream := self.streams.get(stream_id)) is not None:
                code = int.from_bytes(payload[:4], "big")
                status = UNAVAILABLE if code == 0x7 else CANCELLED if code == 0x8 else INTERNAL
                self._finish(stream, (status, f"upstream reset the stream (HTTP/2 error {code})", b""))
        elif kind == GOAWAY:
            self._goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF, int.from_bytes(payload[4:8], "big"))
        # PRIORITY, PUSH_PROMISE (disabled in our SETTINGS) and unknown frame types are ignored

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        length = len(payload)
        self._recv_unacked += length
        if self._recv_unacked > _CONNECTION_WINDOW // 2 and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_unacked)))
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream we cancelled; its data still counted for the connection window
        if flags & PADDED:
            payload = payload[1:length - payload[0]]
        stream.chunks.append(payload)
        if flags & END_STREAM:
            self._complete(stream)
            return
        stream.unacked += length
        if stream.unacked > RECEIVE_WINDOW // 2 and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.unacked)))
            stream.unacked = 0

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)  # always: the decoder's table must stay in step
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if stream.headers is None:
            stream.headers = headers
        else:
            stream.trailers = headers
        if flags & END_STREAM:
            self._complete(stream)

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 3:
                self.peer_max_streams = value
            elif key == 4:
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.window += delta
            elif key == 5:
                self._peer_max_frame = value
        if self.transport is not None:
            self.transport.write(frame(SETTINGS, ACK, 0))
        self._wake_all()
        if self._blocked:
            self._flush_blocked()

    def _goaway(self, last_stream_id: int, code: int) -> None:
        self.closing = True
        for stream in [s for s in self.streams.values() if s.id > last_stream_id]:
            self._finish(stream, (UNAVAILABLE, f"upstream is going away (HTTP/2 GOAWAY {code})", b""))
        self._wake_all()
        if not self.streams and self.transport is not None:
            self.transport.close()

    def _protocol_error(self, reason: str) -> None:
        self.closing = True
        for stream in list(self.streams.values()):
            self._finish(stream, (INTERNAL, reason, b""))
        if self.transport is not None:
            self.transport.close()

    # -- completing a call --------------------------------------------------------------------
    def _complete(self, stream: _Stream) -> None:
        self._finish(stream, _reply(stream))

    def _finish(self, stream: _Stream, reply: Reply) -> None:
        self.streams.pop(stream.id, None)
        if stream.pending is not None:
            stream.pending = None
            self._blocked.remove(stream)
        if not stream.future.done():
            stream.future.set_result(reply)
        if self._waiters:
            self._wake_one()
        if self.closing and not self.streams and self.transport is not None:
            self.transport.close()

    # -- frames out ---------------------------------------------------------------------------
    def start(self, header_block: bytes, message: bytes) -> _Stream:
        """Open a stream and send the request (as much as the windows allow now)."""
        assert self.transport is not None
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id > 0x7FFFFFFF:
            self.closing = True  # stream ids exhausted: the next call opens a new connection
        stream = _Stream(stream_id, asyncio.get_running_loop().create_future(), self._peer_initial_window)
        self.streams[stream_id] = stream
        max_frame = self._peer_max_frame
        if len(header_block) <= max_frame:
            out = [frame(HEADERS, END_HEADERS, stream_id, header_block)]
        else:
            pieces = [header_block[i:i + max_frame] for i in range(0, len(header_block), max_frame)]
            out = [frame(HEADERS, 0, stream_id, pieces[0])]
            out += [frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, stream_id, piece)
                    for i, piece in enumerate(pieces[1:], 1)]
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        size = len(body)
        if size <= max_frame and size <= self._send_window and size <= stream.window:
            self._send_window -= size
            stream.window -= size
            out.append(frame(DATA, END_STREAM, stream_id, body))
            self.transport.write(b"".join(out))
            return stream
        self.transport.write(b"".join(out))
        stream.pending = memoryview(body)
        self._blocked.append(stream)
        self._flush_blocked()
        return stream

    def _flush_blocked(self) -> None:
        assert self.transport is not None
        for stream in list(self._blocked):
            pending = stream.pending
            while pending is not None and len(pending):
                size = min(len(pending), self._peer_max_frame, self._send_window, stream.window)
                if size <= 0:
                    break
                last = size == len(pending)
                self.transport.write(frame(DATA, END_STREAM if last else 0, stream.id, bytes(pending[:size])))
                self._send_window -= size
                stream.window -= size
                pending = pending[size:]
            if pending is not None and not len(pending):
                stream.pending = None
                self._blocked.remove(stream)
            else:
                stream.pending = pending

    def cancel(self, stream: _Stream) -> None:
        """The caller went away: tell the upstream to stop working on it."""
        if stream.id in self.streams:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", 0x8)))
            self._finish(stream, (CANCELLED, "cancelled", b""))

    # -- MAX_CONCURRENT_STREAMS ---------------------------------------------------------------
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


def _reply(stream: _Stream) -> Reply:
    trailers = stream.trailers if stream.trailers is not None else stream.headers or []
    status = details = None
    http_status = b""
    for name, value in trailers:
        if name == b"grpc-status":
            status = value
        elif name == b"grpc-message":
            details = value
    if status is None:
        for name, value in stream.headers or []:
            if name == b":status":
                http_status = value
        code = _HTTP_TO_GRPC.get(int(http_status or 0), UNKNOWN)
        return code, f"upstream answered HTTP {http_status.decode() or '?'} without a gRPC status", b""
    message = unquote(details.decode("utf-8", "replace")) if details else ""
    code = int(status)
    if code != OK:
        return code, message, b""
    data = stream.chunks[0] if len(stream.chunks) == 1 else b"".join(stream.chunks)
    if len(data) < 5 or data[0] != 0:
        return INTERNAL, "upstream sent no response message (or a compressed one)", b""
    length = int.from_bytes(data[1:5], "big")
    if len(data) < 5 + length:
        return INTERNAL, "upstream response message is truncated", b""
    return OK, message, data[5:5 + length]
