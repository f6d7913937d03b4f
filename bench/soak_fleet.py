"""The soak's processes: a Redis store, two Tritons, two gateway replicas (one with workers), and
what /proc says about them (memory, descriptors, which process holds which client connection).

Every server listens on 127.0.0.1 only, on free ports, and is started from the main thread with
``dies_with_parent``: a soak killed by SIGKILL leaves none behind, and :meth:`stop` of each one
stops what it started (also a SIGSTOPped Triton, continued first).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gateway.devtools.local_triton import LocalTriton, dies_with_parent, free_port
from tests.processes import descendants

TOKEN = "soak-admin-token"


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 3.0) -> tuple[int, Any]:
    """An admin call: (status, JSON document); (0, reason) when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (OSError, ValueError) as exc:
        return 0, repr(exc)


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> float | None:
    """Seconds until ``predicate()`` held, None if it did not within ``timeout``."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except Exception:  # a probe that failed is "not yet"
            pass
        if time.monotonic() - started > timeout:
            return None
        time.sleep(interval)


class RedisServer:
    """redis-server with an append-only file: a restart keeps the state, as a real one would."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (make system-deps)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        with open(self.workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                 "--appendfsync", "everysec", "--dir", str(self.workdir)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
        if wait_until(self._answers, 15, 0.05) is None:
            self.stop()
            raise RuntimeError("redis-server did not start")
        return self

    def _answers(self) -> bool:
        socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        return True

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


class Triton:
    """A LocalTriton with the faults the soak plays on it."""

    def __init__(self, name: str, faults: Path, workdir: Path) -> None:
        self.name = name
        self.server = LocalTriton.on_free_ports(models=("qc", "qc_2026_12"), faults_file=faults,
                                                log_file=workdir / f"{name}.log")
        self.stopped = False

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def start(self) -> Triton:
        self.server.start()
        return self

    def kill(self) -> None:
        if self.server.pid is not None:
            os.kill(self.server.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.server._process.wait(10)  # type: ignore[union-attr]  # reaped: stop() then kills its stubs
        self.server.stop()

    def pause(self) -> None:
        if self.server.pid is not None:
            os.kill(self.server.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.server.pid is not None and self.stopped:
            os.kill(self.server.pid, signal.SIGCONT)
        self.stopped = False

    def stop(self) -> None:
        self.resume()
        self.server.stop()


class Replica:
    """``gateway serve`` as its own process (``workers`` > 1: a supervisor, its workers and a spare)."""

    def __init__(self, name: str, env: dict[str, str], workdir: Path, workers: int = 1) -> None:
        self.name, self.workers, self.workdir = name, workers, workdir
        self.port, self.grpc_port = free_port(), free_port()
        self.env = {**os.environ, **env, "GATEWAY_HOST": "127.0.0.1", "GATEWAY_PORT": str(self.port),
                    "GATEWAY_GRPC_PORT": str(self.grpc_port), "GATEWAY_WORKERS": str(workers),
                    "GATEWAY_LOG_LEVEL": "warning"}
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.killed = False  # by the soak, on purpose (until started again)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> Replica:
        with open(self.workdir / f"{self.name}.log", "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=dies_with_parent())
        self.started_at, self.killed = time.monotonic(), False
        if wait_until(self.ready, 120, 0.2) is None:
            self.kill()
            raise RuntimeError(f"{self.name} did not become ready (log: {self.workdir / f'{self.name}.log'})")
        return self

    def ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited (log: {self.workdir / f'{self.name}.log'})")
        if http_json(f"{self.url}/readyz", timeout=1)[0] != 200:
            return False
        return self.workers == 1 or all(w["up"] for w in self.worker_list())

    def worker_list(self) -> list[dict[str, Any]]:
        status, doc = http_json(f"{self.url}/admin/workers")
        return list(doc["workers"]) if status == 200 else []

    def family(self) -> set[int]:
        return {self.process.pid, *descendants(self.process.pid)} if self.process else set()

    def kill(self) -> None:
        """kill -9 of the replica (its supervisor, with workers: they end when it is gone)."""
        process = self.process
        if process is None:
            return
        family, self.killed = self.family(), True
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
        process.wait(10)
        _reap(family - {process.pid}, 10)

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        family, self.killed = self.family(), True
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        _reap(family - {process.pid}, 5)
        self.process = None


def _reap(pids: set[int], within_s: float) -> None:
    """Wait for ``pids`` to end, then SIGKILL what is left of them."""
    deadline = time.monotonic() + within_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def usage(pid: int) -> tuple[float, int] | None:
    """(RSS in MB, open descriptors) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            rss = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def client_ports_held(pid: int, server_ports: set[int]) -> set[int]:
    """The client-side ports of the connections to ``server_ports`` that process ``pid`` holds:
    which clients were on a worker at the moment it was killed."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if inode in inodes and int(local.rsplit(":", 1)[1], 16) in server_ports:
                    ports.add(int(remote.rsplit(":", 1)[1], 16))
    return ports
