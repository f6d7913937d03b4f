"""The server end of an HTTP/2 connection speaking gRPC (the gateway's gRPC port).

Each request stream gets a handler from the application (``on_stream``); the connection
splits the request DATA into gRPC messages (decompressing gzip/deflate ones) and hands them
over, tells the handler when the client half-closes or resets, and offers the three ways a
gRPC response goes out: a whole unary answer in one write, or headers, messages and a status
one by one for streams. A client that sends something this cannot read gets GOAWAY.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Callable
from typing import Protocol

from gateway.grpc.status import StatusCode
from gateway.grpc.wire import MessageTooLarge, grpc_frame, split_messages, status_block
from gateway.http2.endpoint import (
    GOAWAY,
    MAX_FRAME,
    RECEIVE_WINDOW,
    REFUSED_STREAM,
    RST_STREAM,
    Endpoint,
    Headers,
    StreamState,
    frame,
    open_windows,
    settings_frame,
)
from gateway.http2.hpack_codec import literal, literal_indexed_name

MAX_CONCURRENT_STREAMS = 1000
MAX_MESSAGE = 1 << 30
_RESPONSE_HEADERS = b"\x88" + literal_indexed_name(31, b"application/grpc")  # :status 200, content-type
_OK_TRAILER = literal(b"grpc-status", b"0")
_PROTOCOL_ERROR, _INTERNAL = 0x1, StatusCode.INTERNAL


class StreamHandler(Protocol):
    def on_message(self, message: bytes) -> None: ...
    def on_end(self) -> None: ...
    def on_reset(self) -> None: ...


class ServerStream(StreamState):
    __slots__ = ("path", "headers", "buffer", "handler", "responded", "finished", "compression")

    def __init__(self, stream_id: int, window: int, headers: Headers) -> None:
        super().__init__(stream_id, window)
        self.headers = headers
        self.path = ""
        self.compression = b""
        for name, value in headers:
            if name == b":path":
                self.path = value.decode("latin-1")
            elif name == b"grpc-encoding":
                self.compression = value
        self.buffer = bytearray()
        self.handler: StreamHandler | None = None
        self.responded = False  # response HEADERS sent
        self.finished = False  # status sent


class Http2ServerConnection(Endpoint):
    expects_preface = True

    def __init__(self, on_stream: Callable[[Http2ServerConnection, ServerStream], StreamHandler | None],
                 connections: set[Http2ServerConnection]) -> None:
        super().__init__()
        self.on_stream = on_stream
        self.connections = connections
        self.closed = asyncio.get_running_loop().create_future()
        self._last_stream_id = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)
        self.write(settings_frame(max_concurrent_streams=MAX_CONCURRENT_STREAMS, initial_window=RECEIVE_WINDOW,
                                  max_frame=MAX_FRAME) + open_windows())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.connections.discard(self)
        for stream in list(self.streams.values()):
            self._drop(stream)  # type: ignore[arg-type]
        if not self.closed.done():
            self.closed.set_result(None)

    # -- frames in ------------------------------------------------------------------------------
    def _on_headers(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        stream: ServerStream | None = self.streams.get(stream_id)  # type: ignore[assignment]
        if stream is None:
            if stream_id % 2 == 0 or stream_id <= self._last_stream_id:
                return  # trailers for a stream we finished, or nonsense: nothing to do
            self._last_stream_id = stream_id
            if self.closing:
                self.write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
                return
            stream = ServerStream(stream_id, self._peer_initial_window, headers)
            self.streams[stream_id] = stream
            stream.handler = self.on_stream(self, stream)
        if end_stream and stream.handler is not None and not stream.finished:
            stream.handler.on_end()

    def _on_data(self, stream: StreamState, payload: bytes, end_stream: bool) -> None:
        call: ServerStream = stream  # type: ignore[assignment]
        if call.finished or call.handler is None:
            return
        buffer = call.buffer
        if buffer:  # a message split over DATA frames; usually not, and then payload is parsed as it is
            buffer += payload
        data = buffer or payload
        try:
            messages, used = split_messages(data, MAX_MESSAGE)
        except MessageTooLarge as exc:
            self.finish(call, StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        for compressed, message in messages:
            if compressed:
                message = self._decompress(call, message)
                if call.finished:
                    return
            call.handler.on_message(message)
            if call.finished:
                return
        if buffer:
            del buffer[:used]
        elif used < len(payload):
            buffer += payload[used:]
        if end_stream and not call.finished:
            if buffer:
                self.finish(call, _INTERNAL, "the request ended inside a message")
            else:
                call.handler.on_end()

    def _decompress(self, call: ServerStream, message: bytes) -> bytes:
        try:
            if call.compression == b"gzip":
                return zlib.decompress(message, 16 + zlib.MAX_WBITS)
            if call.compression == b"deflate":
                return zlib.decompress(message)
        except zlib.error as exc:
            self.finish(call, _INTERNAL, f"cannot decompress the request message: {exc}")
            return b""
        self.finish(call, StatusCode.UNIMPLEMENTED,
                    f"compression {call.compression.decode(errors='replace')!r} is not supported")
        return b""

    def _on_reset(self, stream: StreamState, code: int) -> None:
        self._drop(stream)  # type: ignore[arg-type]

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.closing = True  # the client opens no more streams here; ours finish as they are
        if not self.streams and self.transport is not None:
            self.transport.close()

    def _protocol_error(self, reason: str) -> None:
        self.goaway(_PROTOCOL_ERROR, reason)
        for stream in list(self.streams.values()):
            self._drop(stream)  # type: ignore[arg-type]
        if self.transport is not None:
            self.transport.close()

    def _drop(self, stream: ServerStream) -> None:
        """The client reset the stream or went away: the handler stops its upstream work."""
        self.streams.pop(stream.id, None)
        self.drop_pending(stream)
        if not stream.finished:
            stream.finished = True
            if stream.handler is not None:
                stream.handler.on_reset()

    def _on_flushed(self, stream: StreamState) -> None:
        call: ServerStream = stream  # type: ignore[assignment]
        if call.finished:
            self._forget(call)

    # -- frames out -----------------------------------------------------------------------------
    def reply(self, stream: ServerStream, message: bytes, metadata: bytes = b"") -> None:
        """A whole unary answer: headers, the message and an OK status, in one write."""
        if stream.finished:
            return
        stream.responded = stream.finished = True
        before = self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata)
        trailer = self.headers_frames(stream.id, _OK_TRAILER, end_stream=True)
        self.send(stream, grpc_frame(message), trailer=trailer, before=before)
        if stream.pending is None:
            self._forget(stream)

    def send_headers(self, stream: ServerStream, metadata: bytes = b"") -> None:
        if not stream.responded and not stream.finished:
            stream.responded = True
            self.write(self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata))

    def send_message(self, stream: ServerStream, message: bytes) -> None:
        if stream.finished:
            return
        self.send_headers(stream)
        self.send(stream, grpc_frame(message))

    def finish(self, stream: ServerStream, code: int, details: str = "", metadata: bytes = b"") -> None:
        """The status; a trailers-only response when no headers went out yet."""
        if stream.finished:
            return
        stream.finished = True
        if stream.responded:
            trailer = self.headers_frames(stream.id, status_block(code, details), end_stream=True)
        else:
            stream.responded = True
            trailer = self.headers_frames(stream.id, _RESPONSE_HEADERS + metadata + status_block(code, details),
                                          end_stream=True)
        self.send(stream, b"", trailer=trailer)
        if stream.pending is None:
            self._forget(stream)

    def _forget(self, stream: ServerStream) -> None:
        self.streams.pop(stream.id, None)
        if self.closing and not self.streams and self.transport is not None:
            self.transport.close()

    def goaway(self, code: int = 0, reason: str = "") -> None:
        """No new streams: the ones open finish, then the connection closes."""
        self.closing = True
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream_id, code) + reason.encode()[:200]))
        if not self.streams and self.transport is not None:
            self.transport.close()
