"""One data-plane worker process: the gateway's data path, fed and watched by the control plane.

A :class:`WorkerGateway` is the :class:`~gateway.app.Gateway` with the control plane left
out: its policy book is filled by the control plane's pushes (acknowledged by push number),
its recorder reports deltas (:mod:`gateway.workers.deltas`) at least every
:data:`~gateway.workers.channel.REPORT_S`, and those reports are its heartbeat (with the
event loop's lag). Its sequence pins are the control plane's (:mod:`gateway.workers.pins`).
Everything else on the HTTP port (``/admin``, ``/console``, ``/metrics``, probes) is
forwarded to the control plane over its Unix socket (:class:`ControlForwarder`), so any
connection, on any worker, reaches the one admin API.

Shared budgets, so that N workers admit what one process would:

- ``max_inflight_per_server`` is per server per node: each worker gets its share of the
  slots (the total split, the remainder to the first workers, at least one each), and so
  does the queue behind them;
- the shadow queue (1000 mirrors) and its senders are split the same way, and so are the
  bytes held for request bodies (``max_buffered_body_bytes``; never below one largest body);
- ``max_connections_per_client`` is per node too: each worker admits its share of one
  address's connections (a compare against its own count, as with one process), so one
  client never holds more than the cap on the node (``grpc_max_streams_per_client`` is per
  worker: a gRPC client's one connection reaches one worker).

The listeners are its slot's own ``SO_REUSEPORT`` sockets (Linux), bound by the supervisor
and listening once the slot's first worker is ready; each worker of the slot inherits them in
turn, so a replacement never closes them (a close resets what is queued on them). Without
``SO_REUSEPORT`` (or with ``worker_listeners: shared``) the supervisor binds one socket per
port and every worker accepts on it (:class:`SharedListeners`).

The worker says ``hello`` first (the control plane then pushes the node's policies, without
which it does not serve), and ``serving`` once both ports listen: "up" in ``/admin/workers``
and ``gateway_worker_up``, and what a rolling SIGHUP waits for before it drains the old worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import httpx
import uvicorn

from gateway.app import Gateway
from gateway.asgi import Asgi
from gateway.policy import PolicySpec
from gateway.proxy.http import Receive, Scope, Send
from gateway.proxy.shadow import ShadowMirror
from gateway.server import GatewayServer, open_files_for, uvicorn_config
from gateway.settings import Settings
from gateway.store.base import make_store
from gateway.workers.channel import REPORT_S, BlockingChannel, Channel, ChannelClosed
from gateway.workers.deltas import DeltaRecorder
from gateway.workers.fleet_counts import ServerCounts
from gateway.workers.pins import VERSION_TABLE, RemotePins

log = logging.getLogger("gateway.workers")
SHADOW_QUEUE, SHADOW_SENDERS = 1000, 2  # ShadowMirror's defaults: one process's budget, split


def share(total: int, index: int, count: int) -> int:
    """Worker ``index``'s part of a per-node budget ``total`` (0: unlimited stays unlimited)."""
    if total <= 0:
        return total
    return max(1, total // count + (1 if index < total % count else 0))


@dataclass
class SharedListeners:
    """The sockets the supervisor bound once per port, inherited by every worker (spawn passes
    their file descriptors); gRPC's is None when the port is off or grpcio binds its own."""

    http: socket.socket
    grpc: socket.socket | None


def listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound TCP socket, not yet listening (uvicorn / asyncio call listen() when ready)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


class ControlForwarder:
    """ASGI: every request the worker does not serve itself goes to the control plane,
    streamed back as it comes (a console's server-sent events too).

    A request body goes along, streamed, only to ``/admin`` and ``/console``, where the control
    plane takes bodies (and where the dispatch has refused any over 64 KiB, and any chunked one,
    before this). Nothing else there takes a body (``/metrics``, ``/readyz``, ``/healthz``, any
    other path: 404 or 405), so such a body is left unread, the request goes without it, and the
    connection closes after the answer (its rest is dropped by the front's lingering close): read
    whole and relayed, 512 MiB chunked to ``POST /nothing`` took a worker from 158 MB to 1.6 GB."""

    def __init__(self, uds: str) -> None:
        self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds), timeout=httpx.Timeout(
            60.0, connect=5.0), base_url="http://control-plane")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        client = scope.get("client")
        takes_body = scope["path"].startswith(("/admin", "/console"))
        has_body = any(name in (b"transfer-encoding", b"content-length") and value != b"0"
                       for name, value in scope["headers"])
        unread = has_body and not takes_body
        dropped = _HOP_BY_HOP if takes_body else _HOP_BY_HOP | _FRAMING
        headers = [(k, v) for k, v in scope["headers"] if k not in dropped]
        if client:
            headers.append((b"x-forwarded-for", str(client[0]).encode()))
        if scope.get("scheme") == "https":
            headers.append((b"x-forwarded-proto", b"https"))
        request = self._client.build_request(scope["method"], path.decode("latin-1"), headers=headers,
                                             content=_streamed(receive) if takes_body and has_body else b"")
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await _json(send, 503, f"the control plane did not answer ({type(exc).__name__}): retry shortly")
            return
        try:
            kept = [(k, v) for k, v in response.headers.raw if k.lower() not in (b"transfer-encoding", b"connection")]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [*kept, (b"connection", b"close")] if unread else kept})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


