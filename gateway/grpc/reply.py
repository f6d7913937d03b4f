"""What Triton's answer to a call says: its gRPC status, and a unary call's one message.

The status is read from the trailers (or a trailers-only answer's headers); an answer with none
is mapped from its HTTP status as grpcio maps it. A unary call's message is read out of the DATA
pieces it came in (``client_connection`` keeps them as views of what was read), joined once.
Pure: no connection state, so ``client_connection`` keeps only the calls and their credit.
"""

from __future__ import annotations

from collections import deque
from urllib.parse import unquote

from gateway.errors import OWN_ANSWER
from gateway.grpc.status import StatusCode
from gateway.grpc.wire import peek, take
from gateway.http2.endpoint import Headers

Reply = tuple[int, str, bytes]  # (grpc status, details, the response message)
_HTTP_TO_GRPC = {400: StatusCode.INTERNAL, 401: StatusCode.UNAUTHENTICATED, 403: StatusCode.PERMISSION_DENIED,
                 404: StatusCode.UNIMPLEMENTED, 429: StatusCode.UNAVAILABLE, 502: StatusCode.UNAVAILABLE,
                 503: StatusCode.UNAVAILABLE, 504: StatusCode.UNAVAILABLE}


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
        code = _HTTP_TO_GRPC.get(int(http_status or 0), StatusCode.UNKNOWN)
        return code, f"{OWN_ANSWER}Triton answered HTTP {http_status.decode() or '?'} without a gRPC status"
    return int(status), unquote(details.decode("utf-8", "replace")) if details else ""


def unary_reply(headers: Headers | None, trailers: Headers | None, chunks: deque[memoryview]) -> Reply:
    """A unary call's answer: its status, and with OK its one (uncompressed) message."""
    code, message = status_of(headers, trailers)
    if code != StatusCode.OK:
        return code, message, b""
    size = sum(len(chunk) for chunk in chunks)
    head = peek(chunks, 5) if size >= 5 else b""
    if len(head) < 5 or head[0] != 0:
        return StatusCode.INTERNAL, f"{OWN_ANSWER}Triton sent no response message (or a compressed one)", b""
    length = int.from_bytes(head[1:5], "big")
    if size < 5 + length:
        return StatusCode.INTERNAL, f"{OWN_ANSWER}Triton's response message is truncated", b""
    take(chunks, 5)
    return StatusCode.OK, message, take(chunks, length)  # the pieces joined once
