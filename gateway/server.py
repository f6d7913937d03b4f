"""Run the gateway under uvicorn (uvloop + httptools), the fastest pair measured here."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import Gateway
from gateway.settings import Settings


def uvicorn_config(settings: Settings, app: Gateway | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,  # our own access log is structured and off the hot path
        server_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
    )


def run(settings: Settings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn_config(settings))
    server.run()
    return 0 if server.started else 1
