"""The ModelStreamInfer streams each client has running on Triton, open or left.

A stream whose client cancels or disconnects is never reset on Triton (Triton 2.51 crashes on
resets: ``grpc.upstream``): its requests are ended and Triton finishes what it was sent, which
for a decoupled model can be many replies over a long time. So a stream counts against its
client (the address, or whom a trusted proxy forwarded) from when it opens until Triton ends
it, whether the client is still reading it or not: a client opening long generations and
cancelling them, one after another or all at once, holds at most ``grpc_max_streams_per_client``
of them on Triton, and its next stream is answered RESOURCE_EXHAUSTED until one ends. Other
clients are not affected. Counted per process (with ``--workers N``, per worker: a client's one
HTTP/2 connection reaches one worker, and splitting the bound would cut such a client to a
fraction of it).
"""

from __future__ import annotations

from gateway.errors import GatewayError


class TooManyStreams(GatewayError):
    status = 429  # RESOURCE_EXHAUSTED on the gRPC port: overload, never held against a version


class ClientStreams:
    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.counts: dict[str, int] = {}

    def take(self, client: str) -> StreamTicket:
        """One more stream of ``client`` on Triton, counted until the ticket is released; raises
        :class:`TooManyStreams` if the client is at its bound."""
        held = self.counts.get(client, 0)
        if held >= self.per_client:
            raise TooManyStreams(
                f"this client has {held} streams running on Triton, open or left (a stream a client cancels runs "
                f"to its end there; grpc_max_streams_per_client is {self.per_client}): the next stream is accepted "
                f"once one of them ends")
        self.counts[client] = held + 1
        return StreamTicket(self, client)


class StreamTicket:
    """A stream's place in its client's count (a ``client_connection.Slot``): given back once, when
    the upstream stream ends (Triton's last reply, its reset at the deadline, the connection's
    end), or when it could not be opened."""

    __slots__ = ("book", "client")

    def __init__(self, book: ClientStreams | None, client: str) -> None:
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
