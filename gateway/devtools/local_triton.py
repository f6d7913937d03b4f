"""A real Triton Inference Server on this machine, from the ``nvidia-pytriton`` wheel.

The wheel ships a complete ``tritonserver`` binary and the Python backend; nothing needs a
GPU or Docker. :class:`LocalTriton` assembles the backend folder the server expects,
starts the server in explicit model-control mode on the given ports, waits until it is
ready and stops it (SIGTERM, then SIGKILL) when asked. Tests, the demo and the benchmarks
all use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

SAMPLE_REPOSITORY = Path(__file__).resolve().parents[2] / "deploy" / "model_repository"
SAMPLE_MODELS = ("qc", "tok", "seq")  # loaded at start; `batched` and `cached` are loaded by the tests that use them
CACHE_BYTES = 16 * 1024 * 1024
# A model named per version (qc_2026_12: qc's code, a name per release) and an ensemble (pipe:
# pre -> qc v2 -> post; loading it loads pre and post): the targets of policies that split
# between model names and of canaries inside an ensemble. The demo loads them; tests that need
# them load them into the session's Triton (tests/conftest.py, fixture target_models).
TARGET_MODELS = ("qc_2026_12", "pipe")


class TritonUnavailable(RuntimeError):
    """The wheel is missing, or the server did not become ready."""


class _DiedStarting(TritonUnavailable):
    """The server was killed by a signal before it was ready."""


# Starts whose tritonserver was killed by a signal before it was ready, and which were started
# again (what `make test`'s summary lists): the wheel's server aborted so within 50 ms of its
# start, its log's one line an epoll_wait EBADF in its own gRPC poller, twice in ~65 full runs
# (~1 in 4,000 starts), both times when a test restarted it; not ours to fix, and a second start
# is as good as the first. A server that exits with a status (a bad flag, a model that fails to
# load) is not started again.
STARTS_RETRIED: list[str] = []


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Set by the test suite for each parallel worker ("low-high", high excluded): each worker and the
# servers it starts draw from a slice of their own, so two workers never pick the same port
# between one's check and its bind.
PORT_RANGE_VARIABLE = "FREE_PORT_RANGE"


def port_slice(index: int, count: int) -> str:
    """The $FREE_PORT_RANGE of worker ``index`` of ``count``: its share of the ports free_port uses
    (of this process's own slice, when it has one: a test run started by a test)."""
    low, high = _port_range() or (10000, 12000)
    size = (high - low) // count
    return f"{low + index * size}-{low + (index + 1) * size}"


def _port_range() -> tuple[int, int] | None:
    low, _ = _ephemeral_range()
    given = os.environ.get(PORT_RANGE_VARIABLE, "")
    if given:
        first, _, last = given.partition("-")
        return int(first), int(last)
    return (10000, low) if low > 12000 else None


def free_port() -> int:
    """A port that was free a moment ago, chosen below the kernel's ephemeral range (or in
    $FREE_PORT_RANGE, a parallel test worker's own slice of it).

    A port the kernel hands out for bind(0) comes from the same range as the source ports of
    outgoing connections: under a load test one of those could take it between this check and
    the server's own bind ("address already in use", seen in loaded test runs). A random port
    below that range can only be taken by another listener choosing it the same way.
    """
    chosen = _port_range()
    if chosen is not None:
        low, high = chosen
        for _ in range(100):
            port = random.randrange(low, high - 8)  # room for free_port_block's neighbours
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return _hand_out(port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return _hand_out(int(sock.getsockname()[1]))


# The ports this process handed out lately: two calls before either port is bound (a gateway's
# HTTP and gRPC ports) must not get the same one (seen once in a full run: "address already in use").
_handed_out: dict[int, None] = {}
_HANDED_OUT_KEPT = 4096


def _hand_out(port: int) -> int:
    _handed_out[port] = None
    if len(_handed_out) > _HANDED_OUT_KEPT:
        del _handed_out[next(iter(_handed_out))]
    return port


def free_port_block(count: int = 3) -> int:
    """A base port such that base..base+count-1 were all free a moment ago."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise TritonUnavailable("no block of free ports found")


_PR_SET_PDEATHSIG = 1


def dies_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent ``signum`` when its parent ends, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG), so a killed test run or ``gateway triton`` leaves no server behind.

    The kernel sends it when the *thread* that started the child ends: from any thread but the
    main one this gives None (no preexec_fn), as a server started by a short-lived thread must
    not stop with it.
    """
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls it
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent ended before the call: nothing will tell us
            os.kill(os.getpid(), signum)

    return set_parent_death_signal


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``port``: a bind as a server binds (SO_REUSEADDR, so the
    TIME_WAIT connections of a server just stopped don't count) fails."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening socket on TCP ``port`` (None: /proc cannot say)."""
    try:
        mine = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                mine.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port \
                            and f"socket:[{fields[9]}]" in mine:
                        return True
    except OSError:
        return None
    return False


def _kill_group(pgid: int) -> None:
    """SIGKILL every process still in process group ``pgid`` (looked up, so no other group is hit)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            group = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if group == pgid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def remove_regions(prefix: str) -> None:
    """Unlink every /dev/shm region whose name starts with ``prefix`` (a server's ``shm_prefix``)."""
    for region in Path("/dev/shm").glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            region.unlink()


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TritonUnavailable("nvidia-pytriton is not installed: pip install 'triton-gateway[triton]'") from exc
    return Path(pytriton.__file__).resolve().parent


def _backend_dir(root: Path, into: Path) -> Path:
    """Triton wants <dir>/python/ with the backend library, its utils and the stub."""
    python_dir = into / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    shipped = root / "tritonserver" / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(shipped / name, python_dir / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonUnavailable(f"the wheel ships no Python backend stub for Python {version}")
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return into


def log_tail(path: Path | str | None, lines: int = 12) -> list[str]:
    """A tritonserver log's last ``lines`` lines that say something (its last 8 KB read, more for
    more than 20 lines; blank lines and the rows of its model and option tables left out); none
    when there is no log."""
    if path is None:
        return []
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - max(8192, 400 * lines)))
            text = log.read().decode(errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith(("|", "+-"))][-lines:]


# Every server started in this process and not yet stopped, for ``ended_by_itself``.
_RUNNING: weakref.WeakValueDictionary[int, LocalTriton] = weakref.WeakValueDictionary()


def ended_by_itself() -> list[LocalTriton]:
    """The servers started in this process that exited on their own (a crash) and were not
    stopped yet: their logs are still there to read (stop() removes them)."""
    return [server for server in list(_RUNNING.values()) if server.returncode is not None]


@dataclass
class LocalTriton:
    """One tritonserver process. Use as a context manager or call start()/stop()."""

    repository: Path = SAMPLE_REPOSITORY
    models: tuple[str, ...] = SAMPLE_MODELS
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    faults_file: Path | None = None
    log_file: Path | None = None
    ready_timeout_s: float = 60.0
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)
    _start_id: str = field(default="", init=False, repr=False)

    @classmethod
    def on_free_ports(cls, **kwargs: object) -> Self:
        base = free_port_block(3)
        return cls(http_port=base, grpc_port=base + 1, metrics_port=base + 2, **kwargs)  # type: ignore[arg-type]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def shm_prefix(self) -> str:
        """The start of the names of this server's Python-backend regions in /dev/shm: its HTTP
        port and its start, so that a restart on the same ports never meets a region of the
        server before it, and a late stop() of an old server cannot unlink a new one's."""
        return f"triton_gateway_{self.http_port}_{self._start_id}_"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        """The exit status of a server that ended by itself (None while it runs, or not started)."""
        return self._process.poll() if self._process else None

    def command(self, backend_dir: Path) -> list[str]:
        root = _pytriton_root()
        cmd = [
            str(root / "tritonserver" / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir}",
            "--model-control-mode=explicit",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1",
            "--exit-timeout-secs=5",
            "--strict-readiness=false",
            "--log-verbose=0",
            # Triton's response cache, for the models that turn it on (the sample model `cached`);
            # the wheel ships the local cache implementation. Models without response_cache never use it.
            f"--cache-config=local,size={CACHE_BYTES}",
            f"--cache-directory={root / 'tritonserver' / 'caches'}",
            # The Python backend's shared-memory regions are named after the server (its HTTP port:
            # one server at a time has it), so stop() removes those of a server that could not.
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        cmd += [f"--load-model={name}" for name in self.models]
        return cmd

    def environment(self) -> dict[str, str]:
        root = _pytriton_root()
        env = dict(os.environ)
        libs = root.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
        # The stub runs model.py in the system libpython and finds numpy through PATH.
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        if self.faults_file is not None:
            env["TRITON_SAMPLE_FAULTS"] = str(self.faults_file)
        return env

    def start(self) -> LocalTriton:
        """Start tritonserver and wait until it is ready. A port already taken is an error (a
        tritonserver left running by an earlier start would otherwise answer "ready" for this
        one); the server gets SIGTERM when the thread that started it ends (``dies_with_parent``)."""
        if self._process is not None:
            return self
        taken = [port for port in (self.http_port, self.grpc_port, self.metrics_port) if port_in_use(port)]
        if taken:
            raise TritonUnavailable(
                f"port {', '.join(map(str, taken))} on 127.0.0.1 is already in use (a tritonserver left running? "
                f"`ss -ltnp 'sport = :{taken[0]}'` names the process); choose other ports or stop it")
        try:
            self._launch()
        except _DiedStarting as exc:
            STARTS_RETRIED.append(str(exc))
            print(f"tritonserver was killed by a signal while starting; starting it again: {exc}", file=sys.stderr)
            self._launch()
        return self

    def _launch(self) -> None:
        """Spawn tritonserver and wait until it is ready; it is stopped again if it is not."""
        self._workdir = Path(tempfile.mkdtemp(prefix="local-triton-"))
        self._start_id = self._workdir.name.removeprefix("local-triton-")
        backend_dir = _backend_dir(_pytriton_root(), self._workdir / "backends")
        log_path = self.log_file or (self._workdir / "tritonserver.log")
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(backend_dir),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=dies_with_parent(),
            )
        self.log_path = log_path
        _RUNNING[id(self)] = self
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def is_ready(self) -> bool:
        """Server live and every sample model ready (per model: strict readiness is off)."""
        try:
            for path in ["/v2/health/live", *(f"/v2/models/{m}/ready" for m in self.models)]:
                with urllib.request.urlopen(self.http_url + path, timeout=2) as resp:
                    if resp.status != 200:
                        return False
        except (urllib.error.URLError, OSError):
            return False
        return True

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                died = _DiedStarting if self._process.returncode < 0 else TritonUnavailable
                raise died(f"tritonserver exited with {self._process.returncode}; log: {self.log_path}"
                           f"{self._log_tail()}")
            if self.is_ready():
                if self._process is not None and listens_on(self._process.pid, self.http_port) is False:
                    raise TritonUnavailable(f"port {self.http_port} answers, but not from the tritonserver started "
                                            f"here (pid {self._process.pid}); log: {self.log_path}")
                return
            time.sleep(0.2)
        raise TritonUnavailable(f"tritonserver not ready after {self.ready_timeout_s:.0f}s; log: {self.log_path}"
                                f"{self._log_tail()}")

    def _log_tail(self, lines: int = 12) -> str:
        """The log's last lines, for an error: a server that failed to start is stopped and its
        working directory (the log with it) removed before anyone reads the error (an abort at
        a restart was seen once with nothing left to tell why)."""
        return "".join(f"\n  | {line}" for line in log_tail(getattr(self, "log_path", None), lines))

    def stop(self, timeout_s: float = 15.0, graceful: bool = True) -> None:
        """SIGTERM and wait: Triton closes its endpoints, answers what is in flight and unloads
        every model, polling each second (~3 s with the sample models). ``graceful=False``: SIGKILL
        at once, for a server nobody uses any more (the end of a ``with`` block)."""
        process, self._process = self._process, None
        _RUNNING.pop(id(self), None)
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        if process is not None:
            # A stub outlives a server that died by itself (a crash, SIGKILL), and one was seen
            # orphaned after a SIGTERM: whatever is left of the group goes. A server that did not
            # unload its models (killed, or a stub killed with it) leaves their regions in /dev/shm.
            _kill_group(process.pid)
            remove_regions(self.shm_prefix)
        if self._workdir is not None and self.log_file is None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> LocalTriton:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        # the block was the server's whole use: no one waits on what a graceful stop is for
        self.stop(graceful=False)
