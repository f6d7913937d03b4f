"""The supervisor: N data-plane workers and the node's one control plane, in this process.

Why the control plane lives here and not in a designated worker: the supervisor is the one
process that outlives every worker. A worker killed (OOM, kill -9, a stalled loop) takes
only its in-flight requests with it; the rollout controller, the policy book, the merged
counters behind ``/metrics`` and the judge's samples are not lost with it, and scraping or
judging never competes with a worker's requests for its event loop. The control plane is the
:class:`~gateway.app.Gateway` with a :class:`~gateway.workers.deltas.MergedRecorder` and no
data listener: its FastAPI app (admin API, console, ``/metrics``, probes) is served on a Unix
socket that workers forward to, and its policy book is pushed to every worker on change.

Supervision:

- a worker that exits is replaced at once (its process sentinel wakes the loop);
- a worker that has not reported for ``worker_stall_s`` (its reports, every 250 ms, are the
  heartbeat) is killed and replaced;
- SIGTERM / SIGINT: every worker drains (its listeners close, requests in flight finish,
  bounded by ``drain_timeout_s``), then the control plane stops;
- SIGHUP: the config file is read again; if it is valid, the control plane applies what it
  can at once (tokens, and the sessions of removed ones end; declared policies; ...), the
  workers are replaced one at a time with the new settings, each new one serving before the old
  one drains, and what only a restart applies is named (``gateway.reload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, Request, Response

from gateway.admin.deps import actor
from gateway.app import Gateway
from gateway.devtools.local_triton import free_port
from gateway.listen import PortTaken, bind
from gateway.reload import Reload, changed, sort_out
from gateway.settings import Settings, SettingsError
from gateway.workers.channel import Channel, ChannelClosed
from gateway.workers.collector import WorkersCollector
from gateway.workers.deltas import Delta, MergedRecorder
from gateway.workers.fleet_counts import FleetSums
from gateway.workers.pins import VERSION_TABLE, PinService
from gateway.workers.worker import SharedListeners, worker_main

log = logging.getLogger("gateway.workers")
START_GRACE_S = 60.0  # a new worker may take this long (plus worker_stall_s) to report first
KILL_AFTER_DRAIN_S = 5.0  # on SIGTERM, a worker still running this long past drain_timeout_s is killed
LAST_REPORTS_S = 0.3  # then the workers' last reports are read from the channel
CONTROL_STOP_S = 5  # then the control plane's own server stops gracefully within this
POLICY_HEADER = "x-gateway-workers-policy"  # on every control-plane answer: "<current>/<workers>" at the latest push


class ControlPlane(Gateway):
    """The node's control plane: everything of the Gateway but the data listeners."""

    recorder_class = MergedRecorder
    recorder: MergedRecorder

    async def _start_grpc(self) -> None:
        """No gRPC listener here: the workers serve the gRPC port."""


@dataclass
class WorkerSlot:
    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    started_at: float = 0.0  # wall clock, for people and tests
    channel: Channel | None = None
    last_report: float = 0.0
    lag_s: float = 0.0
    push: int = 0  # the policy push it acknowledged
    restarts: int = 0
    reports: int = 0
    requests: int = 0  # requests it reported, over its processes' lives
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # its ports listen ("serving"): it is up


@dataclass
class MergeCost:
    """What the control plane spent on the workers' reports: for the benchmark."""

    reports: int = 0
    requests: int = 0
    seconds: float = 0.0


