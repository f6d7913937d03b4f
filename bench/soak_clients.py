"""The soak's clients: inference traffic that never retries, and hostile clients beside it.

Traffic goes to two replicas as a load balancer in front of them would send it: each new
connection to the next replica in turn, and to the other one when the connect is refused
(nothing was sent: the rule the gateway applies to Triton). A request, once sent, is never
sent again: every answer but 200 / OK and every exception is a failure, kept with the
connection it went on (replica, client port, when it was opened) so that the soak can tell the
requests in flight on a killed process from the others. Kinds: HTTP on a new connection per
request, HTTP on kept-alive connections (one checked for a close by the server before each
reuse, as urllib3 does), and gRPC (the gateway's own HTTP/2 client, one connection per caller
and replica).
"""

from __future__ import annotations

import asyncio
import http.client
import random
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from gateway.grpc.client_connection import NOT_CONNECTED
from gateway.grpc.status import StatusCode
from gateway.grpc.upstream import GrpcUpstream
from tests.abuse.attack import DATA, RST_STREAM, Attacker, frame, request_headers
from tests.abuse.attack import infer_message as framed_infer
from tests.fleet_support import INFER, infer_message
from tests.support import INFER_BODY

MODELS = (("qc", 0.6), ("qc_2026_12", 0.4))  # the healthy rollout's model and the failing one's


@dataclass(frozen=True)
class Endpoint:
    name: str
    http_port: int
    grpc_port: int


@dataclass(frozen=True)
class Failure:
    kind: str  # fresh | kept-alive | grpc
    replica: str
    model: str
    opened: float  # when its connection was opened (monotonic)
    client_port: int  # the connection's local port (0: none was made)
    started: float
    ended: float
    error: str