_HOP_BY_HOP = frozenset([b"connection", b"keep-alive"])
_FRAMING = frozenset([b"content-length", b"transfer-encoding", b"expect"])


async def _streamed(receive: Receive) -> AsyncIterator[bytes]:
    """The request's body as it arrives, never held whole."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


async def _json(send: Send, status: int, message: str) -> None:
    import json

    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class WorkerGateway(Gateway):
    """The gateway's data plane in worker ``index`` of ``count``."""

    recorder_class = DeltaRecorder
    recorder: DeltaRecorder

    def __init__(self, settings: Settings, count: int, run_dir: str) -> None:
        self.index, self.count, self.run_dir = -1, count, run_dir
        super().__init__(settings, store=make_store("memory://"))  # the store is the control plane's
        self.reuse_port = settings.worker_reuse_port()
        pins = BlockingChannel(os.path.join(run_dir, "pins.sock"))
        self.pins = self.pipeline.pins = RemotePins(pins, VERSION_TABLE)
        for fleet in self.fleets:
            fleet.sequences = RemotePins(pins, f"fleet:{fleet.name}")
            fleet.on_join = None  # loading a joining server's versions is the control plane's
        self.server_counts = ServerCounts(self.fleets)
        self.forwarder = ControlForwarder(os.path.join(run_dir, "control.sock"))
        self.push = 0  # the control plane's policy push this worker runs
        self.channel: Channel | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._first_push = asyncio.Event()

    def assign(self, index: int) -> None:
        """Become worker ``index``: its share of the node's budgets. Separate from construction,
        so that a spare worker, built in advance, replaces a dead one in milliseconds."""
        self.index = index
        # the per-address connection cap: both ports read it from these settings as they start
        self.settings = self.settings.model_copy(update={"max_connections_per_client": share(
            self.settings.max_connections_per_client, index, self.count)})
        for fleet in self.fleets:
            fleet.max_inflight = share(fleet.max_inflight, index, self.count)
        # the bytes held for request bodies: a share, but a body of the largest size still fits
        self.budget.limit = max(self.settings.max_body_bytes, share(self.budget.limit, index, self.count))
        self.shadow = self.pipeline.shadow = ShadowMirror(
            self.upstream, self.recorder, max_queue=share(SHADOW_QUEUE, index, self.count),
            workers=share(SHADOW_SENDERS, index, self.count), budget=self.budget, fleets=self.shadow.fleets)

    def _control_app(self) -> Asgi:  # type: ignore[override]
        return self._serve_control

    async def _serve_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_protocol(receive, send)
        elif scope["type"] == "http" and scope["path"] == "/healthz":
            await _ok(send, b'{"status": "alive"}')  # this process answers: the worker's own liveness
        else:
            await self.forwarder(scope, receive, send)

    async def _lifespan_protocol(self, receive: Receive, send: Send) -> None:
        async with contextlib.AsyncExitStack() as stack:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await stack.enter_async_context(self.running())
                    except Exception as exc:
                        log.exception("worker %d failed to start", self.index)
                        await send({"type": "lifespan.startup.failed", "message": str(exc)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await stack.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _start(self) -> None:
        await self.fleets.start()
        for fleet in self.fleets:  # each worker's share of every server's slots (servers built before too)
            for server in fleet.servers.values():
                server.limit = fleet.max_inflight
        if self.access_log is not None:
            self.access_log.start()
        self.shadow.start()
        self.channel = await Channel.connect(os.path.join(self.run_dir, "channel.sock"))
        self.channel.send("hello", self.index, os.getpid())
        self.throttle.relay = self._relay_failure  # wrong tokens are counted by the node's control plane
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._report())]
        await asyncio.wait_for(self._first_push.wait(), 30)  # serve only with the node's policies
        if self.settings.grpc_enabled:
            await self._start_grpc()

    async def _stop(self) -> None:
        await self._grpc_drained()
        if self.grpc is not None:
            await self.grpc.aclose()
        self._report_now()  # the last requests' counts
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.channel is not None:
            with contextlib.suppress(Exception):
                await self.channel.writer.drain()
            self.channel.close()
        if self.access_log is not None:
            await self.access_log.stop()
        await self.shadow.stop()
        await self.forwarder.aclose()
        await self.fleets.stop()

    async def _receive(self) -> None:
        assert self.channel is not None
        while True:
            try:
                message = await self.channel.receive()
            except ChannelClosed:
                log.error("worker %d lost its control plane: exiting", self.index)
                os._exit(3)  # the supervisor is gone; a worker without it must not go on alone
            if message[0] == "policies":
                self._apply(*message[1:])
            elif message[0] == "locked":  # a client the control plane locked out for wrong tokens
                self.throttle.lock(message[1], message[2])

    def _apply(self, push: int, specs: dict[str, tuple[PolicySpec, int] | None], watched: set[tuple[str, str]],
               sequence_models: frozenset[str], whole: bool) -> None:
        """A push: every policy (``whole``: the first one after hello), or the models that changed."""
        self.book.set_sequence_models(sequence_models)  # what `sequence_affinity: auto` compiles to
        if whole:
            self.book.rebuild(f"push-{push}", {model: spec for model, spec in specs.items() if spec is not None}, {})
        else:
            for model, stored in specs.items():
                if stored is None:
                    self.book.remove(model)
                else:
                    self.book.put(model, stored[0], stored[1], force=True)
        self.recorder.watch_only(watched)
        self.push = push
        self._first_push.set()
        if self.channel is not None:
            self.channel.send("ack", push)

    def _relay_failure(self, client: str, where: str) -> None:
        if self.channel is not None and not self.channel.writer.is_closing():
            self.channel.send("auth_failed", client, where)

    async def _report(self) -> None:
        loop = asyncio.get_running_loop()
        expected = loop.time() + REPORT_S
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            lag = max(0.0, loop.time() - expected)
            expected = loop.time() + REPORT_S
            self._report_now(lag)

    def serving(self) -> None:
        """Both ports listen (the HTTP port's server has started; gRPC's started before it)."""
        if self.channel is not None:
            self.channel.send("serving")

    def draining(self) -> None:
        if self.channel is not None and not self.channel.writer.is_closing():
            self.channel.send("draining")

    def retired(self) -> None:
        """Its listeners are closed: a connection made from now on reaches another worker, which
        is what a SIGHUP waits for before it calls the workers replaced."""
        if self.channel is not None and not self.channel.writer.is_closing():
            self.channel.send("retired")

    def _report_now(self, lag: float = 0.0) -> None:
        if self.channel is not None and not self.channel.writer.is_closing():
            delta = self.recorder.take_delta()
            delta.servers = self.server_counts.take()
            self.channel.send("delta", delta, lag, self.push)


