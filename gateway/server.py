"""Run the gateway under uvicorn (uvloop + httptools), the fastest pair measured here, with
the bounded front of ``gateway.http_front`` as its HTTP protocol.

SIGTERM drains both ports at once: the HTTP and gRPC listeners close, and the requests and calls
in flight get ``drain_timeout_s`` to finish (the same bound as each worker of ``--workers N``);
then the application stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import signal
import socket
import ssl
import sys
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import Gateway
from gateway.drain import accept_queued, serve_accepted
from gateway.http_front import protocol_for
from gateway.http_output import GatewayCycle
from gateway.listen import PortTaken, bind
from gateway.reload import changed, sort_out
from gateway.settings import LISTEN_BACKLOG, Settings, SettingsError

log = logging.getLogger("gateway.server")


def uvicorn_config(settings: Settings, app: Gateway | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app or Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_for(settings),
        ws="none",  # no WebSocket here: an upgraded connection would leave the front's bounds and counts
        # who a client is comes from trusted_proxies alone (gateway.client_address): uvicorn's own
        # proxy headers believed any X-Forwarded-For from 127.0.0.1, so a local client chose its address
        proxy_headers=False,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        backlog=LISTEN_BACKLOG,
        lifespan="on",
        access_log=False,  # our own access log is structured and off the hot path
        server_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),  # uvicorn counts whole seconds
        # HTTPS from the same files as the gRPC port's TLS (gateway.tls); mTLS with a client CA
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
        ssl_ca_certs=None if settings.tls_client_ca_file is None else str(settings.tls_client_ca_file),
        ssl_cert_reqs=ssl.CERT_NONE if settings.tls_client_ca_file is None else ssl.CERT_REQUIRED,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM) closes the gRPC port with the HTTP port and
    drains both together; the application's stop (lifespan) waits for the gRPC calls too. Given
    where its settings came from, SIGHUP reads them again (``gateway.reload``)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, config_file: str | Path | None = None,
                 overrides: dict[str, Any] | None = None, reloads: bool = False) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.config_file = config_file
        self.overrides = overrides or {}
        self.reloads = reloads  # the process' main server: SIGHUP is ours (a test's thread cannot take signals)
        self._reloading: set[asyncio.Task[None]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.reloads:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload()))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._reloading.add(task)
        task.add_done_callback(self._reloading.discard)

    async def reload(self) -> None:
        """SIGHUP in one process: what the control plane applies at once (tokens, sessions, ...) is
        applied; everything else is named as needing a restart (no second data plane to swap in)."""
        try:
            new = Settings.load(self.config_file, **self.overrides)
        except SettingsError as exc:
            log.error("SIGHUP: %s: keeping the running settings", exc)
            return
        reload = sort_out(changed(self.gateway.settings, new), False, str(self.config_file or "the environment"))
        await self.gateway.reconfigure(new)
        log.log(logging.WARNING if reload.restart else logging.INFO, "%s", reload.describe())

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, except that a SIGTERM drained cleanly ends the process with 0: uvicorn raises
        the signal again once it has stopped, so a wrapper script read -15, a death by the signal,
        after a clean drain. SIGINT is raised again as before (a shell's 130)."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    def stopped_accepting(self) -> None:
        """Neither port accepts a new connection from here on (a worker tells its control plane)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, except for the connections that reached the port just before: those the
        kernel queued are accepted and served, not reset by the close (``gateway.drain``), and
        the protocol gives a connection waiting for a request a grace for it (``http_front``)."""
        queued = [connection for server in self.servers for connection in accept_queued(server)]
        for server in self.servers:  # at once after the accept loop: the close's own window is left
            server.close()
        for sock in sockets or []:
            sock.close()
        self.gateway.drain_grpc()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        if queued:
            config, loop = self.config, asyncio.get_running_loop()
            for protocol in await serve_accepted(queued, lambda: config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop),
                    config.ssl):
                protocol.shutdown()  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)  # the gRPC port's stop has closed its listener too
        self.stopped_accepting()
        try:  # requests finish within drain_timeout_s
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                await self._wait_tasks_to_complete()
        except TimeoutError:
            log.error("drain_timeout_s passed: cancelling %d request(s)", len(self.server_state.tasks))
            for connection in self.server_state.connections:  # answered 503 "shutting down", not 500
                cycle = getattr(connection, "cycle", None)
                if isinstance(cycle, GatewayCycle):
                    cycle.cut_by_drain = True
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


def open_files_for(settings: Settings, warn: bool = True) -> int:
    """Raise this process' soft limit of open files to its hard limit (as nginx's
    worker_rlimit_nofile and Go's runtime do): the connection limits need a descriptor each,
    and a container's soft limit is often 1,024 while its hard limit is far higher. Logs a
    warning when even the hard limit is below what the connection limits need. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    needed = settings.max_client_connections + (settings.grpc_max_connections if settings.grpc_enabled else 0) + \
        settings.pool_size + 256  # clients on both ports, the pool to Triton, and the rest (files, probes)
    if warn and soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("open files limit %d is below what the connection limits need (%d: max_client_connections + "
                    "grpc_max_connections + pool_size + 256): raise the hard limit (ulimit -n, the container's "
                    "nofile) or lower the limits; past it a connection is not accepted", soft, needed)
    return soft


def bind_ports(settings: Settings) -> tuple[socket.socket, socket.socket | None]:
    """Both ports bound before anything starts, so a taken one is one line naming it and its
    setting: the gRPC port's bind failed inside the application's startup (a 60-line traceback,
    and the process then hung) and the HTTP port's among uvicorn's log lines, after startup."""
    http = bind(settings.host, settings.port, "port")
    if not settings.grpc_enabled:
        return http, None
    try:
        grpc = bind(settings.host, settings.grpc_port, "grpc_port")
    except PortTaken:
        http.close()
        raise
    if settings.grpc_server == "grpcio":  # grpcio binds its own: the check is all this can do
        grpc.close()
        return http, None
    return http, grpc


def run(settings: Settings, config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        http, grpc = bind_ports(settings)
    except PortTaken as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    open_files_for(settings)
    gateway = Gateway(settings)
    gateway.grpc_socket = grpc
    server = GatewayServer(uvicorn_config(settings, gateway), gateway, config_file, overrides, reloads=True)
    server.run(sockets=[http])
    return 0 if server.started else 1
