"""The Python fronts bench/ceiling.py measures against nginx and the gateway: each a floor.

Each is a forwarder from a client's keep-alive HTTP/1.1 connection to Triton's HTTP port,
stripped down to what one layer of the gateway costs, so that the sides of one run read as a
ladder (each rung adds one thing to the rung below):

- ``pipe``: bytes relayed between the client's connection and one upstream connection of its
  own (no HTTP at all): the event loop's and the kernel's cost of two reads and two writes, the
  floor of any asyncio proxy;
- ``bare``: a raw ``asyncio.Protocol`` with httptools on both sides, one upstream connection
  per client connection, callbacks only (no task, no future): the request's head is rebuilt
  (hop-by-hop headers out, ``host`` and ``content-length`` set, as nginx does) and so is the
  answer's. No routing, metrics or limits: the floor of a Python front with this architecture;
- ``routed``: the bare front calling the gateway's per-request logic the way the pipeline does
  (policy lookup, weighted draw, version path, in-flight gauge, routing headers, one recorder
  sample), still callbacks only: what our logic costs without any async machinery;
- ``pooled``: the bare front, each request served by a task over ``gateway.upstream``'s
  keep-alive pool (the gateway's own upstream client);
- ``proxy``: the bare front handing each request to the gateway's real data-path handler,
  ``gateway.proxy.http.HttpProxy``: the policy book (qc: 2=80, 3=20), the pipeline's routing,
  in-flight counts and recorder, the body budget, the routing headers, over the same pool. What
  the gateway does minus its front (uvicorn's protocol and our bounds on it) and minus the rest
  of its process (gRPC port, control plane);
- ``rsgi_app``: the same forwarding as ``pooled`` as an RSGI application, served by granian
  (its HTTP in Rust, the application on an asyncio loop).

    python bench/ceiling_fronts.py bare --port 18600 --upstream http://127.0.0.1:8000
    granian --interface rsgi --loop uvloop --port 18601 ceiling_fronts:rsgi_app   # CEILING_UPSTREAM=...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import MutableMapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.pipeline import Pipeline, checked_model  # noqa: E402
from gateway.policy import PolicySpec  # noqa: E402
from gateway.policy_book import PolicyBook  # noqa: E402
from gateway.proxy.http import CONNECTION_KEY, HttpProxy  # noqa: E402
from gateway.routing import Decision, Policy, inflight_key  # noqa: E402
from gateway.telemetry.recorder import Recorder, http_outcome  # noqa: E402
from gateway.upstream import HttpUpstream  # noqa: E402

_HOP_BY_HOP = frozenset([b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                         b"upgrade", b"host", b"content-length", b"expect"])
_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def answer_head(status: int, headers: list[tuple[bytes, bytes]], length: int, keep_alive: bool) -> list[bytes]:
    """An answer's head as one list of pieces (joined with its body into one write)."""
    lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Status\r\n" % status]
    for name, value in headers:
        if name.lower() not in _HOP_BY_HOP:
            lines += (name, b": ", value, b"\r\n")
    lines += (b"content-length: ", str(length).encode(), b"\r\n" if keep_alive else b"\r\nconnection: close\r\n",
              b"\r\n")
    return lines


