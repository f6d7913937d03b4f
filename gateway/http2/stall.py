"""When a client last took what was sent to it: the bound on answers it leaves unread.

Answers wait for a client in two places: a stream's DATA queued for its flow-control windows
(``StreamState.pending``), and the connection's write buffer while the client's socket is
not read (past ``Limits.write_high_water``). Neither may wait forever: a stream whose call has
ended keeps its queued answer (a unary reply whole, a stream's last ~320 KiB) and its stream
slot, and the connection, never idle while a stream is open, is never closed. So each wait
is bounded by *progress*, not by its length (nginx's ``send_timeout``): a stream whose queue
has not shrunk for ``Limits.stalled_timeout`` is reset, and a socket whose write buffer has not
shrunk for as long is closed. A slow client that takes a few bytes now and then is never cut.
Times are the sweep's ticks (``gateway.sweep``): met within half a second after the bound.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.http2.server_stream import ServerStream


class StallWatch:
    """The client's progress on one connection: each stream's ``moved`` stamp, and the
    write buffer's smallest size seen since the socket was paused."""

    __slots__ = ("bound", "paused_at", "unsent")

    def __init__(self, bound: int) -> None:
        self.bound = bound  # ticks without progress before a stream or the socket is cut
        self.paused_at = 0  # the tick the socket last took bytes while paused (0: not paused)
        self.unsent = 0  # the write buffer's size then

    def streams_due(self, blocked: Iterable[ServerStream], now: int) -> tuple[list[ServerStream], int]:
        """The streams whose queue has not moved for ``bound`` ticks, and the tick the next of
        the others falls due (0: none waits)."""
        stalled, due = [], 0
        for stream in blocked:
            at = stream.moved + self.bound
            if at <= now:
                stalled.append(stream)
            elif not due or at < due:
                due = at
        return stalled, due

    def paused(self, now: int, unsent: int) -> None:
        self.paused_at, self.unsent = now, unsent

    def socket_due(self, now: int, unsent: int) -> int:
        """While the socket is paused: the tick it is cut unless it takes bytes first; ``now`` or
        earlier: cut it. A smaller write buffer than at the last look is progress (while paused
        the connection's streams are held, so little is added to it meanwhile)."""
        if unsent < self.unsent:
            self.paused_at, self.unsent = now, unsent
        return self.paused_at + self.bound
