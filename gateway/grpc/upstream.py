"""gRPC calls to Triton over our own HTTP/2 connection (``grpc.client_connection``).

Why not ``grpc.aio``'s channel for these: the proxy has the request and the response as raw
bytes already, and grpc.aio's client spends its CPU on call objects, metadata conversion and
a poller thread handing each completion to the event loop. Measured with h2load at
concurrency 32 on the 2-core dev machine, the whole gRPC proxy went from 550-610 µs of CPU
per ``ModelInfer`` to 455-460 µs when only its upstream client changed to this one. Each
call is one stream on one long-lived multiplexed connection, written with one ``write()``;
a header block is built from cached pieces (per path, per distinct metadata). Connection
failures come back from ``unary`` as ``UNAVAILABLE`` the way grpcio reports them (a status is
data the client gets), and are raised as ``UpstreamUnavailable`` by ``open``; the connection
is reopened on the next call. A unary call the client gave no deadline gets
``request_timeout_s`` (sent as ``grpc-timeout``, and enforced by the connection's tick), so a
hung Triton cannot hold it for ever; streams get none (they are long-lived: keepalive PINGs
find a dead server under them). ``open`` starts a streaming call (``ModelStreamInfer`` behind either
gRPC server: ours, or grpcio's).

A unary call's deadline goes to Triton no shorter than ``deadline_floor_s``; a shorter
one the client set is enforced by the caller (the front answers DEADLINE_EXCEEDED). And no
call is ever reset for its caller's sake: a call whose caller goes away (a client's reset or
disconnect, its deadline, a malformed message on a stream) is left to finish on Triton, its
answers dropped, a stream's requests ended (``Http2Connection.leave``).
The Triton this project runs segfaults when its own gRPC deadline handling races the
response: calls with a 1 ms ``grpc-timeout`` killed it within 20-300 calls, sent straight
to it (triton-inference-server/server#7368, fixed by #7840 in r24.12). Resets reach its
cancellation race (#8034, fixed by #8078 in r25.04): measured against the sample models,
unary calls reset 0-4 ms after they were sent killed it within 320-2,100 calls, and
ModelStreamInfer streams reset after or between a decoupled model's replies within 5-540
streams, sent straight to it or passed on by the gateway from its clients (either gRPC
front), while the same streams half-closed instead survived 6,000, and calls reset or timed
out in the middle of a model's work survived 360 each. Forwarded as is, one client's tiny
deadlines or resets would take Triton down for everyone.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import ssl

from gateway.errors import UpstreamUnavailable, os_reason
from gateway.grpc.client_connection import (
    GOING_AWAY,
    NOT_CONNECTED,
    Http2Connection,
    Slot,
    StreamListener,
    _Call,
)
from gateway.grpc.reply import Reply
from gateway.grpc.status import StatusCode
from gateway.grpc.wire import Message
from gateway.http2.hpack_codec import literal, literal_indexed_name
from gateway.sequences import SequenceFields
from gateway.upstream import NotesServer

__all__ = ["GrpcUpstream", "Reply", "Slot", "StreamListener", "UpstreamStream", "grpc_timeout"]
_METADATA_CACHE_LIMIT = 1024
_METADATA_CACHE_ENTRY = 1024  # larger metadata is encoded per call: the cache stays under ~2 MB
_PREFIX_CACHE_LIMIT = 256  # distinct paths (clients choose them: pass-through methods)
TRITON_DEADLINE_FLOOR_S = 1.0  # the shortest grpc-timeout Triton is sent on a unary call (see above)
LEAVE_WITHIN_S = 60.0  # a left call's bound when there is no request_timeout_s
# Client metadata: (str, str | bytes) pairs from grpcio, or (bytes, bytes) wire pairs from our server.
Metadata = tuple[tuple[str | bytes, str | bytes], ...]


def grpc_timeout(seconds: float) -> bytes:
    """The ``grpc-timeout`` header value: at most 8 digits and a unit."""
    micros = max(int(seconds * 1e6), 1)
    if micros < 100_000_000:
        return b"%du" % micros
    millis = micros // 1000
    return b"%dm" % millis if millis < 100_000_000 else b"%dS" % min(millis // 1000, 99_999_999)


class GrpcUpstream:
    """Unary calls over one multiplexed HTTP/2 connection, reopened when it goes away."""

    chooses_server = False  # one server: a call's model and version choose nothing (see FleetGrpc)

    def __init__(self, address: str, connect_timeout: float = 2.0, tls: ssl.SSLContext | None = None, *,
                 request_timeout_s: float | None = None, keepalive_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0, deadline_floor_s: float = TRITON_DEADLINE_FLOOR_S) -> None:
        secure = address.startswith("grpcs://")
        address = address.removeprefix("grpcs://" if secure else "grpc://")
        if secure and tls is None:  # verified against the system's trust store
            tls = ssl.create_default_context()
            tls.set_alpn_protocols(["h2"])
        self.tls = tls if secure else None  # one fleet may mix grpcs:// and plain servers
        self.address = address
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]") or "127.0.0.1", int(port)
        self.connect_timeout = connect_timeout
        self.request_timeout_s = request_timeout_s  # a unary call's deadline when its client set none
        self.deadline_floor_s = deadline_floor_s  # the shortest grpc-timeout sent on a unary call
        self._default_timeout = b"" if request_timeout_s is None else literal(b"grpc-timeout",
                                                                              grpc_timeout(request_timeout_s))
        self.keepalive = (keepalive_s, keepalive_timeout_s)
        # how long a call its caller left may go on upstream before it is reset after all
        self.leave_within_s = request_timeout_s or LEAVE_WITHIN_S
        self._authority = literal_indexed_name(1, address.encode())
        self._post_scheme = b"\x83\x87" if tls is not None else b"\x83\x86"  # HPACK static 3, then 7 or 6
        self._prefix: dict[str, bytes] = {}
        self._metadata: dict[Metadata, bytes] = {}
        self._connection: Http2Connection | None = None
        self._connecting: asyncio.Task[Http2Connection] | None = None

    def header_block(self, path: str, metadata: Metadata,
                     timeout: float | None) -> bytes:
        prefix = self._prefix.get(path)
        if prefix is None:  # :method POST, :scheme http(s), :path, :authority, content-type, te
            if len(self._prefix) >= _PREFIX_CACHE_LIMIT:
                self._prefix.clear()
            prefix = self._prefix[path] = (self._post_scheme + literal_indexed_name(4, path.encode()) + self._authority
                                           + literal_indexed_name(31, b"application/grpc")
                                           + literal(b"te", b"trailers"))
        extra = self._metadata.get(metadata)
        if extra is None:
            extra = b"".join(_metadata_field(key, value) for key, value in metadata)
            if len(extra) <= _METADATA_CACHE_ENTRY:
                if len(self._metadata) >= _METADATA_CACHE_LIMIT:
                    self._metadata.clear()
                self._metadata[metadata] = extra
        if timeout is not None:
            return prefix + extra + literal(b"grpc-timeout", grpc_timeout(timeout))
        return prefix + extra + self._default_timeout

    async def unary(self, path: str, message: Message, metadata: Metadata = (),
                    timeout: float | None = None, *, model: str | bytes = "", version: str | bytes | None = None,
                    sequence: SequenceFields | None = None, for_exchange: NotesServer | None = None,
                    slot: Slot | None = None) -> Reply:
        """``model``, ``version``, ``sequence``: what the front read of the message, for a fleet's
        choice of server (``grpc.fleet_upstream``), noted on ``for_exchange``; one server has nothing
        to choose. ``slot``: the admission slot the call holds on this server (a fleet's), given
        back as the call ends on the connection, or on the way out."""
        # A deadline below the floor: Triton is told the floor (see the module's docstring).
        if timeout is not None and timeout < self.deadline_floor_s:
            timeout = self.deadline_floor_s
        block = self.header_block(path, metadata, timeout)
        if timeout is None:
            timeout = self.request_timeout_s
        left = False
        try:
            for _attempt in range(2):  # once more if the connection went away before the call started
                try:
                    connection = await self._ready()
                except UpstreamUnavailable as exc:
                    return StatusCode.UNAVAILABLE, exc.message, b""
                if connection.closing:
                    continue
                # (a resend after GOAWAY goes without the slot: the refused call gave it back)
                call = connection.start(block, message, timeout, slot)
                assert call.future is not None
                try:
                    reply = await call.future
                except asyncio.CancelledError:  # the caller gave up: Triton finishes the call, never reset
                    connection.leave(call, self.leave_within_s)
                    left = True
                    raise
                if reply[0] == StatusCode.UNAVAILABLE and reply[1].startswith(GOING_AWAY):
                    continue  # never processed upstream (its id was above GOAWAY's last stream): safe to resend
                return reply
            return StatusCode.UNAVAILABLE, f"{GOING_AWAY}: it keeps closing the connection", b""
        finally:
            if slot is not None and not left:  # a call left to Triton gives its slot back as it ends there
                slot.release()  # nothing if the call's end gave it back already

    async def open(self, path: str, listener: StreamListener, metadata: Metadata = (),
                   timeout: float | None = None) -> UpstreamStream:
        """A streaming call: the listener hears the reply's frames. UpstreamUnavailable if none could start."""
        connection = await self._ready()
        if connection.closing:
            raise UpstreamUnavailable(f"{GOING_AWAY}: it is closing the connection")
        return UpstreamStream(connection, connection.open(self.header_block(path, metadata, timeout), listener),
                              self.leave_within_s)

    async def _ready(self) -> Http2Connection:
        """The open connection, with room for one more stream; UpstreamUnavailable if none can be opened."""
        connection = self._connection
        if connection is None or connection.closing:
            try:
                connection = await self._connect()
            except OSError as exc:
                raise UpstreamUnavailable(f"{NOT_CONNECTED}: {os_reason(exc)}") from exc
        while connection.full and not connection.closing:
            await connection.room()
        return connection

    async def _connect(self) -> Http2Connection:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        task = self._connecting
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _open(self) -> Http2Connection:
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: Http2Connection(closed, *self.keepalive), self.host, self.port,
                                       ssl=self.tls),
                self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, f"no connection within {self.connect_timeout:g} s") from None
        self._connection = protocol
        return protocol

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.transport is not None:
            connection.closing = True
            connection.transport.close()
            await connection.on_close


