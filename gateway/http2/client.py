"""The client end of one HTTP/2 connection to Triton, carrying gRPC calls.

A unary call is one stream whose request goes out in a single ``write()`` (HEADERS + DATA)
when the windows allow, and whose reply is collected into ``(grpc status, message, response
bytes)``. A streaming call (``open``) hands every frame of the reply to a ``StreamListener``
as it arrives, and takes request messages one by one. GOAWAY, RST_STREAM and a lost
connection end the affected calls with ``UNAVAILABLE`` (or ``CANCELLED``) the way grpcio does.
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from urllib.parse import unquote

from gateway.grpc.status import StatusCode
from gateway.grpc.wire import grpc_frame
from gateway.http2.endpoint import (
    CANCEL,
    PREFACE,
    RECEIVE_WINDOW,
    REFUSED_STREAM,
    Endpoint,
    Headers,
    StreamState,
    open_windows,
    settings_frame,
)

OK, CANCELLED, UNKNOWN, INTERNAL, UNAVAILABLE = (StatusCode.OK, StatusCode.CANCELLED, StatusCode.UNKNOWN,
                                                 StatusCode.INTERNAL, StatusCode.UNAVAILABLE)
_HTTP_TO_GRPC = {400: INTERNAL, 401: StatusCode.UNAUTHENTICATED, 403: StatusCode.PERMISSION_DENIED,
                 404: StatusCode.UNIMPLEMENTED, 429: UNAVAILABLE, 502: UNAVAILABLE,
                 503: UNAVAILABLE, 504: UNAVAILABLE}

Reply = tuple[int, str, bytes]


class StreamListener(Protocol):
    def on_headers(self, headers: Headers) -> None: ...
    def on_data(self, payload: bytes) -> None: ...
    def on_close(self, code: int, details: str) -> None: ...
    def on_drained(self) -> None: ...  # part or all of the call's send queue went out (see ``backlog``)


class _Call(StreamState):
    __slots__ = ("future", "headers", "trailers", "chunks", "listener")

    def __init__(self, stream_id: int, window: int, future: asyncio.Future[Reply] | None,
                 listener: StreamListener | None = None) -> None:
        super().__init__(stream_id, window)
        self.future = future
        self.listener = listener
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self.chunks: list[bytes] = []


class Http2Connection(Endpoint):
    def __init__(self, on_close: asyncio.Future[None]) -> None:
        super().__init__()
        self.on_close = on_close
        self._next_id = 1
        self._waiters: list[asyncio.Future[None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.write(PREFACE + settings_frame(enable_push=0, initial_window=RECEIVE_WINDOW, max_frame=1 << 20)
                   + open_windows())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        reason = f"connection lost: {exc}" if exc else "connection closed by the upstream"
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

    def _on_data(self, stream: StreamState, payload: bytes, end_stream: bool) -> None:
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
        self._finish(stream, (status, f"upstream reset the stream (HTTP/2 error {code})", b""))  # type: ignore[arg-type]

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.closing = True
        for call in [s for s in self.streams.values() if s.id > last_stream_id]:
            self._finish(call, (UNAVAILABLE, f"upstream is going away (HTTP/2 GOAWAY {code})", b""))  # type: ignore[arg-type]
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
        self._finish(stream, (INTERNAL, f"upstream broke HTTP/2 on the stream (we reset it with {code})", b""))  # type: ignore[arg-type]

    def _connection_error(self, code: int, reason: str) -> None:
        self.closing, self.reading = True, False
        for call in list(self.streams.values()):
            self._finish(call, (INTERNAL, reason, b""))  # type: ignore[arg-type]
        if self.transport is not None:
            self.transport.close()

    def _finish(self, call: _Call, reply: Reply) -> None:
        if self.streams.pop(call.id, None) is None:
            return
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

    def start(self, header_block: bytes, message: bytes) -> _Call:
        """A unary call: the request goes out now (as far as the windows allow)."""
        call = self._new_call(asyncio.get_running_loop().create_future(), None)
        self.send(call, grpc_frame(message), end=True, before=self.headers_frames(call.id, header_block))
        return call

    def open(self, header_block: bytes, listener: StreamListener) -> _Call:
        """A streaming call: HEADERS now, messages with ``send_message``, ``end_requests`` last."""
        call = self._new_call(None, listener)
        self.write(self.headers_frames(call.id, header_block))
        return call

    def send_message(self, call: _Call, message: bytes) -> None:
        if call.id in self.streams:
            self.send(call, grpc_frame(message))

    @staticmethod
    def backlog(call: _Call) -> int:
        """Request bytes queued on the call, waiting for the upstream to grant window."""
        pending = call.pending
        return len(pending) if pending is not None else 0

    def end_requests(self, call: _Call) -> None:
        if call.id in self.streams:
            self.send(call, b"", end=True)

    def cancel(self, call: _Call) -> None:
        """The caller went away: tell the upstream to stop working on it."""
        if call.id in self.streams:
            self.reset(call)
            self._finish(call, (CANCELLED, "cancelled", b""))

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


def status_of(headers: Headers | None, trailers: Headers | None) -> tuple[int, str]:
    """gRPC status and message from trailers (or a trailers-only response's headers)."""
    status = details = None
    for name, value in trailers if trailers is not None else headers or []:
        if name == b"grpc-status":
            status = value
        elif name == b"grpc-message":
            details = value
    if status is None:
        http_status = next((value for name, value in headers or [] if name == b":status"), b"")
        code = _HTTP_TO_GRPC.get(int(http_status or 0), UNKNOWN)
        return code, f"upstream answered HTTP {http_status.decode() or '?'} without a gRPC status"
    return int(status), unquote(details.decode("utf-8", "replace")) if details else ""


def _reply(call: _Call) -> Reply:
    code, message = status_of(call.headers, call.trailers)
    if code != OK or call.listener is not None:
        return code, message, b""
    data = call.chunks[0] if len(call.chunks) == 1 else b"".join(call.chunks)
    if len(data) < 5 or data[0] != 0:
        return INTERNAL, "upstream sent no response message (or a compressed one)", b""
    length = int.from_bytes(data[1:5], "big")
    if len(data) < 5 + length:
        return INTERNAL, "upstream response message is truncated", b""
    return OK, message, data[5:5 + length]
