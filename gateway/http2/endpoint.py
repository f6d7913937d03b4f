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
from typing import TypeVar

from gateway.batched_transport import BatchedTransport
from gateway.http2.hpack_codec import Decoder, HeaderListTooLarge, HpackError
from gateway.http2.queued import JOIN_BELOW, Payload, Queued

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY_FRAME, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR = 0x5, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB
MAX_FRAME = 1 << 20  # what the upstream client accepts (SETTINGS_MAX_FRAME_SIZE)
MAX_HEADER_BLOCK = 1 << 20  # a header block spread over CONTINUATION frames may not grow past this
MAX_WINDOW = 0x7FFFFFFF
_CONNECTION_WINDOW = 1 << 30
_HEADER = struct.Struct(">BHBBI")
_UNLIMITED = 1 << 62

Headers = list[tuple[bytes, bytes]]
_Payload = TypeVar("_Payload", bytes, memoryview)


class ProtocolError(ValueError):
    """The peer broke HTTP/2: a connection error (RFC 9113 5.4.1), GOAWAY with ``code``, then the close."""

    def __init__(self, reason: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id) + payload


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """A frame's 9-byte header alone: its payload goes out as it is, after it."""
    return _HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


_SETTING_KEYS = {"header_table_size": 1, "enable_push": 2, "max_concurrent_streams": 3, "initial_window": 4,
                 "max_frame": 5, "max_header_list": 6}


def settings_frame(**values: int) -> bytes:
    """Our SETTINGS, by name: ``enable_push``, ``max_concurrent_streams``, ``initial_window``, ``max_frame``,
    ``max_header_list``, ``header_table_size``."""
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", _SETTING_KEYS[name], value)
                                          for name, value in values.items()))


def open_windows(size: int = _CONNECTION_WINDOW) -> bytes:
    """Raise the connection's receive window from the RFC's 65,535 to ``size``."""
    return frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", size - 65535)) if size > 65535 else b""