# -- pipe ----------------------------------------------------------------------------------------
class PipeFront(asyncio.Protocol):
    """Bytes from the client go to its own upstream connection and back, unread."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: _PipeBack(self), self.host, self.port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.upstream = upstream
        for data in self.early:
            upstream.write(data)
        self.early = []

    def data_received(self, data: bytes) -> None:
        if self.upstream is not None:
            self.upstream.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


class _PipeBack(asyncio.Protocol):
    def __init__(self, front: PipeFront) -> None:
        self.front = front

    def data_received(self, data: bytes) -> None:
        assert self.front.transport is not None
        self.front.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.front.transport is not None:
            self.front.transport.close()


# -- bare: the request parsed, the answer parsed, callbacks only ---------------------------------
class RequestFront(asyncio.Protocol):
    """httptools on the client's side: collects one request, then hands it to :meth:`serve`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.serve(self.parser.get_method(), self.url, self.headers, body, self.parser.should_keep_alive())

    def serve(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> None:
        raise NotImplementedError

    def write_answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        lines = answer_head(status, headers, len(body), keep_alive)
        lines.append(body)
        transport.write(b"".join(lines))
        if not keep_alive:
            transport.close()


class BareFront(RequestFront):
    """One upstream connection per client connection, opened with the first request."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.host_header = f"{host}:{port}".encode()
        self.back: _BareBack | None = None
        self.keep_alive = True
        self.waiting: bytes | None = None

    def serve(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> None:
        lines = [method, b" ", url, b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n"]
        for name, value in headers:
            if name not in _HOP_BY_HOP:
                lines += (name, b": ", value, b"\r\n")
        lines += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        self.keep_alive = keep_alive
        request = b"".join(lines)
        back = self.back
        if back is not None and back.transport is not None:
            back.transport.write(request)
        else:
            self.waiting = request
            if back is None:
                self.back = _BareBack(self)
                asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        back = self.back
        assert back is not None
        try:
            await loop.create_connection(lambda: back, self.host, self.port)
        except OSError:
            self.back = None
            if self.transport is not None:
                self.transport.write(_BAD_GATEWAY)
                self.transport.close()

    def answered(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.write_answer(status, headers, body, self.keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        back, self.back = self.back, None
        if back is not None and back.transport is not None:
            back.transport.close()


class _BareBack(asyncio.Protocol):
    def __init__(self, front: BareFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        waiting, self.front.waiting = self.front.waiting, None
        if waiting is not None:
            transport.write(waiting)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.connection_lost(None)

    def on_message_begin(self) -> None:
        self.headers = []
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.front.answered(self.parser.get_status_code(), self.headers, body)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.front.transport is not None:
            self.front.transport.close()
        if self.transport is not None:
            self.transport.close()


class RoutedFront(BareFront):
    """The bare front (callbacks only) with the gateway's per-request logic called the way
    ``pipeline.Pipeline.forward`` calls it: the policy looked up, a version drawn, the path
    rewritten to it, the in-flight gauge, the routing headers, one recorder sample."""

    pipeline: Pipeline  # one per process, set by main()
    decision_headers: dict[tuple[str | None, str], list[tuple[bytes, bytes]]] = {}
    peer = ""
    _started = 0.0
    _model: str | None = None
    _policy: Policy | None = None
    _decision: Decision | None = None
    _inflight: tuple[str, str] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else ""

    def serve(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> None:
        self._started = time.perf_counter()
        self._model = None
        if url.startswith(b"/v2/models/"):
            parts = url[11:].split(b"/")
            if len(parts) == 2 and parts[1] == b"infer":
                pipeline = self.pipeline
                model = self._model = checked_model(parts[0].decode())
                policy = self._policy = pipeline.book.get(model)
                decision = self._decision = pipeline.route(policy, headers)
                self._inflight = inflight_key(model, policy, decision)
                if self._inflight is not None:
                    pipeline.recorder.add_inflight(self._inflight)
                if decision.version is not None:
                    url = b"/v2/models/%s/versions/%s/infer" % (parts[0], decision.version.encode())
        super().serve(method, url, headers, body, keep_alive)

    def answered(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        model, decision = self._model, self._decision
        if model is None or decision is None:
            self.write_answer(status, headers, body, self.keep_alive)
            return
        pipeline = self.pipeline
        if self._inflight is not None:
            pipeline.recorder.remove_inflight(self._inflight)
        key = (decision.version, decision.reason)
        announced = self.decision_headers.get(key)
        if announced is None:
            announced = self.decision_headers[key] = [
                (name.encode(), value.encode()) for name, value in pipeline.announce(decision.version, decision.reason)]
        self.write_answer(status, headers + announced, body, self.keep_alive)
        pipeline.record(model, decision, http_outcome(status, body), status, "http", self._started, None,
                        pipeline.clients.of(self.peer, self.headers))


# -- pooled and proxy: a task per request over gateway.upstream's pool ---------------------------
class PooledFront(RequestFront):
    """The bare front; each request a task awaiting the gateway's upstream pool."""

    pool: HttpUpstream  # one per process, set by main()

    def serve(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> None:
        asyncio.get_running_loop().create_task(self._forward(method, url, headers, body, keep_alive))

    async def _forward(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                       keep_alive: bool) -> None:
        try:
            response = await self.pool.request(method, url, headers, body)
            answer = response.body() if response.complete else await response.read()
        except Exception:
            self.write_answer(502, [], b"", False)
            return
        self.write_answer(response.status, response.headers, answer, keep_alive)


class ProxyFront(RequestFront):
    """The bare front in uvicorn's place before the gateway's HttpProxy: an ASGI scope per request,
    the body handed over whole, the answer written at once (``answer``, as the gateway's own
    front offers it), the client's departure reported through ``on_lost``."""

    proxy: HttpProxy  # one per process, set by main()
    on_lost: Any = None
    task: asyncio.Task[None] | None = None
    keep_alive = True
    client: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.client = transport.get_extra_info("peername")  # once per connection, as uvicorn does

    def serve(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> None:
        parsed = httptools.parse_url(url)
        path = parsed.path.decode("ascii")
        scope = {"type": "http", "method": method.decode("ascii"), "path": path, "raw_path": parsed.path,
                 "query_string": parsed.query or b"", "headers": headers, "client": self.client, CONNECTION_KEY: self}
        self.keep_alive = keep_alive
        message = {"type": "http.request", "body": body, "more_body": False}

        async def receive() -> dict[str, Any]:
            return message

        self.task = asyncio.get_running_loop().create_task(self.proxy(scope, receive, self.send))

    async def send(self, message: MutableMapping[str, Any]) -> None:
        """Only for answers that do not come whole (the proxy's own errors, streams): not on this bench's path."""
        if message["type"] == "http.response.start":
            self._status, self._headers = message["status"], message["headers"]
        elif not message.get("more_body"):
            self.write_answer(self._status, self._headers, message.get("body", b""), self.keep_alive)

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.write_answer(status, headers, body, self.keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()


def gateway_pipeline() -> Pipeline:
    """The gateway's pipeline with the policy of bench/overhead.py (qc: 2=80, 3=20)."""
    book = PolicyBook()
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 80, "3": 20}}), 1)
    return Pipeline(book, Recorder())


