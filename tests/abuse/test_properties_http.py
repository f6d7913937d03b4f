"""Properties of the HTTP port's head and connection handling, over generated requests (issue 22).

Hypothesis generates what a client controls before any body is read: the method, the path's
segments and their percent-encodings, the query, the HTTP version, header names, counts and
sizes (past each bound and just under it), ``Content-Length`` / ``Transfer-Encoding``
combinations (both, twice, negative, bad digits, chunked framing that lies), a body that is
another request (smuggling), how the bytes are cut into writes, and a second request pipelined
behind the first. Each example runs on its own connection from 127.0.0.1 against the real
gateway (in a process of its own: ``gateway_process``) in front of the real Triton; a
bystander on 127.0.0.2 asks ``/healthz`` every 50 ms throughout. After every example:

- the gateway answered each request or closed the connection, within its timeouts; every
  answer it wrote for a refused request is JSON with an ``error`` (``detail`` from FastAPI's
  routing outside ``/v2``);
- the bystander was served, each time within 1 s;
- once the example's connection closes, the gateway's connections from 127.0.0.1, its running
  request tasks and its held body bytes are back where they started;
- the gateway's RSS stays under a bound derived from the configured limits;
- Triton's request count rose by no more than the requests the example sent (a body that is a
  request must never reach Triton as one).

``FUZZ_EXAMPLES`` sets the number of examples (40 by default, derandomised so CI replays the
same ones; ``make fuzz`` runs 5,000 random ones). The worst value of each invariant goes to
``tests/abuse/worst.py``, printed at the end of the run.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.devtools.local_triton import LocalTriton
from tests.abuse import worst
from tests.abuse.attack import settled_triton_requests, triton_requests
from tests.abuse.gateway_process import GatewayProcess, GatewayState
from tests.support import INFER_BODY

pytestmark = [pytest.mark.triton, pytest.mark.property]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
MB = 1 << 20
HEADER_TIMEOUT_S = BODY_IDLE_S = 0.5
MAX_BODY, MAX_BUFFERED = 1 * MB, 4 * MB
# every request is answered or its connection closed within the head and body bounds, plus
# Triton's answer and the load of a 2-core machine
ANSWER_BOUND_S = HEADER_TIMEOUT_S + BODY_IDLE_S + 4.0
# what the gateway (in its own process) may hold for the example (all bodies at once, twice while
# copied), plus the allocator's slack and the bounded tables client-chosen strings may fill
# (HEAD is not generated: the client's parser could not tell where its answer ends)
RSS_BOUND_MB = 2 * MAX_BUFFERED / MB + 32


@dataclass
class HealthzBystander:
    """GET /healthz from 127.0.0.2 every 50 ms (a new connection each time): served, fast."""

    port: int
    slowest: float = 0.0
    failures: list[str] = field(default_factory=list)
    served: int = 0
    rss_start: float = 0.0
    asking: threading.Lock = field(default_factory=threading.Lock)  # held while a request of its own is out
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            with self.asking:
                self._ask()
            self._stop.wait(0.05)

    def _ask(self) -> None:
        started = time.monotonic()
        try:
            with socket.socket() as sock:
                sock.settimeout(5)
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", self.port))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: bystander\r\nconnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(1 << 16):
                    answer += chunk
            if not answer.startswith(b"HTTP/1.1 200"):
                self.failures.append(repr(answer[:100]))
            self.served += 1
        except OSError as exc:
            self.failures.append(repr(exc))
        self.slowest = max(self.slowest, time.monotonic() - started)

    def take_slowest(self) -> float:
        slowest, self.slowest = self.slowest, 0.0
        return slowest


@pytest.fixture(scope="module")
def port_under_test(triton: LocalTriton) -> Iterator[tuple[GatewayProcess, HealthzBystander]]:
    with GatewayProcess(triton.http_url, triton_grpc_url=triton.grpc_url, header_timeout_s=HEADER_TIMEOUT_S,
                        body_idle_timeout_s=BODY_IDLE_S, keep_alive_timeout_s=1, max_body_bytes=MAX_BODY,
                        max_buffered_body_bytes=MAX_BUFFERED, grpc_max_message_bytes=MAX_BODY, linger_s=0.5,
                        policies={"qc": {"weights": {"2": 100}}}) as gateway:
        bystander = HealthzBystander(gateway.port)
        thread = threading.Thread(target=bystander.run, daemon=True)
        thread.start()
        yield gateway, bystander
        bystander._stop.set()
        thread.join(10)


# -- what a client controls in a request's head -----------------------------------------------
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=12)
METHODS = st.one_of(st.sampled_from(["POST", "GET", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT"]),
                    TOKEN.map(str.upper), st.binary(min_size=1, max_size=8).map(lambda b: b.decode("latin-1")))
SEGMENTS = st.one_of(
    st.sampled_from(["v2", "models", "qc", "infer", "versions", "1", "2", "3", "ready", "health", "live", "config",
                     "repository", "index", "unload", "load", "generate", "stats", "..", ".", "", "%2F", "%2e%2e",
                     "%0A", "%22", "%00", "%ff", "99999999999999999999", "qc%2F..%2F..%2Frepository"]),
    TOKEN,
    st.binary(max_size=6).map(lambda b: urllib.parse.quote_from_bytes(b, safe="")),
)
PATHS = st.one_of(
    st.lists(SEGMENTS, max_size=8).map(lambda parts: "/" + "/".join(parts)),
    st.lists(SEGMENTS, max_size=6).map(lambda parts: "/v2/models/qc/" + "/".join(parts)),
    st.sampled_from(["/v2/models/qc/infer", "/v2/models/qc/versions/2/infer", "/v2/health/ready", "*",
                     "http://gateway/v2/models/qc/infer"]),
    st.integers(3950, 4100).map(lambda n: "/v2/models/qc/infer?" + "p" * n),  # around max_url_bytes
)
INFERENCES = st.sampled_from(["/v2/models/qc/infer", "/v2/models/qc/versions/2/infer", "/v2/models/qc/versions/1/infer",
                              "/v2/models/qc/infer?x=1"])
KNOWN_HEADERS = ["host", "content-type", "content-length", "transfer-encoding", "content-encoding",
                 "inference-header-content-length", "connection", "expect", "upgrade", "x-user-id", "authorization",
                 "te", "keep-alive", "trailer"]
HEADER_NAMES = st.one_of(st.sampled_from(KNOWN_HEADERS), TOKEN, st.binary(min_size=1, max_size=6).map(
    lambda b: b.decode("latin-1")))
HEADER_VALUES = st.one_of(
    st.sampled_from(["0", "1", "-1", "5", "18446744073709551616", "chunked", "gzip, chunked", "chunked, gzip",
                     "identity", "close", "keep-alive", "100-continue", "h2c", "websocket", "gzip", " 12 ", ""]),
    st.text(st.characters(max_codepoint=255), max_size=20),  # sent as latin-1: obs-text included
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),  # control characters, line breaks included
)
FRAMING = st.sampled_from(["length", "chunked", "both", "length twice", "none", "bad length", "lying length",
                           "bad chunk", "short chunks"])
SIZES = st.sampled_from([0, 10, 99, 100, 101, 150])  # header line counts around max_header_count


@st.composite
def requests(draw: st.DrawFn, smuggled: bytes = b"") -> bytes:
    if draw(st.booleans()):  # an inference Triton would serve, but for what is drawn below
        method, path, version, headers = "POST", draw(INFERENCES), "HTTP/1.1", [("host", "gateway")]
    else:
        method, path = draw(METHODS), draw(PATHS)
        version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", ""]))
        headers = [("host", "gateway")] + draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6))
    padding = draw(SIZES)
    headers += [(f"x-pad-{i}", "v") for i in range(padding)]
    big = draw(st.sampled_from([0, 0, 0, 1000, 60_000, 65_500, 70_000]))  # around max_header_bytes
    if big:
        headers.append(("x-big", "b" * big))
    body = draw(st.sampled_from([INFER_BODY, b"", b"{}", b"not json", smuggled or INFER_BODY]))
    framing = draw(FRAMING)
    if framing in ("length", "both", "length twice"):
        headers.append(("content-length", str(len(body))))
    if framing == "length twice":
        headers.append(("content-length", str(len(body) + 1)))
    if framing in ("chunked", "both", "bad chunk", "short chunks"):
        headers.append(("transfer-encoding", "chunked"))
    if framing == "bad length":
        headers.append(("content-length", draw(st.sampled_from(["-1", "1e3", "0x10", "1 2", "+5"]))))
    if framing == "lying length":
        headers.append(("content-length", str(len(body) + draw(st.sampled_from([-5, 7, 1000])))))
    headers = draw(st.permutations(headers))
    if framing in ("chunked", "both"):
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    elif framing == "bad chunk":
        body = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    elif framing == "short chunks":
        body = b"ffff\r\n" + body
    head = f"{method} {path} {version}".rstrip().encode("latin-1") + b"\r\n"
    head += b"".join(name.encode("latin-1") + b": " + value.encode("latin-1") + b"\r\n" for name, value in headers)
    return head + b"\r\n" + body


@dataclass
class Outcome:
    answers: list[tuple[int, bytes, bytes]]  # status, content-type, body
    closed: bool  # by the gateway
    took: float


class _Responses:
    """httptools' response parser, counting whole answers."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes, bytes]] = []
        self.parser = httptools.HttpResponseParser(self)
        self._type, self._body = b"", b""

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._type = value

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.answers.append((self.parser.get_status_code(), self._type, self._body))
        self._type, self._body = b"", b""


