"""What a draining port does with the connections that reached it just before it stopped
accepting, for both ports (SIGTERM; a worker replaced by a SIGHUP reload).

Closing a listening socket resets the connections the kernel completed on it but the server
had not accepted yet (Linux, unless ``net.ipv4.tcp_migrate_req=1`` moves them to another
``SO_REUSEPORT`` listener of the port): requests the client already sent, failed. So a draining
port first accepts everything queued, in the same synchronous step as the close (the window
left is the close itself), and serves those connections like the others.

A connection waiting for its (first or next) request when the drain begins is given
:data:`DRAIN_GRACE_S` for it: its client may be sending it now. The HTTP port answers such a
request with ``connection: close``; the gRPC port sends GOAWAY twice (RFC 9113 6.8: first with
the largest stream id, then, after the grace, with the last stream it opened).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable

log = logging.getLogger("gateway.drain")


def cut_by_drain(what: str) -> str:
    """What a request (HTTP: 503) or call (gRPC: UNAVAILABLE) still running when
    ``drain_timeout_s`` ends is told: one wording on both ports."""
    return f"the gateway is shutting down and drain_timeout_s ended before this {what} did: retry it"


DRAIN_GRACE_S = 1.0  # for a request on its way when the drain begins (a round trip, with room for a loaded host)
_MOST_QUEUED = 65536  # a bound on the accept loop (the kernel's backlog is smaller)


def grace(drain_timeout_s: float) -> float:
    """The grace within the drain's bound: at most half of it."""
    return min(DRAIN_GRACE_S, drain_timeout_s / 2)


def accept_queued(server: asyncio.AbstractServer) -> list[socket.socket]:
    """Accept, without blocking, every connection queued on ``server``'s listening sockets.
    Call it right before closing them, with no ``await`` between."""
    accepted: list[socket.socket] = []
    for listening in getattr(server, "sockets", None) or ():
        # a descriptor of our own on the same socket: the loop's socket object may not accept
        sock = socket.socket(fileno=os.dup(listening.fileno()))
        try:
            while len(accepted) < _MOST_QUEUED:
                try:
                    connection, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # e.g. the descriptor limit: the rest stays queued, as before
                    log.warning("draining: could not accept a queued connection: %s", exc)
                    break
                connection.setblocking(False)
                accepted.append(connection)
        finally:
            sock.close()  # our descriptor only: the listener closes with the server
    return accepted


async def serve_accepted(connections: list[socket.socket], factory: Callable[[], asyncio.Protocol],
                         tls: ssl.SSLContext | None) -> list[asyncio.BaseProtocol]:
    """Hand connections accepted by :func:`accept_queued` to the loop, as the server would
    have; the protocols of those that started (a failed TLS handshake is that client's end)."""
    loop = asyncio.get_running_loop()

    async def serve(connection: socket.socket) -> asyncio.BaseProtocol | None:
        try:
            _, protocol = await loop.connect_accepted_socket(factory, connection, ssl=tls)
        except (TimeoutError, OSError, ssl.SSLError, ConnectionError) as exc:
            log.debug("draining: a queued connection ended before it was served: %s", exc)
            with contextlib.suppress(OSError):
                connection.close()
            return None
        return protocol

    started = await asyncio.gather(*(serve(connection) for connection in connections))
    log.info("draining: %d connection(s) queued on the listener served, not reset", len(connections))
    return [protocol for protocol in started if protocol is not None]
