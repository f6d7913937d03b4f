"""What the HTTP port takes from a client before anything goes to Triton, and within which bounds.

- **Whole bodies first.** A request body that did not arrive with its headers is read to the
  end before an upstream connection is taken, so a client trickling its body holds only its
  own socket and the bytes it sent, never one of the pool's connections (128 such clients
  used to starve every other request, ``/readyz`` included). A body announced at 1 MiB or more
  is read into a buffer of its announced size once 256 KB of it came, charged whole to the
  budget from then on (``http_output.GatewayCycle.rest_of_body``: one copy, no join): such a
  client holds up to ``max_body_bytes`` for 256 KB sent, as a gRPC call reserves its announced
  message from its 5-byte prefix. Time between two pieces of a
  body is bounded by ``body_idle_timeout_s`` in the server protocol (``gateway.server``).
- **Two byte bounds.** One body: ``max_body_bytes`` (64 MiB, Triton's own default
  ``--http-max-input-size``), refused from ``Content-Length`` before a byte is read, or as soon
  as a chunked body passes it: 413. Everything held for requests at once: one ``ByteBudget``
  (``gateway.byte_budget``) of ``max_buffered_body_bytes``, shared by both ports: HTTP bodies,
  gRPC messages while they are assembled, inflated and held for their call, shadow copies,
  and what the gateway inflates itself. Past it a request is answered 503 with ``Retry-After``
  (gRPC: UNAVAILABLE; a shadow copy is dropped): overload, not the client's fault. Every
  charge is released by a ``finally`` (or the owner's end of life), never only on the errors
  somebody thought of.
- **Bounded decompression.** Wherever the gateway itself decompresses a body (sequence
  affinity reads the JSON header; shadow comparison reads outputs), it inflates at most
  ``max_body_bytes`` and at most ``max_inflation_ratio`` times the body's size
  (``byte_budget.inflation_limit``), or only the prefix it needs, always with an explicit bound (zlib reads a
  bound of 0 as "no bound"), one at a time, and charges the result while it keeps it, so a
  gzip bomb costs bounded memory and CPU.
- **URLs Triton reads whole.** Triton 2.51's HTTP server (libevhtp) reads a request 4,096 bytes
  at a time, and when a read ends inside the URL its parser looks at one byte past the read (a
  byte left from an earlier request on the connection) and, if it is a space or a line end,
  closes the connection unanswered; three such closes in a row eject the server from its fleet.
  So a request line that would not end within one such read (``TRITON_MAX_TARGET``: the target
  after the gateway adds ``/versions/{v}``) is never forwarded: 414, whatever ``max_url_bytes``
  lets in.
- **Hop-by-hop headers** (RFC 9110 §7.6.1) are not forwarded either way: the fixed set, and
  whatever a ``Connection`` header names.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol, TypeVar

from gateway.byte_budget import ByteBudget, inflation_limit
from gateway.errors import ClientGone, PayloadTooLarge
from gateway.upstream import Body, named_by_connection

MIB = 1 << 20
# Triton's first read of a request is 4,096 bytes: "OPTIONS " + target + "/versions/" + a 19-digit
# version + " HTTP/1.1\r\n" must end inside it (see above).
TRITON_READ_BYTES = 4096
TRITON_MAX_TARGET = TRITON_READ_BYTES - len("OPTIONS ") - len("/versions/") - 19 - len(" HTTP/1.1\r\n")
Headers = list[tuple[bytes, bytes]]
_Raw = TypeVar("_Raw", bytes, bytearray)  # what inflate was given comes back as it is when not compressed
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
# Never forwarded in a response: hop-by-hop (RFC 9110 §7.6.1) plus Content-Length (re-framed by us).
_COMPRESSED = frozenset([b"gzip", b"deflate"])
HOP_BY_HOP_RESPONSE = frozenset([b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                                 b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
                                 b"content-length"])


class RestOfBody(Protocol):
    """``GatewayCycle.rest_of_body`` (the gateway's HTTP front): what ``receive`` is bound to there."""

    def __call__(self, first: bytes, charge: Callable[[int], None],
                 announced: int | None) -> Awaitable[bytes | bytearray | None]: ...


class BodyReader:
    """Reads request bodies whole, within ``max_body`` each and the shared ``budget`` for all at once.

    The caller releases a body's size (``release``) when its request is over, in a ``finally``
    (the body stays in memory until then, for the fallback and the shadow).
    """

    __slots__ = ("max_body", "budget", "max_inflation_ratio", "_inflating")

    def __init__(self, max_body: int = 64 * MIB, max_buffered: int = 256 * MIB, budget: ByteBudget | None = None,
                 max_inflation_ratio: int = 100) -> None:
        self.max_body = max_body
        self.budget = budget if budget is not None else ByteBudget(max_buffered)
        self.max_inflation_ratio = max_inflation_ratio
        self._inflating = asyncio.Semaphore(1)

    @property
    def held(self) -> int:
        return self.budget.held

    @property
    def max_buffered(self) -> int:
        return self.budget.limit

    async def decoded(self, body: Body, encoding: bytes | None, prefix: int | None = None) -> Body:
        """:func:`inflate` within ``max_body``, off the event loop: inflating 64 MiB takes 0.1-0.8 s
        of CPU here, which would stall every other client. One at a time, so a queue of bombs
        takes one core at most (zlib releases the GIL while it works): what inflates at a time is
        one ``max_body`` at most, whatever the number of requests. The caller charges the result
        while it keeps it (:meth:`ByteBudget.charged`)."""
        if encoding not in _COMPRESSED:
            return body
        limit = inflation_limit(len(body), self.max_body, self.max_inflation_ratio)
        why = "" if limit == self.max_body else \
            f" ({self.max_inflation_ratio} times its {len(body)} bytes: max_inflation_ratio)"
        async with self._inflating:
            return await asyncio.to_thread(_inflated, body, encoding, limit, prefix, why)

    def take(self, size: int) -> None:
        """A body that came whole with its headers is held as well (GatewayBusy if it does not fit)."""
        self.budget.take(size)

    async def read(self, first: bytes, receive: Receive, headers: Headers) -> bytes | bytearray:
        """The whole body, ``first`` being what arrived with the headers: bytes, or (a large one read
        by the gateway's own front) the bytearray it was copied into as it came. Raises
        PayloadTooLarge, GatewayBusy or ClientGone; nothing stays held when it raises."""
        announced = content_length(headers)
        if announced is not None and announced > self.max_body:
            raise PayloadTooLarge(f"request body of {announced} bytes is over the limit of {self.max_body} bytes")
        chunks, size = [first], len(first)
        self._take(size)
        try:
            rest_of_body: RestOfBody | None = getattr(getattr(receive, "__self__", None), "rest_of_body", None)
            if rest_of_body is not None:  # the gateway's own front: the rest in one wake, charged as it comes

                def charge(length: int) -> None:
                    nonlocal size
                    if size + length > self.max_body:
                        raise PayloadTooLarge(f"request body over the limit of {self.max_body} bytes")
                    self._take(length)
                    size += length

                body = await rest_of_body(first, charge, announced)
                if body is None:
                    raise ClientGone("the client closed the connection while sending the body")
                return body
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone("the client closed the connection while sending the body")
                chunk = message.get("body", b"")
                if size + len(chunk) > self.max_body:
                    raise PayloadTooLarge(f"request body over the limit of {self.max_body} bytes")
                self._take(len(chunk))
                size += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)
        except BaseException:
            self.budget.release(size)
            raise

    def release(self, size: int) -> None:
        self.budget.release(size)

    def _take(self, size: int) -> None:
        self.budget.take(size)


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def inflate(body: _Raw, encoding: bytes | None, limit: int, prefix: int | None = None, why: str = "") -> _Raw | bytes:
    """``body`` decoded from its Content-Encoding (gzip, deflate; anything else as is), at most
    ``limit`` bytes of it, else PayloadTooLarge; only the first ``prefix`` bytes when given.
    A corrupt stream raises zlib.error. A ``prefix`` of 0 (or less) means the whole body, as
    Inference-Header-Content-Length 0 does: never zlib's ``max_length=0``, which is no bound."""
    if encoding not in _COMPRESSED:
        return body
    return _inflated(body, encoding, limit, prefix, why)


def _inflated(body: Body, encoding: bytes | None, limit: int, prefix: int | None, why: str) -> bytes:
    inflater = zlib.decompressobj(47 if encoding == b"gzip" else 15)  # 47: gzip or zlib header, detected
    if prefix is not None and 0 < prefix <= limit:
        return inflater.decompress(body, prefix)
    data = inflater.decompress(body, limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"request body decompresses to more than the limit of {limit} bytes{why}")
    return data


def end_to_end(headers: Headers) -> Headers:
    """A response's headers minus the hop-by-hop ones (and Content-Length, which we set).

    Cheap in the usual case: a response carries exactly one of the fixed set (Content-Length or
    Transfer-Encoding), so only when more were dropped can a ``Connection`` header name others.
    """
    kept = []
    for header in headers:  # a loop, not a comprehension: no function object per answer (CPython 3.11)
        if header[0].lower() not in HOP_BY_HOP_RESPONSE:
            kept.append(header)
    if len(headers) - len(kept) > 1:
        named: frozenset[bytes] = frozenset()
        for name, value in headers:
            if name.lower() == b"connection":
                named |= named_by_connection(value)
        if named:
            kept = [(name, value) for name, value in kept if name.lower() not in named]
    return kept