def send(port: int, data: bytes, cuts: list[int], requests_sent: int) -> Outcome:
    """Send ``data`` in pieces cut at ``cuts``; read until the gateway has answered every request
    or closed the connection, or the bound has passed."""
    started = time.monotonic()
    responses = _Responses()
    closed = False
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if b > a]
        pending = b""
        while time.monotonic() - started < ANSWER_BOUND_S + 1:
            if not pending and pieces:
                pending = pieces.pop(0)
            if pending:
                try:
                    pending = pending[sock.send(pending):]
                except BlockingIOError:
                    pass
                except OSError:
                    pending, pieces = b"", []  # the gateway closed: read what it said
            if len(responses.answers) >= requests_sent:
                break
            ready, _, _ = select.select([sock], [], [], 0.005 if pending or pieces else 0.1)
            if not ready:
                continue
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            try:
                responses.parser.feed_data(chunk)
            except httptools.HttpParserError as exc:
                raise AssertionError(f"the gateway wrote an answer that is not HTTP: {chunk[:200]!r}") from exc
    return Outcome(responses.answers, closed, time.monotonic() - started)


def _snapshot(gateway: GatewayProcess, bystander: HealthzBystander) -> GatewayState:
    """The gateway's state between two requests of the bystander (whose own tasks would count)."""
    with bystander.asking:
        return gateway.state()


@settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(first=requests(), second=st.one_of(st.none(), requests()), smuggle=st.booleans(),
       cuts=st.lists(st.integers(1, 80_000), max_size=4, unique=True).map(sorted))
def test_the_http_port_answers_every_head_and_holds_nothing_after(
        port_under_test: tuple[GatewayProcess, HealthzBystander], triton: LocalTriton,
        first: bytes, second: bytes | None, smuggle: bool, cuts: list[int]) -> None:
    gateway, bystander = port_under_test
    if smuggle:  # a whole request as the first one's body: it must never reach Triton as a request
        # cut at the end of the head: the last blank line of a chunked request is its body's end,
        # and a whole request put there is a second, pipelined request (served, rightly)
        first = first.split(b"\r\n\r\n", 1)[0] + b"\r\ncontent-length: %d\r\n\r\n" % (len(INFER_BODY) + 100) + (
            b"POST /v2/models/qc/infer HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s" % (len(INFER_BODY), INFER_BODY))
    data = first + (second or b"")
    requests_sent = 1 if second is None else 2
    start_state = _snapshot(gateway, bystander)
    before_triton = settled_triton_requests(triton)

    outcome = send(gateway.port, data, [c for c in cuts if c < len(data)], requests_sent)

    worst.note("http head: seconds to an answer or a close", outcome.took, ANSWER_BOUND_S, "s")
    assert outcome.closed or len(outcome.answers) >= requests_sent, (
        f"after {outcome.took:.1f}s: {len(outcome.answers)} answers, connection open")
    assert outcome.took <= ANSWER_BOUND_S
    for status, content_type, body in outcome.answers:
        assert 100 <= status < 600
        if status in (400, 408, 413, 414, 431, 503):  # the refusals of the front and the proxy
            assert content_type == b"application/json" and (b'"error"' in body or b'"detail"' in body), (
                status, content_type, body[:200])

    closed_at, settled = time.monotonic(), (0, start_state.tasks, start_state.held)
    while (state := _snapshot(gateway, bystander))[:3] != settled and time.monotonic() - closed_at < 5:
        time.sleep(0.02)
    released = time.monotonic() - closed_at
    worst.note("http head: seconds until the example's connection and work are released", released, 5, "s")
    if os.environ.get("FUZZ_DEBUG") and released > 1:
        print(f"\nslow release {released:.2f}s of {data[:300]!r}... ({len(data)} bytes), cuts {cuts}, "
              f"answers {[a[0] for a in outcome.answers]}, closed {outcome.closed}")
    assert state.connections == 0, f"{state.connections} connections from the example still open after it closed"
    assert state[1:3] == settled[1:], f"(tasks, held bytes) {state[1:3]} != {settled[1:]} at the start"

    if bystander.rss_start == 0:  # after the first example: the gateway's pools and caches are warm
        bystander.rss_start = state.rss_mb
    grown = state.rss_mb - bystander.rss_start
    worst.note("http head: the gateway's RSS growth since the first example", grown, RSS_BOUND_MB, " MB")
    assert grown <= RSS_BOUND_MB
    slowest = bystander.take_slowest()
    worst.note("http head: bystander's slowest /healthz", slowest, 1.0, "s")
    assert not bystander.failures, bystander.failures[:3]
    assert slowest <= 1.0, f"the bystander waited {slowest:.2f}s"
    extra = triton_requests(triton) - before_triton
    worst.note("http head: Triton requests per request sent", extra / requests_sent, 1, "")
    assert extra <= requests_sent, f"Triton saw {extra} requests; the example sent {requests_sent}"
