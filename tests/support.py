"""Helpers for tests that run real servers: a gateway in a thread, load generation."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import uvicorn
from tritonclient.grpc import service_pb2

from gateway.app import Gateway
from gateway.devtools.local_triton import dies_with_parent, free_port
from gateway.server import uvicorn_config
from gateway.settings import Settings
from gateway.upstream import HttpUpstream
from tests.processes import state

INFER_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
).encode()


class GatewayThread:
    """A real uvicorn server running a Gateway on its own loop in a background thread.

    tritonclient's HTTP client is synchronous, so the server cannot share the test's loop.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = Gateway(settings)
        self.server = uvicorn.Server(uvicorn_config(settings, self.app))
        self.server.config.log_level = "warning"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve())
        finally:
            self._close_loop(self.loop)

    def _close_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the loop and with it its descriptors (an epoll, a wakeup pipe, signal handles: 6
        a gateway, past 1,024 in a full run when it stayed open). uvloop's close waits on every
        open transport, so the connections a test's own clients still hold are aborted first
        (uvicorn leaves a connection with a request in flight open at exit)."""
        for connection in list(self.server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(asyncio.sleep(0.01))  # the aborted transports' close callbacks
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        try:
            loop.close()
        except OSError as exc:  # a handle still open (EBUSY): its descriptors stay, the test goes on
            logging.getLogger("tests").error("the gateway on port %s left its loop open: %s", self.settings.port, exc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.settings.port}"

    def start(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()  # a slow start must not leave a gateway running into later tests
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the gateway's loop (to touch its state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Graceful first; then uvicorn's forced exit, so that no gateway outlives its test
        (one left syncing a shared store once broke a later test)."""
        if not self._thread.is_alive():
            return
        self.server.should_exit = True
        self._thread.join(12)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(10)
        if self._thread.is_alive():  # logged, not raised: the test itself may have passed (the suite turns warnings
            # into errors); each test's own Redis database keeps a survivor out of the others' state
            logging.getLogger("tests").error("the gateway on port %s did not stop within 22 s", self.settings.port)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gateway_settings(triton_url: str, **values: Any) -> Settings:
    values.setdefault("store_url", "memory://")  # never a state file in the working tree
    values.setdefault("grpc_port", free_port())
    return Settings.load(None, host="127.0.0.1", port=free_port(), triton_url=triton_url, **values)


def get_json(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@dataclass
class LoadResult:
    versions: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def share(self, version: str) -> float:
        return self.versions[version] / max(1, self.total)


async def paced(start: float, index: int, rate: float) -> None:
    """Wait for request ``index``'s slot of an open-loop schedule at ``rate`` per second."""
    delay = start + index / rate - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


async def drive(url: str, requests: int, *, concurrency: int = 16, model: str = "qc",
                headers_for: Any = None, body: bytes = INFER_BODY, path: str | None = None,
                rate: float = 0.0) -> LoadResult:
    """Send ``requests`` infer calls, ``concurrency`` at a time (request i not before i/``rate``
    seconds from the start when a rate is given); count versions and statuses.

    Uses the gateway's own pooled client as a lean load generator (httpx would cost more CPU
    than the gateway under test on these 2 cores).
    """
    client = HttpUpstream(url, max_connections=concurrency, request_timeout_s=30)
    result = LoadResult()
    target = (path or f"/v2/models/{model}/infer").encode()
    counter = iter(range(requests))
    start = asyncio.get_running_loop().time()

    async def worker() -> None:
        for index in counter:
            if rate:
                await paced(start, index, rate)
            headers = list(headers_for(index).items()) if headers_for else []
            try:
                response = await client.request(b"POST", target, [(k.encode(), v.encode()) for k, v in headers], body)
                payload = await response.read()
            except Exception as exc:  # counted, the test asserts on it
                result.failures.append(repr(exc))
                result.statuses[0] += 1
                continue
            result.statuses[response.status] += 1
            if response.status == 200:
                result.versions[json.loads(payload)["model_version"]] += 1
            else:
                result.failures.append(payload.decode(errors="replace")[:200])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return result


TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class AdminClient:
    """In-process gateway (lifespan entered) + httpx client on its ASGI app."""

    def __init__(self, settings: Settings) -> None:
        import httpx

        self.app = Gateway(settings)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gateway")
        self._lifespan = self.app.control.router.lifespan_context(self.app.control)

    async def __aenter__(self) -> AdminClient:
        await self._lifespan.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()
        await self._lifespan.__aexit__(None, None, None)

    async def request(self, method: str, path: str, *, token: str | None = TOKEN, **kwargs: Any) -> Any:
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return await self.http.request(method, path, headers=headers, **kwargs)


class GatewayProcess:
    """``gateway serve`` as a real child process (for kill -9 and restart tests)."""

    def __init__(self, env: dict[str, str], port: int | None = None) -> None:
        import os

        self.port = port or free_port()
        self.grpc_port = int(env.get("GATEWAY_GRPC_PORT", 0)) or free_port()
        self.env = {**os.environ, **env, "GATEWAY_PORT": str(self.port), "GATEWAY_HOST": "127.0.0.1",
                    "GATEWAY_GRPC_PORT": str(self.grpc_port),
                    "GATEWAY_LOG_LEVEL": "warning"}
        self.process: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=self.env,
                                        preexec_fn=dies_with_parent())
        try:
            return self.wait_ready()
        except BaseException:
            self.kill()  # a start that failed leaves no gateway behind
            raise

    def wait_ready(self) -> Self:
        # a start, not a property under test: the python process took over 20 s to import on a
        # machine loaded by parallel workers beside other work
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("gateway did not become ready")

    def kill(self) -> None:
        import signal

        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except Exception:
                self.kill()