@dataclass
class Traffic:
    endpoints: list[Endpoint]
    fresh_threads: int = 2
    kept_threads: int = 3
    grpc_callers: int = 4
    per_client_rate: float = 11.0  # requests per second of each client: 99 in all
    ok: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    last_ok: dict[str, float] = field(default_factory=dict)  # replica -> when it last answered 200
    slow: list[tuple[float, float]] = field(default_factory=list)  # (started, seconds) of answers over 1 s
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _turn: int = 0

    def start(self) -> Traffic:
        self._threads = [threading.Thread(target=self._fresh, args=(i,), daemon=True)
                         for i in range(self.fresh_threads)]
        self._threads += [threading.Thread(target=self._kept, args=(i,), daemon=True)
                          for i in range(self.kept_threads)]
        self._threads.append(threading.Thread(target=lambda: asyncio.run(self._grpc()), daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def answered(self) -> int:
        return sum(self.ok.values())

    def _pace(self, next_at: float) -> float:
        """Open-loop pacing at per_client_rate; a client that fell behind starts from now (no burst)."""
        now = time.monotonic()
        if next_at > now:
            self.stop.wait(next_at - now)
        return max(next_at, time.monotonic() - 1.0) + 1.0 / self.per_client_rate

    def _order(self) -> list[Endpoint]:
        """The replicas in the order a round-robin balancer tries them for a new connection."""
        self._turn += 1
        first = self._turn % len(self.endpoints)
        return self.endpoints[first:] + self.endpoints[:first]

    def _connect(self) -> tuple[http.client.HTTPConnection, Endpoint] | None:
        for endpoint in self._order():
            connection = http.client.HTTPConnection("127.0.0.1", endpoint.http_port, timeout=30)
            try:
                connection.connect()
            except ConnectionRefusedError:
                connection.close()
                continue
            return connection, endpoint
        return None

    def _infer(self, kind: str, connection: http.client.HTTPConnection, endpoint: Endpoint, opened: float,
               rng: random.Random) -> bool:
        """One request; False when the connection must not be used again."""
        model = _model(rng)
        port = connection.sock.getsockname()[1] if connection.sock else 0
        started = time.monotonic()
        try:
            connection.request("POST", f"/v2/models/{model}/infer", INFER_BODY,
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = response.read()
        except Exception as exc:  # a failure, counted; the request is not sent again
            self.failed(kind, endpoint, model, opened, port, started, repr(exc))
            return False
        if response.status != 200:
            self.failed(kind, endpoint, model, opened, port, started, f"{response.status} {body[:200]!r}")
        else:
            self.answered_ok(kind, endpoint, started)
        return not response.will_close

    def _fresh(self, index: int) -> None:
        rng, next_at = random.Random(index), time.monotonic()
        while not self.stop.is_set():
            next_at = self._pace(next_at)
            connected = self._connect()
            if connected is None:
                self.failed("fresh", Endpoint("none", 0, 0), "", 0.0, 0, time.monotonic(), "no replica accepts")
                continue
            connection, endpoint = connected
            self._infer("fresh", connection, endpoint, time.monotonic(), rng)
            connection.close()

    def _kept(self, index: int) -> None:
        rng, next_at = random.Random(100 + index), time.monotonic()
        current: tuple[http.client.HTTPConnection, Endpoint, float] | None = None
        while not self.stop.is_set():
            next_at = self._pace(next_at)
            if current is not None and _dropped(current[0]):
                current[0].close()
                current = None
            if current is None:
                connected = self._connect()
                if connected is None:
                    self.failed("kept-alive", Endpoint("none", 0, 0), "", 0.0, 0, time.monotonic(),
                                "no replica accepts")
                    continue
                current = (*connected, time.monotonic())
            if not self._infer("kept-alive", current[0], current[1], current[2], rng):
                current[0].close()
                current = None
        if current is not None:
            current[0].close()

    async def _grpc(self) -> None:
        messages = {model: infer_message(model) for model, _ in MODELS}
        opened: dict[int, tuple[object, float]] = {}  # id(connection) -> (the connection, when first seen)

        async def caller(index: int) -> None:
            rng = random.Random(200 + index)
            clients = {e.name: GrpcUpstream(f"127.0.0.1:{e.grpc_port}") for e in self.endpoints}
            loop = asyncio.get_running_loop()
            next_at = loop.time() + index / (self.grpc_callers * self.per_client_rate)
            while not self.stop.is_set():
                delay = next_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at = max(next_at, loop.time() - 1.0) + 1.0 / self.per_client_rate
                model = _model(rng)
                for endpoint in self._order():
                    client = clients[endpoint.name]
                    connection = client._connection
                    started = time.monotonic()
                    if connection is not None and not connection.closing:
                        since = opened.setdefault(id(connection), (connection, started))[1]
                    else:
                        since = started  # a connection made by this call
                    try:
                        code, details, _ = await client.unary(INFER, messages[model], (), 30.0)
                    except Exception as exc:  # a failure, counted
                        code, details = StatusCode.UNKNOWN, repr(exc)
                    if code == StatusCode.UNAVAILABLE and details.startswith(NOT_CONNECTED):
                        continue  # refused: nothing was sent, the balancer tries the other replica
                    used = client._connection or connection
                    transport = getattr(used, "transport", None)
                    sockname = transport.get_extra_info("sockname") if transport is not None else None
                    port = sockname[1] if sockname else 0
                    if code == StatusCode.OK:
                        self.answered_ok("grpc", endpoint, started)
                    else:
                        self.failed("grpc", endpoint, model, since, port, started,
                                    f"{StatusCode(code).name} {details[:200]}")
                    break
                else:
                    self.failed("grpc", Endpoint("none", 0, 0), model, 0.0, 0, time.monotonic(), "no replica accepts")
            for client in clients.values():
                await client.aclose()

        await asyncio.gather(*(caller(i) for i in range(self.grpc_callers)))

    def answered_ok(self, kind: str, endpoint: Endpoint, started: float) -> None:
        self.ok[kind] += 1
        now = self.last_ok[endpoint.name] = time.monotonic()
        if now - started > 1.0:
            self.slow.append((started, now - started))

    def failed(self, kind: str, endpoint: Endpoint, model: str, opened: float, port: int, started: float,
               error: str) -> None:
        self.failures.append(Failure(kind, endpoint.name, model, opened, port, started, time.monotonic(), error))


def _model(rng: random.Random) -> str:
    return MODELS[0][0] if rng.random() < MODELS[0][1] else MODELS[1][0]


def _dropped(connection: http.client.HTTPConnection) -> bool:
    """The server closed (or reset) this idle kept-alive connection: readable with nothing asked."""
    sock = connection.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@dataclass
class Hostile:
    """Hostile clients on both replicas for the whole soak: slowloris heads (a header byte a
    second until the gateway cuts them), oversized bodies (announced, and chunked past the limit),
    and resets (TCP RST mid-request on the HTTP port; RST_STREAM mid-call and a TCP RST on the
    gRPC port). What each saw is counted: they are not the soak's failures."""

    endpoints: list[Endpoint]
    max_body_bytes: int
    seen: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Hostile:
        self._threads = [threading.Thread(target=target, daemon=True)
                         for target in (self._slowloris, self._oversized, self._resets)]
        for thread in self._threads:
            thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)

    def _slowloris(self, per_replica: int = 10) -> None:
        heads: list[tuple[socket.socket, int]] = []
        while not self.stop.wait(1.0):
            for endpoint in self.endpoints:
                while sum(1 for _, port in heads if port == endpoint.http_port) < per_replica:
                    try:
                        sock = socket.create_connection(("127.0.0.1", endpoint.http_port), timeout=2)
                        sock.sendall(b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: soak\r\n")
                    except OSError:
                        self.seen["slowloris: connect refused"] += 1
                        break
                    heads.append((sock, endpoint.http_port))
                    self.seen["slowloris: heads opened"] += 1
            alive = []
            for sock, port in heads:
                try:
                    sock.sendall(b"X")  # one more byte of a header that never ends
                    readable, _, _ = select.select([sock], [], [], 0)
                    if readable and not sock.recv(4096):
                        raise ConnectionResetError
                    alive.append((sock, port))
                except OSError:
                    self.seen["slowloris: heads cut by the gateway"] += 1
                    sock.close()
            heads = alive
        for sock, _ in heads:
            sock.close()

    def _oversized(self) -> None:
        turn = 0
        while not self.stop.wait(0.5):
            turn += 1
            endpoint = self.endpoints[turn % len(self.endpoints)]
            chunked = turn % 2 == 0
            connection = http.client.HTTPConnection("127.0.0.1", endpoint.http_port, timeout=10)
            try:
                if chunked:
                    chunk = b"x" * 65536
                    chunks = (chunk for _ in range(self.max_body_bytes // len(chunk) + 4))
                    connection.request("POST", "/v2/models/qc/infer", chunks, encode_chunked=True,
                                       headers={"Transfer-Encoding": "chunked"})
                else:
                    connection.putrequest("POST", "/v2/models/qc/infer")
                    connection.putheader("Content-Length", str(4 * self.max_body_bytes))
                    connection.endheaders(b"x" * 65536)  # a start of the body it announced, then nothing
                response = connection.getresponse()
                response.read()
                self.seen[f"oversized {'chunked' if chunked else 'announced'}: {response.status}"] += 1
            except OSError as exc:
                self.seen[f"oversized {'chunked' if chunked else 'announced'}: {type(exc).__name__}"] += 1
            finally:
                connection.close()

    def _resets(self) -> None:
        turn = 0
        body = framed_infer()
        while not self.stop.wait(0.2):
            turn += 1
            endpoint = self.endpoints[turn % len(self.endpoints)]
            try:
                if turn % 3 == 0:  # HTTP: half a body, then RST
                    sock = socket.create_connection(("127.0.0.1", endpoint.http_port), timeout=2)
                    sock.sendall(b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: soak\r\nContent-Length: "
                                 + str(len(INFER_BODY)).encode() + b"\r\n\r\n" + INFER_BODY[:20])
                    _reset(sock)
                    self.seen["resets: HTTP mid-body"] += 1
                elif turn % 3 == 1:  # gRPC: a call's headers and half its message, then RST_STREAM
                    attacker = Attacker(endpoint.grpc_port, timeout=2)
                    attacker.send(attacker.headers(1, request_headers()) + frame(DATA, 0, 1, body[:10])
                                  + frame(RST_STREAM, 0, 1, struct.pack(">I", 0x8)))
                    attacker.close()
                    self.seen["resets: gRPC RST_STREAM mid-call"] += 1
                else:  # gRPC: a whole call sent, the connection reset before its answer
                    attacker = Attacker(endpoint.grpc_port, timeout=2)
                    attacker.send(attacker.headers(1, request_headers()) + frame(DATA, 1, 1, body))
                    _reset(attacker.sock)
                    Attacker.live.discard(attacker)
                    self.seen["resets: gRPC TCP RST after a call"] += 1
            except OSError:
                self.seen["resets: connect refused"] += 1


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST, not a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