class Supervisor:
    def __init__(self, settings: Settings, config_file: str | None = None, overrides: dict[str, Any] | None = None,
                 count: int | None = None) -> None:
        if settings.grpc_enabled and settings.grpc_port == 0:  # every worker must listen on the same port
            settings = settings.model_copy(update={"grpc_port": free_port()})
        self.settings = settings
        self.config_file = config_file
        self.overrides = overrides or {}
        self.count = count or settings.worker_count()
        self.run_dir = tempfile.mkdtemp(prefix="gateway-workers-")
        self.control = ControlPlane(settings.model_copy(update={"grpc_enabled": False}))
        self.recorder = self.control.recorder
        self.recorder.watch_changed = self._schedule_push
        self._changed: set[str] = set()  # models whose policy changed since the last push
        self.control.book.on_change(self._policy_changed)
        self.control.throttle.on_lockout = self._lock_out  # wrong tokens: one count per node, the workers' too
        self.pins = PinService(self._pin_table)
        self.fleet_sums = FleetSums(self.control.fleets)  # /admin/fleets and gateway_fleet_server_*: the node's
        self.slots = [WorkerSlot(index) for index in range(self.count)]
        self.push = 0
        self.last_reload: Reload | None = None  # what the last SIGHUP applied, and what needs a restart
        self.cost = MergeCost()
        self._push_scheduled = False
        self._stopping = False
        self._spare: tuple[BaseProcess, Connection] | None = None
        self._retiring: set[int] = set()  # pids of old workers (SIGHUP) not yet done with their listeners
        self._context = multiprocessing.get_context("spawn")
        self.shared = None if settings.worker_reuse_port() else self._bind(settings, reuse_port=False)
        # SO_REUSEPORT: each slot's own sockets, inherited by every worker of the slot in turn, so
        # that replacing a worker never closes them (a close resets the connections they hold)
        self.slot_listeners = [] if self.shared is not None else self._bind_slots(settings)
        self._install_routes()
        self.control.registry.register(WorkersCollector(self))

    @staticmethod
    def _bind(settings: Settings, reuse_port: bool) -> SharedListeners:
        """One socket per port. Shared by every worker where the OS has no ``SO_REUSEPORT`` (or
        ``worker_listeners: shared``): the kernel hands each connection to whichever worker
        accepts first. Bound here, listening once the first worker serves."""
        grpc = settings.grpc_enabled and settings.grpc_server == "lean"  # grpcio binds its own (SO_REUSEPORT)
        return SharedListeners(bind(settings.host, settings.port, "port", reuse_port),
                               bind(settings.host, settings.grpc_port, "grpc_port", reuse_port) if grpc else None)

    def _bind_slots(self, settings: Settings) -> list[SharedListeners]:
        """``SO_REUSEPORT``: each slot's sockets. The kernel spreads connections over the slots;
        a connection queued on a slot's socket while its worker is replaced waits for the
        successor, where a socket of the worker's own would reset it when it closes (Linux
        without ``net.ipv4.tcp_migrate_req``): SIGHUP, a worker that died or stalled."""
        return [self._bind(settings, reuse_port=True) for _ in range(self.count)]

    def _close_listeners(self, listeners: list[SharedListeners]) -> None:
        """The supervisor's copies: a port closes when the last worker has closed its copy too."""
        for pair in listeners:
            for sock in (pair.http, pair.grpc):
                if sock is not None:
                    sock.close()

    # -- the control plane's own pieces ---------------------------------------------------------
    def _pin_table(self, table: str) -> Any:
        if table == VERSION_TABLE:
            return self.control.pins
        name = table.removeprefix("fleet:")
        return self.control.fleets[name].sequences if name in self.control.fleets else None

    def _install_routes(self) -> None:
        app = self.control.control

        @app.middleware("http")
        async def policy_header(request: Request, call_next: Any) -> Response:
            response: Response = await call_next(request)
            response.headers[POLICY_HEADER] = f"{self.current()}/{self.count}"
            return response

        async def workers(_: str = Depends(actor)) -> dict[str, Any]:
            return self.describe()

        app.add_api_route("/admin/workers", workers, methods=["GET"], tags=["workers"],
                          summary="the node's worker processes and the policy push each one runs")

    def current(self) -> int:
        """How many workers run the latest policy push."""
        return sum(1 for slot in self.slots if slot.channel is not None and slot.push == self.push)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"policy_push": self.push, "all_current": self.current() == self.count,
                "listeners": "reuse_port" if self.shared is None else "shared",
                "last_reload": None if self.last_reload is None else self.last_reload.document(), "workers": [
            {"index": slot.index, "pid": slot.process.pid if slot.process else None, "started_at": slot.started_at,
             "up": slot.ready.is_set(), "policy_push": slot.push, "current": slot.push == self.push,
             "restarts": slot.restarts, "requests": slot.requests, "loop_lag_s": round(slot.lag_s, 4),
             "last_report_s": round(now - slot.last_report, 3) if slot.last_report else None}
            for slot in self.slots]}

    # -- policies to every worker -----------------------------------------------------------------
    def _policy_changed(self, model: str, _policy: object) -> None:
        self._changed.add(model)
        self._schedule_push()

    def _schedule_push(self) -> None:
        if self._push_scheduled:
            return
        self._push_scheduled = True
        with contextlib.suppress(RuntimeError):  # no loop yet: the first hello sends the snapshot
            asyncio.get_running_loop().call_soon(self._push_all)
            return
        self._push_scheduled = False

    def _policies(self, models: set[str] | None = None) -> tuple[Any, ...]:
        """A push: every policy (``models`` None: a worker's first), or those of ``models`` (None
        for a model whose policy is gone), with the versions the rollouts watch."""
        book = self.control.book
        specs: dict[str, tuple[Any, int] | None]
        if models is None:
            specs = {model: (policy.spec, policy.revision) for model, policy in book.snapshot().items()}
        else:
            specs = {model: None if (policy := book.get(model)) is None else (policy.spec, policy.revision)
                     for model in models}
        return "policies", self.push, specs, set(self.recorder.watched()), book.sequence_models(), models is None

    def _push_all(self) -> None:
        """What changed since the last push, to every worker: a PUT sends its one model."""
        self._push_scheduled = False
        self.push += 1
        changed, self._changed = self._changed, set()
        message = self._policies(changed)
        for slot in self.slots:
            if slot.channel is not None:
                with contextlib.suppress(ChannelClosed):
                    slot.channel.send(*message)

    def _lock_out(self, client: str, until: float) -> None:
        """Every worker refuses ``client``'s tokens until ``until`` (monotonic: one clock per node)."""
        for slot in self.slots:
            if slot.channel is not None:
                with contextlib.suppress(ChannelClosed):
                    slot.channel.send("locked", client, until)

    # -- the channel --------------------------------------------------------------------------------
    async def _serve_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer)
        slot: WorkerSlot | None = None
        pid = 0
        try:
            _, index, pid = await channel.receive()
            slot = self.slots[index]
            if slot.process is None or slot.process.pid != pid:
                return  # a worker this supervisor already replaced
            slot.channel = channel
            slot.last_report = time.monotonic()
            channel.send(*self._policies())
            while True:
                message = await channel.receive()
                # A replaced worker (SIGHUP) still drains and reports: its counts are merged, but
                # the slot's liveness and policy are its successor's.
                current = slot.process is not None and slot.process.pid == pid
                if message[0] == "delta":
                    self.cost.seconds += channel.decode_s  # reading the report is part of its cost
                    channel.decode_s = 0.0
                    self._merge(slot, pid, current, message[1], message[2], message[3])
                elif message[0] == "auth_failed":
                    self.control.throttle.failed(message[1], message[2])
                elif message[0] == "ack" and current:
                    slot.push = message[1]
                elif message[0] == "retired":
                    self._retiring.discard(pid)
                elif message[0] == "serving" and current:
                    slot.ready.set()
                elif message[0] == "draining" and current and not self._stopping:
                    # SIGTERMed alone: its successor serves the slot's socket while it drains
                    slot.restarts += 1
                    log.warning("worker %d (pid %s) drains: replacing it", slot.index, pid)
                    self._start(slot)
        except ChannelClosed:
            pass
        except Exception:  # a bug here must not cut a worker off: it would exit, and its replacement too
            log.exception("worker %s: its channel failed", slot.index if slot else "?")
        finally:
            if slot is not None and slot.channel is channel:
                slot.channel = None
                slot.ready.clear()
            self.recorder.forget_names(pid)  # its reports came on this channel: no more will
            channel.close()

    def _merge(self, slot: WorkerSlot, pid: int, current: bool, delta: Delta, lag_s: float, push: int) -> None:
        started = time.perf_counter()
        self.recorder.merge(pid, delta)
        self.fleet_sums.merge(pid, delta.servers)
        self.cost.seconds += time.perf_counter() - started
        self.cost.reports += 1
        self.cost.requests += delta.requests()
        slot.requests += delta.requests()
        if current:
            slot.last_report = time.monotonic()
            slot.lag_s = lag_s
            slot.push = push
            slot.reports += 1

    # -- processes ------------------------------------------------------------------------------
    def _process(self, settings: Settings) -> tuple[BaseProcess, Connection]:
        """A new worker process that builds its gateway and waits to be told which worker to be."""
        orders, theirs = self._context.Pipe(duplex=False)
        process = self._context.Process(target=worker_main, name="gateway-worker",
                                        args=(settings, self.count, self.run_dir, orders,
                                              self.shared if self.shared is not None else self.slot_listeners))
        process.start()
        orders.close()
        return process, theirs

    def _start(self, slot: WorkerSlot, settings: Settings | None = None) -> None:
        """Slot ``slot`` gets a process: the spare when it has the right settings (it is built
        already: serving in milliseconds), else a new one; then a new spare is started."""
        spare, self._spare = self._spare, None
        if spare is not None and settings is None and spare[0].is_alive():
            process, orders = spare
        else:
            if spare is not None:
                spare[0].kill()
            process, orders = self._process(settings or self.settings)
        orders.send(slot.index)
        orders.close()
        slot.process, slot.started, slot.started_at, slot.last_report = process, time.monotonic(), time.time(), 0.0
        slot.ready.clear()
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, slot, process)
        log.info("worker %d started (pid %s)", slot.index, process.pid)
        self._replace_spare()

    def _replace_spare(self) -> None:
        if self._spare is None and not self._stopping:
            self._spare = self._process(self.settings)

    def _exited(self, slot: WorkerSlot, process: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(0.05)  # it has exited (its sentinel says so): reap it, for its exit code
        self.recorder.forget_worker(process.pid or 0)  # its requests are no longer in flight
        self.fleet_sums.forget(process.pid or 0)
        if slot.process is not process:
            return  # an old process of a slot that already has its replacement (SIGHUP)
        if self._stopping:
            return
        slot.restarts += 1
        log.error("worker %d (pid %s) exited with %s: replacing it", slot.index, process.pid, process.exitcode)
        self._start(slot)

    async def _watch_stalls(self) -> None:
        stall = self.settings.worker_stall_s
        while True:
            await asyncio.sleep(min(0.25, stall / 4))
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if process is None or not process.is_alive() or self._stopping:
                    continue
                since = now - (slot.last_report or slot.started)
                if since > stall + (0 if slot.last_report else START_GRACE_S):
                    log.error("worker %d (pid %s) has not reported for %.1f s (worker_stall_s %.1f): killing it",
                              slot.index, process.pid, since, stall)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid or 0, signal.SIGKILL)

    async def reload(self) -> None:
        """SIGHUP: read the config file again; apply what the control plane can at once, replace the
        workers one at a time for the rest, and name what only a restart applies (``gateway.reload``)."""
        try:
            settings = Settings.load(self.config_file, **self.overrides)
        except SettingsError as exc:
            log.error("SIGHUP: %s: keeping the running settings", exc)
            return
        if settings.grpc_enabled and settings.grpc_port == 0:
            settings = settings.model_copy(update={"grpc_port": self.settings.grpc_port})
        moved = (settings.host, settings.port, settings.grpc_port) != (self.settings.host, self.settings.port,
                                                                     self.settings.grpc_port)
        reload = sort_out(changed(self.settings, settings), True, self.config_file or "the environment")
        if self.shared is not None and moved:  # the shared sockets are bound once, at start
            reload.applied = [name for name in reload.applied if name not in ("host", "port", "grpc_port")]
            reload.restart += [name for name in ("host", "port", "grpc_port")
                               if getattr(settings, name) != getattr(self.settings, name)]
        # what is in force only after a restart stays as it is for the workers too: both planes agree
        settings = settings.model_copy(update={name: getattr(self.settings, name) for name in reload.restart})
        replaced = []
        if self.shared is None and moved:
            replaced, self.slot_listeners = self.slot_listeners, self._bind_slots(settings)
        await self.control.reconfigure(settings)  # tokens, sessions, declared policies, ...: at once
        self.settings = settings
        reload.workers_replaced = False
        self.last_reload = reload
        retiring = []
        for slot in self.slots:
            old = slot.process
            self._start(slot, settings)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(slot.ready.wait(), START_GRACE_S)
            if old is not None and old.is_alive() and old.pid is not None:
                self._retiring.add(old.pid)
                os.kill(old.pid, signal.SIGTERM)
                retiring.append(old)
        self._close_listeners(replaced)
        reload.workers_replaced = await self._retire(retiring)
        done = "workers replaced" if reload.workers_replaced else "an old worker still listens: workers_replaced false"
        log.log(logging.WARNING if reload.restart or not reload.workers_replaced else logging.INFO, "%s (%s)",
                reload.describe(), done)

    async def _retire(self, processes: list[BaseProcess]) -> bool:
        """Wait until each SIGTERMed old worker has closed its listeners (or exited): until then
        the kernel may still hand it a connection, served with the old settings (a token the
        reload removed). False when one has not within ``worker_stall_s``: it stays listed so."""
        deadline = time.monotonic() + max(self.settings.worker_stall_s, 1.0)
        try:
            while any(p.pid in self._retiring and p.is_alive() for p in processes):
                if time.monotonic() > deadline:
                    log.warning("SIGHUP: an old worker still listens after %.0f s", self.settings.worker_stall_s)
                    return False
                await asyncio.sleep(0.02)
            return True
        finally:
            self._retiring.difference_update(p.pid for p in processes)

    # -- running --------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reloads: set[asyncio.Task[None]] = set()

        def hangup() -> None:
            task = loop.create_task(self.reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, hangup)
        server = _QuietServer(uvicorn.Config(self.control, uds=os.path.join(self.run_dir, "control.sock"),
                                             lifespan="on", log_level=self.settings.log_level, access_log=False,
                                             proxy_headers=False,  # ClientAddresses.of_control reads them
                                             server_header=False, date_header=False,  # the worker's answer has them
                                             timeout_graceful_shutdown=CONTROL_STOP_S))
        serving = loop.create_task(server.serve())
        channel = await asyncio.start_unix_server(self._serve_channel, os.path.join(self.run_dir, "channel.sock"),
                                                  limit=64 << 20)
        pins = await asyncio.start_unix_server(self.pins.serve, os.path.join(self.run_dir, "pins.sock"))
        while not server.started:
            if serving.done():
                return 1
            await asyncio.sleep(0.02)
        for slot in self.slots:
            self._start(slot)  # the first one new, each next one the spare its predecessor started
        watchdog = loop.create_task(self._watch_stalls())
        log.info("gateway serving on %s:%d with %d workers (control plane pid %d)", self.settings.host,
                 self.settings.port, self.count, os.getpid())
        await stop.wait()
        log.info("stopping: draining %d workers", self.count)
        self._stopping = True
        watchdog.cancel()
        await self._drain()
        channel.close()
        pins.close()
        server.should_exit = True
        await serving
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return 0

    async def _drain(self) -> None:
        if self._spare is not None:
            self._spare[0].kill()
            self._spare[0].join(2)  # gone before the workers drain: its copies of the listeners too
            self._spare = None
        self._close_listeners([self.shared] if self.shared is not None else self.slot_listeners)
        processes = [slot.process for slot in self.slots if slot.process is not None and slot.process.is_alive()]
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid or 0, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s + KILL_AFTER_DRAIN_S
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for process in processes:
            if process.is_alive():
                log.error("worker pid %s did not drain in time: killing it", process.pid)
                process.kill()
        await asyncio.sleep(LAST_REPORTS_S)  # the last reports still in the channel


def longest_stop_s(drain_timeout_s: float) -> float:
    """The longest a supervised gateway takes from SIGTERM to exit (a pod's grace period must cover it)."""
    return drain_timeout_s + KILL_AFTER_DRAIN_S + LAST_REPORTS_S + CONTROL_STOP_S


class _QuietServer(uvicorn.Server):
    """The control plane's server: the supervisor handles the signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_supervised(settings: Settings, config_file: str | Path | None = None,
                   overrides: dict[str, Any] | None = None) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    try:
        supervisor = Supervisor(settings, str(config_file) if config_file else None, overrides)
    except PortTaken as exc:  # one line, as with one process
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    return uvloop.run(supervisor.run())