class UpstreamStream:
    """One open streaming call: send request messages, end them, or cancel the call (for its
    caller: upstream, it is left to finish, never reset)."""

    __slots__ = ("connection", "call", "leave_within_s")

    def __init__(self, connection: Http2Connection, call: _Call, leave_within_s: float = LEAVE_WITHIN_S) -> None:
        self.connection = connection
        self.call = call
        self.leave_within_s = leave_within_s

    def send(self, message: Message) -> None:
        self.connection.send_message(self.call, message)

    @property
    def backlog(self) -> int:
        """Bytes sent but not yet taken by the upstream (waiting for its flow-control window)."""
        return self.connection.backlog(self.call)

    @property
    def held(self) -> bool:
        return self.call.held

    def hold(self) -> None:
        """Triton's replies wait for the client: no more stream credit until ``release``."""
        self.connection.hold(self.call)

    def release(self) -> None:
        self.connection.release(self.call)

    def end(self) -> None:
        self.connection.end_requests(self.call)

    def cancel(self) -> None:
        self.connection.leave(self.call, self.leave_within_s)


def _metadata_field(key: str | bytes, value: str | bytes) -> bytes:
    if isinstance(key, bytes):  # straight from an HTTP/2 client: already in wire form (-bin values base64)
        return literal(key, value if isinstance(value, bytes) else value.encode())
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return literal(key.encode(), base64.b64encode(raw).rstrip(b"="))
    return literal(key.encode(), value.encode() if isinstance(value, str) else value)
