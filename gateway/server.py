"""Run the gateway under uvicorn (uvloop + httptools), the fastest pair measured here.

:class:`GatewayHttpProtocol` is uvicorn's httptools protocol with two changes that the
hot path measured as worth it (loopback send() calls dominate a proxy's CPU here):

- writes made in one event-loop iteration go out as one ``send()``: uvicorn writes the
  status line + headers and the body separately, two syscalls per response;
- the proxy can register a callback for "client connection lost" instead of running a
  watcher task per request to notice a client that went away.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    on_lost: Callable[[], None] | None = None  # set by the proxy while a request is in flight

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION_KEY] = self  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        callback, self.on_lost = self.on_lost, None
        super().connection_lost(exc)
        if callback is not None:
            callback()


def uvicorn_config(settings: Settings, app: Gateway | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=GatewayHttpProtocol,
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
