"""What the HTTP/2 server knows of one client request stream, apart from the connection.

The bounds a client connection is held to (``Limits``), the server's state of one request
stream (``ServerStream``), what the protocol on top gives each stream to be told of its
messages, end and reset (``StreamHandler``), and the check of a request's header list
(``read_request``, RFC 9113 8.1.1-8.3.1). ``server.Http2ServerConnection`` runs the
connection's state machine over them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from gateway.http2.endpoint import Headers, StreamState


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client connection may make the server hold or do (the defaults are the settings').

    Windows: a request message must be whole before it can be routed, so the gateway holds
    it while it arrives. A message spread over DATA frames reserves its announced size; the
    connection admits reservations up to one maximum-size message in total (the first always),
    and a stream whose message is not admitted gets no more stream credit until one finishes
    (its upstream call starts, or the stream ends). So one connection holds at most
    ``max_message`` plus one stream window per stream (~128 MiB with the defaults), and honest
    clients sending many large messages at once get them through a few at a time instead of
    stalling. A streaming call whose upstream has not taken what it was handed (its send queue
    is above one stream window: Triton reads slower than the client sends) is held: no stream
    credit, and the reservation of a message handed over stays, until the queue drains. So the
    upstream queues add at most two stream windows per stream. The connection window only
    bounds bytes in flight, so its credit goes back on receipt. 256 KiB per stream and 4 MiB
    per connection keep a fast client streaming on loopback and a LAN, and keep what 256
    stalled streams can make the gateway hold to 64 MiB. Answers the other way: a stream whose
    answers wait for the client (past one stream window queued, or the write buffer past
    ``write_high_water``) has its source paused until they go out (``StreamHandler.on_sent``).
    """

    max_concurrent_streams: int = 256
    stream_window: int = 256 << 10
    connection_window: int = 4 << 20
    max_frame: int = 1 << 20
    max_header_list: int = 16 << 10
    max_message: int = 64 << 20
    max_inflation_ratio: int = 100  # a compressed message inflates to at most this many times its size
    write_high_water: int = 1 << 20  # unread answers past this pause reading from the client
    preface_timeout: float = 10.0
    header_timeout: float = 10.0
    idle_timeout: float = 300.0
    stalled_timeout: float = 30.0  # answers queued for the client, none taken this long: cut (http2.stall)
    max_connections: int = 16384  # client connections of the whole server; the next is refused with GOAWAY
    max_connections_per_client: int = 4096  # from one client address; the next is refused the same way
    # per second; past them: GOAWAY ENHANCE_YOUR_CALM
    pings_per_s: int = 100  # counted between answers only, so a busy client's BDP probes never trip it
    settings_per_s: int = 100
    empty_frames_per_s: int = 200  # empty DATA/CONTINUATION, PRIORITY, unknown types
    resets_per_s: int = 200  # RST_STREAM from the client on streams not answered yet, and stream errors we had to send


class StreamHandler(Protocol):
    streaming: bool  # True: a message handed over is on its way upstream; False: held until END_STREAM

    def on_message(self, message: bytes | bytearray) -> None: ...  # large, spread over frames: a bytearray
    def on_end(self) -> None: ...
    def on_reset(self) -> None: ...
    def on_sent(self) -> None: ...  # answers queued for the client (stream.pending, a full socket) went out


class ServerStream(StreamState):
    __slots__ = ("path", "headers", "pieces", "gathered", "filling", "filled", "fill_compressed", "handler",
                 "responded", "finished", "compression", "recv_window", "reserved", "admitted", "remote_closed",
                 "inflating", "end_pending", "handed", "charged", "moved")

    def __init__(self, stream_id: int, window: int, headers: Headers, path: str, compression: bytes,
                 recv_window: int) -> None:
        super().__init__(stream_id, window)
        self.headers = headers
        self.path = path
        self.compression = compression
        # DATA received and not yet a whole message: views of what was read, copied once when the
        # message they make is whole (the protocol on top reads them; None until a message spans frames)
        self.pieces: deque[memoryview] | None = None
        self.gathered = 0  # bytes in pieces
        self.filling: bytearray | None = None  # a large message spread over frames, in its own buffer as it comes
        self.filled = 0  # bytes of it in
        self.fill_compressed = False
        self.handler: StreamHandler | None = None
        self.responded = False  # response HEADERS sent
        self.finished = False  # status sent
        self.recv_window = recv_window  # what the client may still send on this stream
        self.reserved = 0  # the announced size of the message being assembled or held (see Limits)
        self.admitted = False  # the reservation counts against the connection's; else it waits
        self.remote_closed = False  # the client sent END_STREAM
        self.inflating = False  # a large compressed message is inflated a slice per loop turn
        self.end_pending = False  # END_STREAM arrived while inflating
        # held (StreamState): the upstream has not taken what was handed over: no stream credit (see hold)
        self.handed = False  # the reservation is for a message handed over while held: kept until release
        self.charged = 0  # bytes of the gateway's budget this stream holds besides its reservation (see _charge)
        self.moved = 0  # while DATA is queued for its windows: the tick the client last took some (http2.stall)


_PSEUDO = frozenset([b":method", b":scheme", b":path", b":authority"])
_CONNECTION_SPECIFIC = frozenset([b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                  b"upgrade"])
_LOWERCASE_KNOWN = frozenset([b"content-type", b"te", b"user-agent", b"grpc-timeout", b"grpc-encoding",
                              b"grpc-accept-encoding", b"x-user-id", b"content-length", b"accept-encoding"])


def read_request(headers: Headers, coding: bytes = b"content-encoding") -> tuple[str, bytes] | str:
    """(``:path``, the value of the ``coding`` header: how the request's messages are compressed,
    ``grpc-encoding`` on the gRPC port) of a well-formed request (RFC 9113 8.1.1-8.3.1), else the problem."""
    path = method = scheme = None
    compression = b""
    regular = False
    for name, value in headers:
        if name[:1] == b":":
            if regular:
                return "a pseudo-header after a regular header"
            if name == b":path":
                if path is not None or not value:
                    return "an empty or repeated :path"
                path = value
            elif name == b":method":
                if method is not None:
                    return "a repeated :method"
                method = value
            elif name == b":scheme":
                if scheme is not None:
                    return "a repeated :scheme"
                scheme = value
            elif name not in _PSEUDO:
                return f"pseudo-header {name[:40]!r} in a request"
            continue
        regular = True
        if name not in _LOWERCASE_KNOWN:
            if name != name.lower():
                return "an uppercase header name"
            if name in _CONNECTION_SPECIFIC:
                return f"connection-specific header {name.decode()!r}"
        if name == coding:
            compression = value
        elif name == b"te" and value != b"trailers":
            return "TE other than 'trailers'"
    if path is None or method is None or scheme is None:
        return "a request without :method, :scheme or :path"
    return path.decode("latin-1"), compression