def unpad(payload: _Payload) -> _Payload:
    """A PADDED frame's content; padding as long as the payload is a PROTOCOL_ERROR (RFC 9113 6.1)."""
    if not payload or payload[0] >= len(payload):
        raise ProtocolError("padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


class StreamState:
    """The sending side of one stream: its window and what waits for more window; and whether
    the receiving side gives the peer credit."""

    __slots__ = ("id", "window", "unacked", "pending", "end", "trailer", "held")

    def __init__(self, stream_id: int, window: int) -> None:
        self.id = stream_id
        self.window = window
        self.unacked = 0  # received bytes not yet given back with a WINDOW_UPDATE
        self.held = False  # what was received waits on the far side: no stream credit goes back (the roles' hold)
        self.pending: Queued | None = None  # DATA bytes waiting for window
        self.end = False  # END_STREAM once pending is out (when there is no trailer)
        self.trailer: bytes | None = None  # a HEADERS frame to send after pending


class Endpoint(asyncio.Protocol):
    """Frames in, checked as RFC 9113 says, and frames out within the peer's windows.

    Every check is O(1) per frame. Floods of control frames are counted in per-connection
    counters that the server role clears once a second (``_calm_*`` limits); the client role,
    which talks to Triton only, keeps them unlimited.
    """

    expects_preface = False  # the server reads the client's 24-byte preface first
    frames_per_slice = _UNLIMITED  # frames read in one go before other connections get the loop

    def __init__(self, max_frame: int = MAX_FRAME, max_header_block: int = MAX_HEADER_BLOCK,
                 max_header_list: int = _UNLIMITED) -> None:
        self.transport: BatchedTransport | None = None
        self.closing = False
        self.reading = True  # False: frames stay in the buffer (paused for backpressure, or closed)
        self.streams: dict[int, StreamState] = {}
        self.peer_max_streams = 1 << 31
        self.max_frame = max_frame  # what we accept
        self.max_header_block = max_header_block
        self._buffer = bytearray()
        self._decoder = Decoder(max_list_size=max_header_list)
        self._send_window = 65535
        self._peer_initial_window = 65535
        self._peer_max_frame = 16384
        self._recv_unacked = 0
        self._blocked: list[StreamState] = []
        self._continuation: tuple[int, int, bytearray] | None = None
        self._preface_seen = not self.expects_preface
        # a DATA frame whose payload goes on past a read: what is left of it, where it goes, its END_STREAM
        self._data_left = 0
        self._data_into: StreamState | None = None
        self._data_end = False
        # flood counters (cleared by the server's tick) and their limits
        self._pings = self._settings_frames = self._empty_frames = self._resets = 0
        self._calm_pings = self._calm_settings = self._calm_empty = self._calm_resets = _UNLIMITED

    # -- hooks for the role ---------------------------------------------------------------------
    def _on_headers(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        raise NotImplementedError

    def _on_data(self, stream: StreamState, payload: memoryview, end_stream: bool) -> None:
        """Payload of a DATA frame for ``stream``: a view of what was read (a whole frame's, or part
        of one that spans reads), valid as long as it is referenced; ``end_stream`` on the last."""
        raise NotImplementedError

    def _on_reset(self, stream: StreamState, code: int) -> None:
        raise NotImplementedError

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        raise NotImplementedError

    def _on_settings(self) -> None:
        """The peer's SETTINGS were applied (a role may have waiters to wake)."""

    def _on_settings_ack(self) -> None:
        """The peer acknowledged one of our SETTINGS frames (the client role's keepalive)."""

    def _on_flushed(self, stream: StreamState) -> None:
        """Everything queued on ``stream`` went out."""

    def _on_drained(self, stream: StreamState) -> None:
        """Part of what is queued on ``stream`` went out; the rest still waits for window."""

    def _on_blocked(self, stream: StreamState) -> None:
        """``stream`` has DATA waiting for window (it was sending all it had)."""

    def _on_header_list_too_large(self, stream_id: int, end_stream: bool, error: HeaderListTooLarge) -> None:
        raise ProtocolError(str(error), ENHANCE_YOUR_CALM)

    def _on_stream_error(self, stream: StreamState, code: int) -> None:
        """We reset ``stream`` for breaking the protocol: the role forgets it."""

    def _unknown_stream(self, kind: int, stream_id: int) -> None:
        """A frame other than HEADERS for a stream not in ``streams``: the client role ignores it
        (a call it already finished); the server tells idle streams from closed ones."""

    def _connection_error(self, code: int, reason: str) -> None:
        raise NotImplementedError

    def _yield_reading(self) -> None:
        """``frames_per_slice`` frames were read in one go: the rest wait for the next slice."""

    def _block_begun(self) -> None:
        """A header block goes on in CONTINUATION frames (the server bounds how long it may take)."""

    # -- frames in ------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Frames are read straight out of ``data``: a DATA payload is handed on as a memoryview
        of it (never copied here), and a DATA frame that goes on past this read is handed on
        piece by piece as its bytes arrive (``_data_piece``). Only the beginning of another kind
        of frame (a header, a header block) waits in ``_buffer`` for the next read."""
        buffer = self._buffer
        if buffer:  # a frame's beginning, or what waited while reading was paused: joined (small, or rare)
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        if not self.reading:  # paused, or stopped after a connection error
            buffer += data
            return
        view = memoryview(data)
        pos, size = 0, len(view)
        try:
            if not self._preface_seen:
                if size < len(PREFACE):
                    if data != PREFACE[:size]:
                        raise ProtocolError("not an HTTP/2 connection preface")
                    buffer += data
                    return
                if data[:len(PREFACE)] != PREFACE:
                    raise ProtocolError("not an HTTP/2 connection preface")
                pos, self._preface_seen = len(PREFACE), True
            left = self._data_left
            if left:  # the rest of a DATA frame begun in an earlier read
                take = left if left <= size else size
                self._data_left = left - take
                self._data_piece(view[:take], take == left)
                pos = take
            budget = self.frames_per_slice
            while size - pos >= 9 and self.reading:
                if not budget:
                    self._yield_reading()
                    break
                budget -= 1
                high, low, kind, flags, stream_id = _HEADER.unpack_from(view, pos)
                length = high << 16 | low
                if length > self.max_frame:
                    raise ProtocolError(f"a {length}-byte frame is above our SETTINGS_MAX_FRAME_SIZE", FRAME_SIZE_ERROR)
                if length > self.max_header_block and (kind == HEADERS or kind == CONTINUATION):
                    # refused by its size before a byte of it is read, let alone decoded (HPACK bomb)
                    raise ProtocolError(f"a {length}-byte header block is above {self.max_header_block}",
                                        ENHANCE_YOUR_CALM)
                end = pos + 9 + length
                if end > size:
                    if kind != DATA or flags & PADDED:
                        break  # waits in the buffer for the rest
                    # a DATA frame going on past this read: checked now on its whole length, handed on as it comes
                    self._split_data(flags, stream_id & 0x7FFFFFFF, length, view[pos + 9:])
                    pos = size
                    break
                if kind == DATA:
                    self._frame_data(flags, stream_id & 0x7FFFFFFF, view[pos + 9:end])
                else:
                    self._frame(kind, flags, stream_id & 0x7FFFFFFF, bytes(view[pos + 9:end]))
                pos = end
        except ProtocolError as exc:
            self._connection_error(exc.code, str(exc))
            return
        except HpackError as exc:
            self._connection_error(COMPRESSION_ERROR, f"unreadable header block: {exc}")
            return
        except (ValueError, struct.error, IndexError) as exc:  # a bad header value, a truncated field
            self._connection_error(PROTOCOL_ERROR, f"unreadable HTTP/2: {exc}")
            return
        if pos < size:
            buffer += view[pos:]

    def _frame_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        """A whole DATA frame."""
        if self._continuation is not None:
            raise ProtocolError("header block interrupted")
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        if not payload and not flags & END_STREAM:
            self._count_empty()
        self._data(flags, stream_id, payload)

    def _split_data(self, flags: int, stream_id: int, length: int, first: memoryview) -> None:
        """A DATA frame (not padded) of which ``first`` arrived: the rest comes in later reads."""
        if self._continuation is not None:
            raise ProtocolError("header block interrupted")
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        self._data_head(flags, stream_id, length)
        self._data_target(stream_id, length)
        self._data_left = length - len(first)
        self._data_piece(first, False)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and (kind != CONTINUATION or stream_id != self._continuation[0]):
            raise ProtocolError("header block interrupted")
        if kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            continuation = self._continuation
            if continuation is None:
                raise ProtocolError("CONTINUATION without a header block to continue")
            block = continuation[2]
            block += payload
            if len(block) > self.max_header_block:
                raise ProtocolError(f"a header block above {self.max_header_block} bytes", ENHANCE_YOUR_CALM)
            if flags & END_HEADERS:
                self._continuation = None
                self._header_block(stream_id, bool(continuation[1] & END_STREAM), bytes(block))
            elif not payload:
                self._count_empty()
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            if stream_id:
                raise ProtocolError("SETTINGS on a stream")
            if flags & ACK:
                if payload:
                    raise ProtocolError("SETTINGS ACK with a payload", FRAME_SIZE_ERROR)
                self._on_settings_ack()
                return
            if len(payload) % 6:
                raise ProtocolError("SETTINGS length is not a multiple of 6", FRAME_SIZE_ERROR)
            self._settings_frames += 1
            if self._settings_frames > self._calm_settings:
                raise ProtocolError("too many SETTINGS frames", ENHANCE_YOUR_CALM)
            self._settings(payload)
        elif kind == PING:
            if stream_id:
                raise ProtocolError("PING on a stream")
            if len(payload) != 8:
                raise ProtocolError("PING of a length other than 8", FRAME_SIZE_ERROR)
            if not flags & ACK:
                self._pings += 1
                if self._pings > self._calm_pings:
                    raise ProtocolError("too many PINGs", ENHANCE_YOUR_CALM)
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if stream_id == 0:
                raise ProtocolError("RST_STREAM on stream 0")
            if len(payload) != 4:
                raise ProtocolError("RST_STREAM of a length other than 4", FRAME_SIZE_ERROR)
            if (stream := self.streams.get(stream_id)) is not None:
                self._on_reset(stream, int.from_bytes(payload, "big"))  # the server role counts them
            else:
                self._unknown_stream(kind, stream_id)
        elif kind == PRIORITY_FRAME:
            if stream_id == 0:
                raise ProtocolError("PRIORITY on stream 0")
            self._count_empty()  # it asks nothing of us: as cheap to flood as an empty frame
            if len(payload) != 5:
                self.stream_error(stream_id, FRAME_SIZE_ERROR)
            elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                self.stream_error(stream_id, PROTOCOL_ERROR)  # a stream cannot depend on itself
        elif kind == GOAWAY:
            if stream_id:
                raise ProtocolError("GOAWAY on a stream")
            if len(payload) < 8:
                raise ProtocolError("GOAWAY shorter than 8 bytes", FRAME_SIZE_ERROR)
            self._on_goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF, int.from_bytes(payload[4:8], "big"))
        elif kind == PUSH_PROMISE:
            raise ProtocolError("PUSH_PROMISE: push is disabled (and clients cannot push)")
        else:
            self._count_empty()  # unknown frame types are ignored (RFC 9113 4.1), but not without limit

    def _count_empty(self) -> None:
        self._empty_frames += 1
        if self._empty_frames > self._calm_empty:
            raise ProtocolError("too many empty frames", ENHANCE_YOUR_CALM)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("HEADERS on stream 0")
        if flags & PADDED:
            payload = unpad(payload)
        if flags & PRIORITY:
            if len(payload) < 5:
                raise ProtocolError("HEADERS too short for its priority fields", FRAME_SIZE_ERROR)
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                # a stream cannot depend on itself; a connection error, as skipping the block would
                # leave our HPACK table out of step with the client's
                raise ProtocolError("HEADERS that depend on their own stream")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, bool(flags & END_STREAM), payload)
        else:
            if not payload:
                self._count_empty()
            self._continuation = (stream_id, flags, bytearray(payload))
            self._block_begun()

    def _header_block(self, stream_id: int, end_stream: bool, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except HeaderListTooLarge as exc:
            self._on_header_list_too_large(stream_id, end_stream, exc)
            return
        self._on_headers(stream_id, headers, end_stream)

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("WINDOW_UPDATE of a length other than 4", FRAME_SIZE_ERROR)
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError("WINDOW_UPDATE with a zero increment")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError("connection window above 2^31-1", FLOW_CONTROL_ERROR)
        elif (stream := self.streams.get(stream_id)) is None:
            self._unknown_stream(WINDOW_UPDATE, stream_id)
            if increment == 0:  # on a closed stream too: the peer is broken, and says so cheaply
                self.stream_error(stream_id, PROTOCOL_ERROR)
            return
        elif increment == 0:
            self.stream_error(stream_id, PROTOCOL_ERROR)
            return
        else:
            stream.window += increment
            if stream.window > MAX_WINDOW:
                self.stream_error(stream_id, FLOW_CONTROL_ERROR)
                return
        if self._blocked:
            self._flush_blocked()

    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        """A whole DATA frame: flow control on its length, padding off, then its payload (both roles)."""
        length = len(payload)
        self._data_head(flags, stream_id, length)
        if flags & PADDED:
            payload = unpad(payload)  # a bad pad length is a connection error, whatever the stream's state
        self._data_target(stream_id, length)
        self._data_piece(payload, True)

    def _data_head(self, flags: int, stream_id: int, length: int) -> None:
        """A DATA frame of ``length`` bytes begins, its payload to follow (``_data_piece``). The
        client role: connection credit goes back on receipt (each stream's window bounds what
        Triton may send it: ``client_connection``)."""
        self._data_end = bool(flags & END_STREAM)
        self._recv_unacked += length
        if self._recv_unacked > _CONNECTION_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_unacked)))
            self._recv_unacked = 0

    def _data_target(self, stream_id: int, length: int) -> None:
        """The stream the DATA frame's payload goes to (``_data_into``), or none: it is dropped;
        and the stream's flow control (each role its own)."""
        raise NotImplementedError

    def _data_piece(self, payload: memoryview, last: bool) -> None:
        """Part of the DATA frame's payload (``last``: its end); a view of what was read, not a copy."""
        stream = self._data_into
        if stream is None:
            return
        if last:
            self._data_into = None
        self._on_data(stream, payload, last and self._data_end)

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 2:
                if value > 1:
                    raise ProtocolError(f"SETTINGS_ENABLE_PUSH {value} is neither 0 nor 1")
            elif key == 3:
                self.peer_max_streams = value
            elif key == 4:
                if value > MAX_WINDOW:
                    raise ProtocolError(f"SETTINGS_INITIAL_WINDOW_SIZE {value} is above 2^31-1", FLOW_CONTROL_ERROR)
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.window += delta
                    if stream.window > MAX_WINDOW:
                        raise ProtocolError("a stream window above 2^31-1", FLOW_CONTROL_ERROR)
            elif key == 5:
                if not 16384 <= value <= 0xFFFFFF:
                    raise ProtocolError(f"SETTINGS_MAX_FRAME_SIZE {value} is outside 16384..2^24-1")
                self._peer_max_frame = value
        self.write(frame(SETTINGS, ACK, 0))
        self._on_settings()
        if self._blocked:
            self._flush_blocked()

    def stream_error(self, stream_id: int, code: int) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM, and the stream is forgotten."""
        self._resets += 1
        if self._resets > self._calm_resets:  # resets we are made to send count too
            raise ProtocolError("too many stream errors", ENHANCE_YOUR_CALM)
        self.write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
        if (stream := self.streams.get(stream_id)) is not None:
            self._on_stream_error(stream, code)

    # -- frames out -----------------------------------------------------------------------------
    def attach(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection's transport (``connection_made``), writes batched per loop iteration."""
        self.transport = BatchedTransport(transport, asyncio.get_running_loop())  # type: ignore[arg-type]

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)  # which drops it once shut (a lingering close)

    def flush_alone(self, open_streams: int) -> None:
        """This turn's writes go out now, not on the loop's next turn, when at most ``open_streams``
        streams are open (the call that wrote, alone on its connection): no other call's frames
        would join them, and the next turn costs an epoll and a callback per call (at c=1, two per
        call: 4 epoll_pwait per call, 2 after)."""
        if len(self.streams) <= open_streams and self.transport is not None:
            self.transport.flush()

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

    def send(self, stream: StreamState, data: Payload, end: bool = False, trailer: bytes | None = None,
             before: bytes = b"") -> None:
        """``before`` (e.g. HEADERS), DATA ``data``, then ``trailer`` (a HEADERS frame that ends
        the stream) or END_STREAM: in one write when the windows allow, else as they open. A
        large payload goes out as views of the parts it was given in (each DATA frame a header
        and slices of them), never copied into one buffer here."""
        if isinstance(data, tuple):
            size = sum(len(part) for part in data)
            if size < JOIN_BELOW:
                data, size = b"".join(data), size
        else:
            size = len(data)
        if stream.pending is None and size <= self._peer_max_frame and size <= self._send_window \
                and size <= stream.window:
            self._send_window -= size
            stream.window -= size
            flags = END_STREAM if end and trailer is None else 0
            if size >= JOIN_BELOW:  # one DATA frame, its payload as given
                self.write(before + frame_head(DATA, flags, stream.id, size))
                for part in data if isinstance(data, tuple) else (data,):
                    self.write(part)
                if trailer is not None:
                    self.write(trailer)
                return
            assert not isinstance(data, tuple)
            out = before + frame_head(DATA, flags, stream.id, size) + data if size or flags else before
            self.write(out + trailer if trailer is not None else out)
            return
        if before:
            self.write(before)
        if stream.pending is None:
            stream.pending = Queued()
            self._blocked.append(stream)
            self._on_blocked(stream)
        stream.pending.add(data)
        stream.end = stream.end or end
        stream.trailer = trailer if trailer is not None else stream.trailer
        self._flush_blocked()

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked):
            pending = stream.pending
            assert pending is not None
            ended = False
            queued = len(pending)
            while pending:
                size = min(len(pending), self._peer_max_frame, self._send_window, stream.window)
                if size <= 0:
                    break
                flags = END_STREAM if size == len(pending) and stream.end and stream.trailer is None else 0
                self.write(frame_head(DATA, flags, stream.id, size))
                for part in pending.take(size):
                    self.write(part)
                self._send_window -= size
                stream.window -= size
                ended = bool(flags)
            if pending:
                if len(pending) < queued:  # the others go first next time: none starves behind a busy one
                    self._blocked.remove(stream)
                    self._blocked.append(stream)
                    self._on_drained(stream)
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
