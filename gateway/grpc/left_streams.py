"""The ModelStreamInfer streams each client left that still run on Triton.

A stream whose client cancels or disconnects is never reset upstream (Triton 2.51 crashes on
resets: ``grpc.upstream``): its requests are ended and Triton finishes what it was sent, which
for a decoupled model can be many replies over a long time. Nothing else bounded those streams:
a client that opens a stream, asks for a long generation and cancels, over and over, kept
Triton generating for all of them at once while its own connection limits saw none. Each left
stream now counts against its client (the address, or whom a trusted proxy forwarded) until
Triton ends it; a client at ``grpc_max_left_streams_per_client`` has its next stream answered
RESOURCE_EXHAUSTED until one of them ends (other clients are not affected).
"""

from __future__ import annotations

from gateway.errors import GatewayError


class TooManyLeftStreams(GatewayError):
    status = 429  # RESOURCE_EXHAUSTED on the gRPC port: overload, never held against a version


class LeftStreams:
    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.counts: dict[str, int] = {}

    def check(self, client: str) -> None:
        """Raises :class:`TooManyLeftStreams` if ``client`` may not open another stream now."""
        held = self.counts.get(client, 0)
        if held >= self.per_client:
            raise TooManyLeftStreams(
                f"this client left {held} streams that Triton is still answering (grpc_max_left_streams_per_client "
                f"is {self.per_client}): the next stream is accepted once one of them ends")

    def ticket(self, client: str) -> LeftTicket:
        """One more left stream of ``client``, counted until the ticket is released."""
        self.counts[client] = self.counts.get(client, 0) + 1
        return LeftTicket(self, client)


class LeftTicket:
    """A left stream's place in its client's count (a ``client_connection.Slot``): given back once,
    when the upstream stream ends (Triton's last reply, its reset at the deadline, or the
    connection's end)."""

    __slots__ = ("book", "client")

    def __init__(self, book: LeftStreams | None, client: str) -> None:
        self.book = book
        self.client = client

    def release(self) -> None:
        book, self.book = self.book, None
        if book is None:
            return
        held = book.counts.get(self.client, 0) - 1
        if held > 0:
            book.counts[self.client] = held
        else:
            book.counts.pop(self.client, None)
