"""Run the gateway under uvicorn (uvloop + httptools), the fastest pair measured here, with
the bounded front of ``gateway.http_front`` as its HTTP protocol."""

from __future__ import annotations

import logging
import ssl

import uvicorn

from gateway.app import Gateway
from gateway.http_front import protocol_for
from gateway.settings import Settings


def uvicorn_config(settings: Settings, app: Gateway | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_for(settings),
        ws="none",  # no WebSocket here: an upgraded connection would leave the front's bounds and counts
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
