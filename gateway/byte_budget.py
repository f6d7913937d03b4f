"""The bytes the gateway holds for requests, one budget shared by both ports.

HTTP bodies (``proxy.limits.BodyReader``), gRPC messages while HTTP/2 assembles, inflates and
holds them (``http2.server``, ``grpc``), and shadow copies all charge the one ``ByteBudget``
of ``max_buffered_body_bytes`` that the app builds; past it a request is refused as overload
(503 + Retry-After, gRPC UNAVAILABLE). It lives here, below the fronts and HTTP/2, because
all of them charge it (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import GatewayBusy

# Below this a compressed body inflates without its ratio being looked at: small JSON bodies of
# zeros compress past 100:1 (1,000 zeros: 5 KB to 40 bytes), and what they hold is small.
INFLATION_FLOOR = 64 << 10


def inflation_limit(compressed: int, largest: int, ratio: int) -> int:
    """The most a body of ``compressed`` bytes may inflate to: ``ratio`` times its size (at least
    :data:`INFLATION_FLOOR`), never past ``largest`` (``max_body_bytes``, ``grpc_max_message_bytes``).
    The size bound alone let a 199 KiB gzip body hold 64 MiB, and two of them a second kept half the
    budget full for everyone; with a ratio, what a bomb holds is paid for by the bytes it sends."""
    return min(largest, max(INFLATION_FLOOR, compressed * ratio))


class ByteBudget:
    """The bytes the gateway holds for requests, on both ports, against one ``limit``.

    Whoever takes bytes releases exactly as many when it lets them go, on every path: with
    :meth:`charged` (a context manager), a ``finally``, or the end of the object that holds
    them. ``held`` is 0 when no request is in the gateway."""

    __slots__ = ("limit", "held")

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> None:
        """Charge ``size`` bytes, or raise GatewayBusy (503 + Retry-After) when they do not fit."""
        if self.held + size > self.limit:
            raise GatewayBusy(f"the gateway holds {self.limit} bytes of requests already: retry shortly")
        self.held += size

    def try_take(self, size: int) -> bool:
        """Charge ``size`` bytes if they fit; False (nothing charged) if not."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size

    @contextmanager
    def charged(self, size: int) -> Iterator[None]:
        self.take(size)
        try:
            yield
        finally:
            self.held -= size
