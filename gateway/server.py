"""Run the gateway under uvicorn (uvloop + httptools), the fastest pair measured here.

:class:`GatewayHttpProtocol` is uvicorn's httptools protocol with two changes that the
hot path measured as worth it (loopback send() calls dominate a proxy's CPU here):

- writes made in one event-loop iteration go out as one ``send()``: uvicorn writes the
  status line + headers and the body separately, two syscalls per response;
- the proxy can register a callback for "client connection lost" instead of running a
  watcher task per request to notice a client that went away.

It also bounds what one client can hold (uvicorn has no header or body timeout, and its
``limit_concurrency`` answers text/plain per request while leaving every accepted connection
open, so it caps neither connections nor slow clients):

- a request's headers must arrive within ``header_timeout_s`` (slowloris), counted from the
  connection's start or the request's first byte; a body may pause at most
  ``body_idle_timeout_s`` between two pieces. Either answers 408 with a JSON error and closes;
- past ``max_client_connections`` a new connection is answered 503 with ``Retry-After`` and
  closed before its request reaches the application.

The timers cost nothing in the common case: a request that arrives whole in one read never
arms one (only the first request of a connection finds the timer of its start, and cancels it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import Gateway
from gateway.proxy.http import CONNECTION_KEY
from gateway.settings import Settings


class _CoalescingTransport:
    """The client transport, but writes of one loop iteration are joined into one send()."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


_IDLE, _HEADERS, _BODY = 0, 1, 2  # what the connection waits for from the client
_OPEN, _REFUSED, _LINGERING = 0, 1, 2  # how a connection ends: normally, refused at the cap, or answered and closing
_LINGER_S = 1.0


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"transfer-encoding" or name == b"content-length" and value != b"0" for name, value in headers)


def _error_response(status: bytes, message: str, *extra: bytes) -> bytes:
    body = json.dumps({"error": message}).encode()
    return b"".join([b"HTTP/1.1 ", status, b"\r\ncontent-type: application/json\r\ncontent-length: ",
                     str(len(body)).encode(), b"\r\n", *extra, b"connection: close\r\n\r\n", body])


class GatewayHttpProtocol(HttpToolsProtocol):
    on_lost: Callable[[], None] | None = None  # set by the proxy while a request is in flight
    header_timeout_s: ClassVar[float] = 10.0  # the bounds: protocol_for(settings) sets them
    body_idle_timeout_s: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 4096
    _phase = _IDLE
    _timer_phase = _IDLE
    _timer: asyncio.TimerHandle | None = None
    _ending = _OPEN

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            self._ending = _REFUSED  # answered once its request arrives: see _answer_and_close
            self._timer = self.loop.call_later(min(self.header_timeout_s, 1.0), self._refuse)
            return
        self._phase = _HEADERS
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._ending:
            if self._ending == _REFUSED:
                self._refuse()
            return  # lingering: what the client still sends is read and dropped
        super().data_received(data)
        if self._phase != self._timer_phase or self._phase == _BODY:
            self._watch()

    def on_message_begin(self) -> None:
        self._phase = _HEADERS
        super().on_message_begin()
        self.scope[CONNECTION_KEY] = self  # type: ignore[literal-required]

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        if self.parser.should_upgrade() and not self._should_upgrade() and _has_body(self.headers):
            # httptools hands whatever follows an Upgrade request's headers to the new protocol,
            # so the application would see an empty body: say so instead of forwarding nothing.
            self._answer_and_close(_error_response(b"400 Bad Request", (
                "a request with a body cannot carry Upgrade on this port (no HTTP/2 upgrade, h2c, here): "
                "send it without the Upgrade and Connection: upgrade headers")))
            return
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        if not self._ending:
            super().on_message_complete()

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn logs two warnings per such request, inline: a client could flood the log. The
        Upgrade header is simply not honoured (nor forwarded)."""

    def connection_lost(self, exc: Exception | None) -> None:
        callback, self.on_lost = self.on_lost, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)
        if callback is not None:
            callback()

    def _watch(self) -> None:
        """(Re)arm the timer for what we wait for: a deadline for headers, an idle bound for a body."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        phase = self._timer_phase = self._phase
        if phase == _HEADERS:
            self._timer = self.loop.call_later(self.header_timeout_s, self._expired)
        elif phase == _BODY:
            self._timer = self.loop.call_later(self.body_idle_timeout_s, self._expired)

    def _expired(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.flow.read_paused:  # we stopped reading (the application is busy, pipelining): not the client
            self._timer = self.loop.call_later(self.body_idle_timeout_s, self._expired)
            return
        if self._phase == _BODY:
            if cycle is not None and not cycle.response_started:
                self._answer_and_close(_error_response(b"408 Request Timeout", (
                    f"request body stalled: no data for {self.body_idle_timeout_s:g}s (body_idle_timeout_s)")))
                return
        elif self._phase == _HEADERS and (cycle is None or cycle.response_complete):
            self._answer_and_close(_error_response(b"408 Request Timeout", (
                f"request headers not received within {self.header_timeout_s:g}s (header_timeout_s)")))
            return
        self.transport.close()

    def _refuse(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._answer_and_close(_error_response(b"503 Service Unavailable", (
            f"the gateway has {self.max_connections} client connections open (max_client_connections): "
            "retry shortly"), b"retry-after: 1\r\n"))

    def _answer_and_close(self, answer: bytes) -> None:
        """Answer, then close gently: closing with the client's bytes still unread would send a
        reset, and the client would lose the answer. So: send FIN, drop what still comes, close
        after a short linger (nginx's lingering_close)."""
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(answer)
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        transport.write_eof()
        self._ending = _LINGERING
        self._timer = self.loop.call_later(_LINGER_S, transport.close)


def protocol_for(settings: Settings) -> type[GatewayHttpProtocol]:
    """The protocol class with this gateway's bounds (uvicorn instantiates it per connection)."""

    class BoundedHttpProtocol(GatewayHttpProtocol):
        header_timeout_s = settings.header_timeout_s
        body_idle_timeout_s = settings.body_idle_timeout_s
        max_connections = settings.max_client_connections

    return BoundedHttpProtocol


def uvicorn_config(settings: Settings, app: Gateway | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_for(settings),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        lifespan="on",
        access_log=False,  # our own access log is structured and off the hot path
        server_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
        # HTTPS from the same files as the gRPC port's TLS (gateway.tls); mTLS with a client CA
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
        ssl_ca_certs=None if settings.tls_client_ca_file is None else str(settings.tls_client_ca_file),
        ssl_cert_reqs=ssl.CERT_NONE if settings.tls_client_ca_file is None else ssl.CERT_REQUIRED,
    )


def run(settings: Settings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn_config(settings))
    server.run()
    return 0 if server.started else 1
