"""One exception tree for the whole gateway, mapped to responses in one place.

    GatewayError                 status  meaning
    ├── BadRequest                 400   the client's request cannot be routed as sent
    ├── Unauthorized               401   missing or invalid admin bearer token
    ├── NotFound                   404
    ├── Conflict                   409   e.g. a version that is not READY on Triton
    ├── PreconditionFailed         412   stale If-Match revision
    │   └── StaleRevision          412   a store compare-and-set lost the race
    ├── LoadFailed                 422   Triton refused or failed to load a version
    ├── AdminDisabled              503   no admin token configured (and not --insecure-admin)
    ├── StoreError                 503   the state store failed (sqlite3 / redis, translated)
    ├── MetricsUnavailable         503   the metrics source cannot tell (the analysis says ERROR)
    └── UpstreamError              502   Triton answered nothing usable
        ├── UpstreamUnavailable    503   connection refused / cannot connect in time
        ├── UpstreamTimeout        504   the deadline passed before Triton answered
        └── ClientGone             499   the client went away; nothing is sent back

Lower-level exceptions (OSError, httptools errors, sqlite3, redis, httpx) are translated at
their own boundary (``upstream.py``, ``grpc/upstream.py``, ``store/``, ``telemetry/sources.py``)
with ``raise Ours(...) from exc``. The admin API answers ``status`` with ``{"error": message}``;
the gRPC fronts map the tree to gRPC status codes in ``grpc/status.py``.
"""

from __future__ import annotations

import json


class GatewayError(Exception):
    status = 500

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


class NotFound(GatewayError):
    status = 404


class Conflict(GatewayError):
    status = 409


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


class MetricsUnavailable(GatewayError):
    """The metrics source could not answer; never raised into the controller as anything else."""

    status = 503


class UpstreamError(GatewayError):
    status = 502


class UpstreamUnavailable(UpstreamError):
    status = 503


class UpstreamTimeout(UpstreamError):
    status = 504


class ClientGone(UpstreamError):
    status = 499


class Overloaded(GatewayError):
    """Admission control refused the request (every server of its fleet is at its in-flight limit
    and the queue wait ran out), or Triton said its own queue is full. HTTP 429 with
    ``Retry-After``, gRPC RESOURCE_EXHAUSTED; never counted against a version."""

    status = 429

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