# -- granian: RSGI ---------------------------------------------------------------------------------
class RsgiForwarder:
    """``pooled`` as an RSGI application: granian parses and writes HTTP in Rust."""

    def __init__(self) -> None:
        self.pool: HttpUpstream | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = HttpUpstream(os.environ["CEILING_UPSTREAM"])

    async def __call__(self, scope: Any, protocol: Any) -> None:
        pool = self.pool
        assert pool is not None
        body = await protocol()
        target = scope.path if not scope.query_string else f"{scope.path}?{scope.query_string}"
        headers = [(name.encode(), value.encode()) for name, value in scope.headers.items()]
        try:
            response = await pool.request(scope.method.encode(), target.encode(), headers, body)
            answer = response.body() if response.complete else await response.read()
        except Exception:
            protocol.response_empty(502, [])
            return
        protocol.response_bytes(response.status, [(name.decode(), value.decode()) for name, value in response.headers
                                                   if name.lower() not in _HOP_BY_HOP], answer)


rsgi_app = RsgiForwarder()


FRONTS = ("pipe", "bare", "routed", "pooled", "proxy")


async def serve(kind: str, port: int, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    host, _, upstream_port = upstream.removeprefix("http://").rstrip("/").partition(":")
    factory: Any
    if kind == "pipe":
        factory = lambda: PipeFront(host, int(upstream_port))  # noqa: E731
    elif kind == "bare":
        factory = lambda: BareFront(host, int(upstream_port))  # noqa: E731
    elif kind == "routed":
        RoutedFront.pipeline = gateway_pipeline()
        factory = lambda: RoutedFront(host, int(upstream_port))  # noqa: E731
    elif kind == "pooled":
        PooledFront.pool = HttpUpstream(upstream)
        factory = PooledFront
    else:
        ProxyFront.proxy = HttpProxy(gateway_pipeline(), HttpUpstream(upstream))
        factory = ProxyFront
    server = await loop.create_server(factory, "127.0.0.1", port, backlog=1024)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    loop.add_signal_handler(signal.SIGINT, stop.set_result, None)
    await stop
    server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=FRONTS)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="Triton's HTTP URL, e.g. http://127.0.0.1:8000")
    args = parser.parse_args()
    uvloop.run(serve(args.kind, args.port, args.upstream))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
