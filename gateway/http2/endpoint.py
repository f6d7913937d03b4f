"""What both ends of an HTTP/2 connection do alike (RFC 9113): framing, flow control, SETTINGS.

``Endpoint`` parses frames straight from the receive buffer, keeps the HPACK decoder in step,
answers PING and SETTINGS, opens the receive windows wide and replenishes them, and sends DATA
within the peer's windows, queueing what does not fit until a WINDOW_UPDATE arrives. The two
roles (``client.Http2Connection``, ``server.Http2ServerConnection``) supply what a stream's
frames mean through the ``_on_*`` hooks.
"""

from __future__ import annotations

import asyncio
import struct

from gateway.http2.hpack_codec import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
CANCEL, REFUSED_STREAM = 0x8, 0x7
RECEIVE_WINDOW = 1 << 24  # per stream; the connection window is opened to 1 GiB
MAX_FRAME = 1 << 20  # what we accept (SETTINGS_MAX_FRAME_SIZE)
MAX_HEADER_BLOCK = 1 << 20  # a header block spread over CONTINUATION frames may not grow past this
_CONNECTION_WINDOW = 1 << 30
_HEADER = struct.Struct(">BHBBI")

Headers = list[tuple[bytes, bytes]]


class ProtocolError(ValueError):
    """The peer broke HTTP/2 (RFC 9113 PROTOCOL_ERROR and friends): the connection is dropped."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id) + payload


def settings_frame(**values: int) -> bytes:
    """Our SETTINGS: 2 = ENABLE_PUSH, 3 = MAX_CONCURRENT_STREAMS, 4 = INITIAL_WINDOW_SIZE, 5 = MAX_FRAME_SIZE."""
    keys = {"enable_push": 2, "max_concurrent_streams": 3, "initial_window": 4, "max_frame": 5}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", keys[name], value) for name, value in values.items()))


def open_windows() -> bytes:
    return frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", _CONNECTION_WINDOW - 65535))


class StreamState:
    """The sending side of one stream: its window and what waits for more window."""

    __slots__ = ("id", "window", "unacked", "pending", "end", "trailer")

    def __init__(self, stream_id: int, window: int) -> None:
        self.id = stream_id
        self.window = window
        self.unacked = 0  # received bytes not yet given back with a WINDOW_UPDATE
        self.pending: bytearray | None = None  # DATA bytes waiting for window
        self.end = False  # END_STREAM once pending is out (when there is no trailer)
        self.trailer: bytes | None = None  # a HEADERS frame to send after pending


class Endpoint(asyncio.Protocol):
    expects_preface = False  # the server reads the client's 24-byte preface first

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closing = False
        self.streams: dict[int, StreamState] = {}
        self.peer_max_streams = 1 << 31
        self._buffer = bytearray()
        self._decoder = Decoder()
        self._send_window = 65535
        self._peer_initial_window = 65535
        self._peer_max_frame = 16384
        self._recv_unacked = 0
        self._blocked: list[StreamState] = []
        self._continuation: tuple[int, int, bytearray] | None = None
        self._preface_seen = not self.expects_preface

    # -- hooks for the role ---------------------------------------------------------------------
    def _on_headers(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        raise NotImplementedError

    def _on_data(self, stream: StreamState, payload: bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def _on_reset(self, stream: StreamState, code: int) -> None:
        raise NotImplementedError

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        raise NotImplementedError

    def _on_settings(self) -> None:
        """The peer's SETTINGS were applied (a role may have waiters to wake)."""

    def _on_flushed(self, stream: StreamState) -> None:
        """Everything queued on ``stream`` went out."""

    def _protocol_error(self, reason: str) -> None:
        raise NotImplementedError

    # -- frames in ------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos, size = 0, len(buffer)
        try:
            if not self._preface_seen:
                if size < len(PREFACE):
                    return
                if buffer[:len(PREFACE)] != PREFACE:
                    raise ProtocolError("not an HTTP/2 connection preface")
                pos, self._preface_seen = len(PREFACE), True
            while size - pos >= 9:
                high, low, kind, flags, stream_id = _HEADER.unpack_from(buffer, pos)
                length = high << 16 | low
                end = pos + 9 + length
                if end > size:
                    if length > MAX_FRAME:
                        raise ProtocolError(f"a {length}-byte frame is above our SETTINGS_MAX_FRAME_SIZE")
                    break
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, bytes(buffer[pos + 9:end]))
                pos = end
        except (ValueError, struct.error, IndexError) as exc:  # ProtocolError, HpackError, a bad header value
            self._protocol_error(f"unreadable HTTP/2: {exc}")
            return
        del buffer[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise ProtocolError("header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._on_headers(stream_id, self._decoder.decode(payload), bool(flags & END_STREAM))
            else:
                self._continuation = (stream_id, flags, bytearray(payload))
        elif kind == CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise ProtocolError("unexpected CONTINUATION")
            self._continuation[2].extend(payload)
            if len(self._continuation[2]) > MAX_HEADER_BLOCK:
                raise ProtocolError(f"a header block above {MAX_HEADER_BLOCK} bytes")
            if flags & END_HEADERS:
                _, first_flags, block = self._continuation
                self._continuation = None
                self._on_headers(stream_id, self._decoder.decode(bytes(block)), bool(first_flags & END_STREAM))
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
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if (stream := self.streams.get(stream_id)) is not None:
                self._on_reset(stream, int.from_bytes(payload[:4], "big"))
        elif kind == GOAWAY:
            self._on_goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF, int.from_bytes(payload[4:8], "big"))
        # PRIORITY, PUSH_PROMISE (refused in our SETTINGS) and unknown frame types are ignored

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        length = len(payload)
        self._recv_unacked += length
        if self._recv_unacked > _CONNECTION_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_unacked)))
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream already finished or reset; its data still counted for the connection
        if flags & PADDED:
            payload = payload[1:length - payload[0]]
        end_stream = bool(flags & END_STREAM)
        if not end_stream:
            stream.unacked += length
            if stream.unacked > RECEIVE_WINDOW // 2:
                self.write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.unacked)))
                stream.unacked = 0
        self._on_data(stream, payload, end_stream)

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 3:
                self.peer_max_streams = value
            elif key == 4:
                if value > 0x7FFFFFFF:
                    raise ProtocolError(f"SETTINGS_INITIAL_WINDOW_SIZE {value} is above 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.window += delta
            elif key == 5:
                if not 16384 <= value <= 0xFFFFFF:
                    raise ProtocolError(f"SETTINGS_MAX_FRAME_SIZE {value} is outside 16384..2^24-1")
                self._peer_max_frame = value
        self.write(frame(SETTINGS, ACK, 0))
        self._on_settings()
        if self._blocked:
            self._flush_blocked()

    # -- frames out -----------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def headers_frames(self, stream_id: int, block: bytes, end_stream: bool = False) -> bytes:
        """HEADERS, split into CONTINUATION frames when the block is above the peer's frame size."""
        flags = END_STREAM if end_stream else 0
        max_frame = self._peer_max_frame
        if len(block) <= max_frame:
            return frame(HEADERS, flags | END_HEADERS, stream_id, block)
        pieces = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
        return frame(HEADERS, flags, stream_id, pieces[0]) + b"".join(
            frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, stream_id, piece)
            for i, piece in enumerate(pieces[1:], 1))

    def send(self, stream: StreamState, data: bytes, end: bool = False, trailer: bytes | None = None,
             before: bytes = b"") -> None:
        """``before`` (e.g. HEADERS), DATA ``data``, then ``trailer`` (a HEADERS frame that ends
        the stream) or END_STREAM: in one write when the windows allow, else as they open."""
        size = len(data)
        if stream.pending is None and size <= self._peer_max_frame and size <= self._send_window \
                and size <= stream.window:
            self._send_window -= size
            stream.window -= size
            flags = END_STREAM if end and trailer is None else 0
            out = before + frame(DATA, flags, stream.id, data) if size or flags else before
            self.write(out + trailer if trailer is not None else out)
            return
        if before:
            self.write(before)
        if stream.pending is None:
            stream.pending = bytearray()
            self._blocked.append(stream)
        stream.pending += data
        stream.end = stream.end or end
        stream.trailer = trailer if trailer is not None else stream.trailer
        self._flush_blocked()

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked):
            pending = stream.pending
            assert pending is not None
            ended = False
            while pending:
                size = min(len(pending), self._peer_max_frame, self._send_window, stream.window)
                if size <= 0:
                    break
                flags = END_STREAM if size == len(pending) and stream.end and stream.trailer is None else 0
                self.write(frame(DATA, flags, stream.id, bytes(pending[:size])))
                del pending[:size]
                self._send_window -= size
                stream.window -= size
                ended = bool(flags)
            if pending:
                continue
            self._blocked.remove(stream)
            stream.pending = None
            if stream.trailer is not None:
                trailer, stream.trailer = stream.trailer, None
                self.write(trailer)
            elif stream.end and not ended:
                self.write(frame(DATA, END_STREAM, stream.id))
            self._on_flushed(stream)

    def drop_pending(self, stream: StreamState) -> None:
        if stream.pending is not None:
            stream.pending = None
            self._blocked.remove(stream)

    def reset(self, stream: StreamState, code: int = CANCEL) -> None:
        self.write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", code)))