class WorkerServer(GatewayServer):
    """The gateway's server (both ports drain together), which tells the control plane once its
    sockets listen."""

    def __init__(self, config: uvicorn.Config, worker: WorkerGateway) -> None:
        super().__init__(config, worker)
        self.worker = worker

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the application's startup, then listen() on each socket
        self.worker.serving()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.draining()  # a successor takes the slot's sockets now (unless the node stops)
        await super().shutdown(sockets)

    def stopped_accepting(self) -> None:
        self.worker.retired()


async def _ok(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def worker_main(settings: Settings, count: int, run_dir: str, orders: Connection,
                shared: SharedListeners | list[SharedListeners] | None = None) -> None:
    """The spawned process' entry point: build everything, then wait for the supervisor to say
    which worker to be (at once, or later as the spare that replaces one that died)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded admin call otherwise
    app = WorkerGateway(settings, count, run_dir)  # the slow part (imports, the gateway): done in advance
    try:
        index = orders.recv()
    except (EOFError, KeyboardInterrupt):
        return  # the supervisor stopped before it needed this spare
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s")
    app.assign(index)
    open_files_for(app.settings, warn=index == 0)  # the limits are the same in every worker: said once
    mine = shared[index] if isinstance(shared, list) else shared  # SO_REUSEPORT: the sockets of its slot
    for other in shared if isinstance(shared, list) else ():
        if other is not mine:  # the other slots' sockets are theirs
            other.http.close()
            if other.grpc is not None:
                other.grpc.close()
    # built once the worker's shares are in its settings (the HTTP port's per-address cap is read here)
    config = uvicorn_config(app.settings, app)
    config.load()
    server = WorkerServer(config, app)
    if mine is not None:
        app.grpc_socket = mine.grpc
        server.run(sockets=[mine.http])
    else:
        server.run(sockets=[listener(settings.host, settings.port, app.reuse_port)])
