"""One exception tree for the whole gateway, mapped to responses in one place.

    GatewayError                 status  meaning
    ├── BadRequest                 400   the client's request cannot be routed as sent
    ├── Unauthorized               401   missing or invalid admin bearer token
    ├── Forbidden                  403   e.g. Triton model control on a data port
    ├── NotFound                   404
    ├── Conflict                   409   e.g. a version that is not READY on Triton
    │   └── LeaseLost              409   a fenced write from a deposed lease holder, refused
    ├── PayloadTooLarge            413   a request body (or its decompressed form) over max_body_bytes
    ├── UriTooLong                 414   a URL longer than Triton's HTTP server reads reliably
    ├── Overloaded                 429   the gateway's admission control: Retry-After; never a version's fault
    ├── TooManyAttempts            429   failed console logins from one address: Retry-After
    ├── PreconditionFailed         412   stale If-Match revision
    │   └── StaleRevision          412   a store compare-and-set lost the race
    ├── LoadFailed                 422   Triton refused or failed to load a version
    ├── AdminDisabled              503   no admin token configured (and not --insecure-admin)
    ├── StoreError                 503   the state store failed (sqlite3 / redis, translated)
    ├── CorruptRecord              500   a stored record cannot be read (skipped by sync, counted)
    ├── MetricsUnavailable         503   the metrics source cannot tell (the analysis says ERROR)
    ├── GatewayBusy                503   the gateway holds too much already (connections, buffered bodies)
    └── UpstreamError              502   Triton answered nothing usable
        ├── UpstreamUnavailable    503   connection refused / cannot connect in time
        ├── UpstreamTimeout        504   the deadline passed before Triton answered
        └── ClientGone             499   the client went away; nothing is sent back

The data plane's own answers about Triton (``Overloaded`` and the ``UpstreamError`` family) start
with ``gateway: `` so a client tells them from Triton's, which pass through verbatim, and they
name no internal address: which server failed goes to the log and to ``/admin/fleets``.

Lower-level exceptions (OSError, httptools errors, sqlite3, redis, httpx) are translated at
their own boundary (``upstream.py``, ``grpc/upstream.py``, ``store/``, ``telemetry/sources.py``)
with ``raise Ours(...) from exc``. The admin API answers ``status`` with ``{"error": message}``;
the gRPC fronts map the tree to gRPC status codes in ``grpc/status.py``.
"""

from __future__ import annotations

import json
import os
import socket

OWN_ANSWER = "gateway: "  # the first words of every answer the gateway gives instead of Triton


def own_answer(message: str) -> str:
    """``message`` marked as the gateway's own answer (once)."""
    return message if message.startswith(OWN_ANSWER) else OWN_ANSWER + message


def os_reason(exc: OSError) -> str:
    """What went wrong with a socket, without the address asyncio puts in its message.

    A resolver failure (``socket.gaierror``) has a negative EAI_* number that ``os.strerror``
    only knows as "Unknown error -2"; its own text may name the host: neither reaches a client."""
    if isinstance(exc, socket.gaierror):
        return "cannot resolve Triton's address"
    return os.strerror(exc.errno) if exc.errno else "cannot connect"


class GatewayError(Exception):
    status = 500
    headers: tuple[tuple[bytes, bytes], ...] = ()  # response headers the answer needs (Retry-After, ...)

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        """Triton's own error shape, so clients need no special case for the gateway."""
        return json.dumps({"error": self.message}).encode()


class BadRequest(GatewayError):
    status = 400


class Unauthorized(GatewayError):
    status = 401


class Forbidden(GatewayError):
    status = 403


class NotFound(GatewayError):
    status = 404


class Conflict(GatewayError):
    status = 409


class PayloadTooLarge(GatewayError):
    """The body is not read: the connection closes after the answer."""

    status = 413
    headers = ((b"connection", b"close"),)


class UriTooLong(GatewayError):
    """The body is not read: the connection closes after the answer."""

    status = 414
    headers = ((b"connection", b"close"),)


class GatewayBusy(GatewayError):
    """The gateway's own capacity, not the client's rate: Retry-After, and the connection closes."""

    status = 503
    headers = ((b"retry-after", b"1"), (b"connection", b"close"))


class LeaseLost(Conflict):
    """A fenced write from a holder whose lease epoch is no longer the current one: another
    replica took the lease (or it was never held), so the write is refused and changes nothing."""


class PreconditionFailed(GatewayError):
    status = 412


class StaleRevision(PreconditionFailed):
    """Compare-and-set lost: someone changed the record since the caller read it."""


class LoadFailed(GatewayError):
    """Triton refused or failed to load the version; the message carries Triton's reason."""

    status = 422


class AdminDisabled(GatewayError):
    status = 503


class StoreError(GatewayError):
    """The backend failed (I/O, connection); translated from sqlite3 / redis errors."""

    status = 503


class CorruptRecord(GatewayError):
    """A stored record cannot be read (bad JSON, or a value this version cannot accept).

    Readers skip it and count it; the record itself is left as it is, for a human."""

    status = 500


class MetricsUnavailable(GatewayError):
    """The metrics source could not answer; never raised into the controller as anything else."""

    status = 503


class UpstreamError(GatewayError):
    """No usable answer from Triton: the gateway answers itself, and says so."""

    status = 502

    def __init__(self, message: str) -> None:
        super().__init__(own_answer(message))


class UpstreamUnavailable(UpstreamError):
    status = 503


class UpstreamTimeout(UpstreamError):
    status = 504


class ClientGone(UpstreamError):
    status = 499


class Overloaded(GatewayError):
    """Admission control refused the request (every server of its fleet is at its in-flight limit
    and the queue wait ran out). HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED; never
    counted against a version. (Triton's own queue-full answer passes through as Triton sent it.)"""

    status = 429

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(own_answer(message))
        self.retry_after_s = retry_after_s
        self.headers = ((b"retry-after", str(retry_after_s).encode()),)


class TooManyAttempts(GatewayError):
    """One client address failed too many console logins in a row: it waits ``retry_after_s``."""

    status = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = ((b"retry-after", str(retry_after_s).encode()),)
