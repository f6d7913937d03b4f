"""The lean gRPC port's listener and its graceful stop (``gateway.drain``): the server
``grpc.front`` answers on, started by the app once per process (or worker slot)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import weakref
from collections.abc import Callable

from gateway.byte_budget import ByteBudget
from gateway.client_address import PerAddress
from gateway.control_surface import ControlGate
from gateway.drain import accept_queued, cut_by_drain, serve_accepted
from gateway.drain import grace as drain_grace
from gateway.grpc.front import GrpcFront
from gateway.grpc.health import Health
from gateway.grpc.router import GrpcRouter
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.server_stream import Limits

log = logging.getLogger("gateway.grpc")
_LAST_WORDS_S = 0.2  # for the cut calls' statuses to leave before the connections are aborted


class FrontServer:
    """The listening socket and its connections; ``stop`` is graceful like grpcio's."""

    def __init__(self, server: asyncio.Server, front: GrpcFront, connection: Callable[[], GrpcServerConnection],
                 tls: ssl.SSLContext | None = None,
                 accepted: weakref.WeakSet[GrpcServerConnection] | None = None) -> None:
        self.server = server
        self.front = front
        self.connection, self.tls = connection, tls
        # every connection made, the refused ones too (one over a cap is in no count: it lingers
        # until its client closes, which kept the loop of an in-process gateway from closing)
        self.accepted = accepted if accepted is not None else weakref.WeakSet()

    async def stop(self, grace: float | None = None) -> None:
        """Drain (``gateway.drain``): the connections the kernel queued are accepted and served;
        every connection is told GOAWAY with the largest stream id, so that streams its client is
        opening now are still served; after the grace, GOAWAY with the last stream opened. Then
        the open streams get what is left of ``grace``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        queued = accept_queued(self.server)
        self.server.close()  # at once after the accept loop
        if queued:
            await serve_accepted(queued, self.connection, self.tls)
        connections = list(self.front.connections)
        for connection in connections:
            connection.announce_goaway()
        if connections:
            await asyncio.wait([connection.closed for connection in connections], timeout=drain_grace(grace or 0.2))
        for connection in connections:
            connection.goaway()
        if connections:
            left = max(0.1, (grace or 0.1) - (loop.time() - started))
            await asyncio.wait([connection.closed for connection in connections], timeout=left)
            cut = sum(connection.cut_open_calls(cut_by_drain("call")) for connection in connections)
            if cut:  # they learn why, as the HTTP port's 503 says
                log.error("drain_timeout_s passed: answering %d gRPC call(s) UNAVAILABLE", cut)
            await asyncio.wait([connection.closed for connection in connections], timeout=_LAST_WORDS_S)
        for connection in [*connections, *self.accepted]:
            if connection.transport is not None:
                connection.transport.abort()
        await self.server.wait_closed()


async def start_server(router: GrpcRouter, host: str, port: int, gate: ControlGate | None = None,
                       tls: ssl.SSLContext | None = None, limits: Limits | None = None,
                       budget: ByteBudget | None = None, health: Health | None = None,
                       reuse_port: bool = False, sock: socket.socket | None = None,
                       backlog: int = 100) -> FrontServer:
    """``tls``: gRPC over TLS on the same port (the context offers ALPN h2), else plaintext h2c.
    ``reuse_port``: one of several processes' listeners on the port (gateway.workers);
    ``sock``: a socket bound already (the workers' shared listener), instead of host and port;
    ``backlog``: connections the kernel queues before they are accepted."""
    front = GrpcFront(router, gate, health)
    limits = limits or Limits()
    per_client = PerAddress()  # the connections of each client address, for max_connections_per_client
    # a TLS handshake is part of getting to the preface: the same bound (asyncio's default is 60 s)
    handshake = limits.preface_timeout if tls is not None else None
    loop = asyncio.get_running_loop()
    accepted: weakref.WeakSet[GrpcServerConnection] = weakref.WeakSet()

    def connection() -> GrpcServerConnection:
        made = GrpcServerConnection(front.on_stream, front.connections, limits, per_client, budget)
        accepted.add(made)
        return made

    if sock is not None:
        server = await loop.create_server(connection, sock=sock, ssl=tls, ssl_handshake_timeout=handshake,
                                          backlog=backlog)
    else:
        server = await loop.create_server(connection, host, port, reuse_address=True, reuse_port=reuse_port or None,
                                          ssl=tls, ssl_handshake_timeout=handshake, backlog=backlog)
    return FrontServer(server, front, connection, tls, accepted)
