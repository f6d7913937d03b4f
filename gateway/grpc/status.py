"""gRPC status codes, once: the numbers on the wire, their names, and whose fault each one is.

The names are the ``code`` label of ``gateway_requests_total`` for gRPC requests, so PromQL
that judges versions (``UPSTREAM_ERROR_CODES`` in the recorder) spells the same words.
"""

from __future__ import annotations

from enum import IntEnum

from gateway.errors import ClientGone, GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.telemetry.recorder import Outcome, client_caused, queue_refused


class StatusCode(IntEnum):
    """https://grpc.github.io/grpc/core/md_doc_statuscodes.html"""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# Codes that count against the version that answered them; INVALID_ARGUMENT, NOT_FOUND & co.
# are the client's, CANCELLED is nobody's, RESOURCE_EXHAUSTED is overload (admission control or
# Triton's full queue): shown, never held against a version.
FAULTS = frozenset([StatusCode.UNAVAILABLE, StatusCode.INTERNAL, StatusCode.UNKNOWN, StatusCode.DEADLINE_EXCEEDED])
_BY_HTTP_STATUS = {400: StatusCode.INVALID_ARGUMENT, 401: StatusCode.UNAUTHENTICATED,
                   403: StatusCode.PERMISSION_DENIED, 404: StatusCode.NOT_FOUND,
                   409: StatusCode.FAILED_PRECONDITION, 412: StatusCode.FAILED_PRECONDITION,
                   422: StatusCode.INVALID_ARGUMENT, 429: StatusCode.RESOURCE_EXHAUSTED}
_NAMES = tuple(code.name for code in StatusCode)  # a tuple index per request, not an enum lookup


def status_name(code: int) -> str:
    return _NAMES[code] if 0 <= code < len(_NAMES) else "UNKNOWN"


def classify(code: int, details: str = "") -> Outcome:
    """gRPC answers HTTP 200 even on failure: the status code says whose fault it was, and for
    some the message: Triton's full or timed-out queue (UNAVAILABLE) is the version's capacity
    (REJECTED), not a broken version; RESOURCE_EXHAUSTED (the gateway's own admission) is overload; and
    Triton's words for a request it could not accept (``client_caused``) are the client's error
    whatever the code."""
    if code == StatusCode.OK:
        return Outcome.SUCCESS
    if code == StatusCode.CANCELLED:
        return Outcome.CANCELLED
    if code == StatusCode.RESOURCE_EXHAUSTED:
        return Outcome.OVERLOAD
    if code == StatusCode.UNAVAILABLE and details and queue_refused(details.encode()):
        return Outcome.REJECTED
    if code not in FAULTS or (code != StatusCode.DEADLINE_EXCEEDED and details and client_caused(details.encode())):
        return Outcome.CLIENT_ERROR
    return Outcome.UPSTREAM_ERROR


def status_for(error: GatewayError) -> StatusCode:
    """The one mapping of the exception tree to gRPC status codes."""
    if isinstance(error, UpstreamUnavailable):
        return StatusCode.UNAVAILABLE
    if isinstance(error, UpstreamTimeout):
        return StatusCode.DEADLINE_EXCEEDED
    if isinstance(error, ClientGone):
        return StatusCode.CANCELLED
    fallback = StatusCode.UNAVAILABLE if error.status >= 503 else StatusCode.INTERNAL
    return _BY_HTTP_STATUS.get(error.status, fallback)