@contextmanager
def rollout_gateway(triton_url: str, tick_s: float = 0.2) -> Iterator[GatewayThread]:
    """Where the rollout tests start: the admin API on, a fast controller tick, qc all on version 2."""
    settings = gateway_settings(triton_url, admin_token=TOKEN, controller_tick_s=tick_s,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def rollout_status(url: str, model: str = "qc") -> dict[str, Any]:
    """GET /admin/models/{model}/rollout, which must answer 200 with a document."""
    status, doc = admin_call(url, "GET", f"/admin/models/{model}/rollout")
    assert status == 200, doc
    assert isinstance(doc, dict)
    return doc


def wait_stepped(url: str, past: int, within_s: float, model: str = "qc") -> None:
    """Wait until the rollout at ``url`` goes past step ``past`` (or is promoted); it must not end
    otherwise. A timeout says where it stood and its last verdicts."""
    deadline = time.monotonic() + within_s
    while True:
        doc = rollout_status(url, model)
        assert doc["state"] in ("progressing", "promoted"), doc
        if doc["state"] == "promoted" or doc["step"] > past:
            return
        stood = {key: doc.get(key) for key in ("state", "step", "weights", "reason")}
        assert time.monotonic() < deadline, f"not past step {past} in {within_s}s: {stood}, {doc['verdicts'][-3:]}"
        time.sleep(0.1)


def admin_call(base: str, method: str, path: str, body: Any = None, token: str = TOKEN,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def infer_version(base: str, headers: dict[str, str] | None = None) -> str:
    request = urllib.request.Request(f"{base}/v2/models/qc/infer", data=INFER_BODY, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["model_version"])


class LoadThread:
    """Traffic from a thread with an event loop of its own, for the length of a ``with`` block:
    subclasses write ``_run`` and stop when ``self._stop`` is set."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class BackgroundLoad(LoadThread):
    """Steady inference traffic from a thread until stopped; every response is counted."""

    def __init__(self, url: str, concurrency: int = 8, model: str = "qc", body: bytes = INFER_BODY,
                 by_target: bool = False) -> None:
        super().__init__()
        self.url = url
        self.concurrency = concurrency
        self.model = model
        self.body = body
        self.by_target = by_target  # count answers by x-gateway-model-version (the target), not model_version
        self.result = LoadResult()
        self.started_at = 0.0
        self.seconds = 0.0
        self._sending = threading.Event()  # cleared while paused
        self._sending.set()
        self._in_flight = 0  # requests sent and not answered (the load's loop writes it, pause() reads it)

    @contextmanager
    def paused(self, within_s: float = 30.0) -> Iterator[None]:
        """No request in flight for the ``with`` block: new ones wait, the ones in flight are answered first."""
        self._sending.clear()
        try:
            deadline = time.monotonic() + within_s
            while self._in_flight:
                assert time.monotonic() < deadline, f"{self._in_flight} requests unanswered after {within_s}s"
                time.sleep(0.01)
            yield
        finally:
            self._sending.set()

    async def _run(self) -> None:
        client = HttpUpstream(self.url, max_connections=self.concurrency, request_timeout_s=30)
        target = f"/v2/models/{self.model}/infer".encode()

        async def worker() -> None:
            while not self._stop.is_set():
                self._in_flight += 1  # before the look at _sending: paused() then sees it or it sees the pause
                if not self._sending.is_set():
                    self._in_flight -= 1
                    await asyncio.sleep(0.01)
                    continue
                try:
                    response = await client.request(b"POST", target, [], self.body)
                    payload = await response.read()
                except Exception as exc:  # counted; the test asserts on it
                    self.result.failures.append(repr(exc))
                    self.result.statuses[0] += 1
                    continue
                finally:
                    self._in_flight -= 1
                self.result.statuses[response.status] += 1
                if response.status == 200:
                    self.result.versions[self._answered(response.headers, payload)] += 1
                else:
                    self.result.failures.append(payload.decode(errors="replace")[:200])

        self.started_at = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        self.seconds = time.monotonic() - self.started_at
        await client.aclose()


    def _answered(self, headers: list[tuple[bytes, bytes]], payload: bytes) -> str:
        if self.by_target:
            return next(value.decode() for name, value in headers if name.lower() == b"x-gateway-model-version")
        return str(json.loads(payload)["model_version"])


def wait_for(predicate: Any, timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` returns before
    that: one thread takes the signal when it next runs and only then stops the others, so for
    a moment (0.2-5 ms measured here, more on a busy machine) the rest run on. A Triton stopped
    by ``kill`` alone answered one more /readyz probe, in 0.56 ms (ci-25)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    stopped = (None, "t", "T", "Z", "X")  # a thread's /proc/TID is its own, as a process's is
    while running := [tid for tid in os.listdir(f"/proc/{pid}/task") if state(int(tid)) not in stopped]:
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {timeout}s after SIGSTOP: threads {running} still run")
        time.sleep(0.0005)


class GrpcBackgroundLoad(BackgroundLoad):
    """The same, over gRPC with tritonclient's asyncio client."""

    def __init__(self, grpc_url: str, concurrency: int = 4, model: str = "qc") -> None:
        super().__init__("", concurrency, model)
        self.grpc_url = grpc_url

    async def _run(self) -> None:
        import numpy as np
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.grpc import InferInput
        from tritonclient.utils import InferenceServerException

        client = grpcaio.InferenceServerClient(url=self.grpc_url)
        tensor = InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.array([[1, 2, 3, 4]], dtype=np.float32))

        async def worker() -> None:
            while not self._stop.is_set():
                try:
                    result = await client.infer(self.model, [tensor], client_timeout=30)
                except InferenceServerException as exc:
                    self.result.failures.append(str(exc)[:200])
                    self.result.statuses[0] += 1
                    continue
                self.result.statuses[200] += 1
                self.result.versions[str(result.get_response().model_version)] += 1

        self.started_at = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        self.seconds = time.monotonic() - self.started_at
        await client.close()


class HookReceiver:
    """A webhook/gate receiver on 127.0.0.1 (http.server in a thread) that records every POST.
    ``answers[path]`` is the list of statuses to answer in turn (the last one repeats; 200 if
    none); ``delay_s[path]`` holds the answer back that long."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.answers: dict[str, list[int]] = {}
        self.delay_s: dict[str, float] = {}
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.posts.append((self.path, dict(self.headers.items()), body))
                time.sleep(receiver.delay_s.get(self.path, 0.0))
                queue = receiver.answers.get(self.path, [200])
                status = queue.pop(0) if len(queue) > 1 else queue[0]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(body) for p, _, body in list(self.posts) if p == path]

    def __enter__(self) -> HookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def pipe_as_in_the_repository(triton: Any) -> None:
    """The sample ensemble ``pipe`` on ``triton`` as deploy/model_repository has it: no variant of a
    canary inside it (pipe__qc_3) loaded, qc pinned to version 2 (a promotion pins 3)."""
    from gateway.devtools.local_triton import SAMPLE_REPOSITORY
    from gateway.services.model_repository import read_model

    def post(path: str, body: bytes) -> None:
        request = urllib.request.Request(triton.http_url + path, data=body, method="POST")
        urllib.request.urlopen(request, timeout=120).close()

    post("/v2/repository/models/pipe__qc_3/unload", b"{}")
    with urllib.request.urlopen(triton.http_url + "/v2/models/pipe/config", timeout=10) as response:
        loaded = json.loads(response.read())
    wanted = read_model(SAMPLE_REPOSITORY, "pipe").config
    if loaded["ensemble_scheduling"] != wanted["ensemble_scheduling"]:
        post("/v2/repository/models/pipe/load", json.dumps({"parameters": {"config": json.dumps(wanted)}}).encode())


def tokens_request(count: int, delay_ms: int = 0) -> bytes:
    """A ModelStreamInfer request (unframed) for the sample model ``tok``: ``count`` replies, the
    first at once and the others ``delay_ms`` apart."""
    request = service_pb2.ModelInferRequest(model_name="tok")
    for name, datatype in (("text_input", "BYTES"), ("max_tokens", "INT32"), ("delay_ms", "INT32")):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend([1])
    request.inputs[0].contents.bytes_contents.append(b"hi")
    request.inputs[1].contents.int_contents.append(count)
    request.inputs[2].contents.int_contents.append(delay_ms)
    encoded: bytes = request.SerializeToString()
    return encoded
