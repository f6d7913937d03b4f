"""Hostile clients on the HTTP port, over raw sockets, against the gateway in front of the real Triton.

Each attack runs in a process of its own (``http_attacks``) while a :class:`Bystander` keeps
asking ``/readyz`` and for an inference, and asserts what issue 12 asks of every attack: the
gateway's RSS stays within the stated bound (it runs in this process: ``/proc/self/status``),
the bystander is answered within 1 s throughout, the attacker gets a clear error, and Triton
counts no more inferences than the requests that completed. Timeouts are shortened (1 s) so
that each test takes a few seconds.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import drain_qc
from tests.abuse.http_attacks import (
    HEAD,
    SLOW_HEAD,
    Attack,
    connection_flood,
    exchange,
    gzip_bombs,
    huge_announcements,
    slowloris,
    trickling_bodies,
)
from tests.support import INFER_BODY, GatewayThread, gateway_settings, wait_for

pytestmark = pytest.mark.triton
MB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def triton_inferences(triton: LocalTriton) -> int:
    """Inferences Triton has executed or failed, all models: what the gateway made it do."""
    connection = http.client.HTTPConnection("127.0.0.1", triton.http_port, timeout=5)
    try:
        connection.request("GET", "/v2/models/stats")
        stats = json.loads(connection.getresponse().read())["model_stats"]
    finally:
        connection.close()
    return sum(s["inference_stats"]["success"]["count"] + s["inference_stats"]["fail"]["count"] for s in stats)


def settled_inferences(triton: LocalTriton) -> int:
    """``triton_inferences`` as a baseline: once Triton has answered every qc request sent to it
    before (an earlier test's, whose client left: Triton still runs it, and counted it against this
    test once: 63 for a bystander's 61) and the count has stopped moving."""
    drain_qc(triton)
    count = triton_inferences(triton)
    for _ in range(50):
        time.sleep(0.1)
        if (again := triton_inferences(triton)) == count:
            return count
        count = again
    raise AssertionError("Triton's count of inferences was still moving after 5 s")


class Bystander:
    """Another client, asking for ``/readyz`` and one inference every 50 ms until stopped; its
    slowest answer, its failures, the inferences it completed and the gateway's peak RSS."""

    def __init__(self, gateway: GatewayThread, keep_alive: bool = False) -> None:
        self.gateway = gateway
        self.keep_alive = keep_alive
        self.slowest = 0.0
        self.failures: list[str] = []
        self.inferences = 0
        self.rss_before = self.rss_peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ask(self, connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None) -> None:
        started = time.monotonic()
        try:
            connection.request(method, path, body=body)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                self.failures.append(f"{method} {path}: {response.status}")
            elif path.endswith("/infer"):
                self.inferences += 1
        except OSError as exc:
            self.failures.append(f"{method} {path}: {exc!r}")
        self.slowest = max(self.slowest, time.monotonic() - started)

    def _run(self) -> None:
        connection = None
        while not self._stop.is_set():
            if connection is None or not self.keep_alive:
                connection = http.client.HTTPConnection("127.0.0.1", self.gateway.settings.port, timeout=5)
            self._ask(connection, "GET", "/readyz", None)
            self._ask(connection, "POST", "/v2/models/qc/infer", INFER_BODY)
            if not self.keep_alive:
                connection.close()
            self.rss_peak = max(self.rss_peak, rss())
            self._stop.wait(0.05)
        if connection is not None:
            connection.close()

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self, rss_bound: int) -> None:
        assert not self.failures, self.failures[:5]
        assert self.inferences > 0, "the bystander completed no inference"
        assert self.slowest < 1.0, f"the bystander waited {self.slowest:.2f}s"
        grown = self.rss_peak - self.rss_before
        assert grown < rss_bound, f"RSS grew by {grown / MB:.0f} MB (bound {rss_bound / MB:.0f} MB)"


@pytest.fixture
def bounded(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, header_timeout_s=1,
                                body_idle_timeout_s=1, pool_size=4, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def test_slowloris_gets_408_and_costs_nothing(bounded: GatewayThread, triton: LocalTriton) -> None:
    """200 connections send their headers a byte every 0.25 s (and 20 send nothing at all).

    Each talker is answered 408 while its head is still coming: the 1 s deadline counts from
    the connection's start, so the bytes do not hold it open (a bound on the time between
    bytes, or none, would wait out all 40 bytes, 10 s). This is counted in bytes, not in the
    attacker's seconds: its clock measured its own lag as well (every answer read 4.7-5.5 s
    after connecting, the gateway answering the bystander meanwhile, with the attacker starved
    of CPU), while a lagging attacker sends fewer bytes, never more. A correct gateway fails
    this only if the gateway and the attacker together lag 8.75 s."""
    before = settled_inferences(triton)
    with Bystander(bounded) as bystander, Attack(slowloris, bounded.settings.port, 200, 20) as attack:
        answers = attack.result()
    bystander.check(rss_bound=64 * MB)
    assert {(status, error) for status, error, _, _ in answers} == {
        (408, "request headers not received within 1s (header_timeout_s)")}
    sent, took = max((sent, took) for _, _, sent, took in answers)
    assert sent < len(SLOW_HEAD), f"a talker sent all {sent} bytes of its head before the 408 ({took:.1f} s)"
    assert triton_inferences(triton) - before <= bystander.inferences


def test_slow_bodies_hold_no_upstream_connection(bounded: GatewayThread, triton: LocalTriton) -> None:
    """128 clients announce a 1 MB body and trickle it (pool_size is 4: if a trickling client
    held an upstream connection, the bystander would wait), then stall and get 408."""
    before = settled_inferences(triton)
    with Bystander(bounded) as bystander, Attack(trickling_bodies, bounded.settings.port, 128) as attack:
        while not attack.done():
            assert bounded.app.upstream.open_connections <= 4
            time.sleep(0.05)
        answers = attack.result()
    bystander.check(rss_bound=64 * MB)
    assert set(answers) == {(408, "request body stalled: no data for 1s (body_idle_timeout_s)")}
    assert bounded.app.proxy.bodies.held == 0, "every body's bytes were given back"
    assert triton_inferences(triton) - before <= bystander.inferences


def test_announced_bodies_over_the_limit_are_refused_unread(bounded: GatewayThread, triton: LocalTriton) -> None:
    """The issue's case: 128 clients announce Content-Length 1000000000 and start trickling."""
    before = settled_inferences(triton)
    with Bystander(bounded) as bystander, Attack(huge_announcements, bounded.settings.port, 128) as attack:
        answers = attack.result()
    bystander.check(rss_bound=64 * MB)
    assert set(answers) == {(413, "request body of 1000000000 bytes is over the limit of 67108864 bytes", True)}
    assert triton_inferences(triton) - before <= bystander.inferences


def test_connections_past_the_cap_get_503_with_retry_after(triton: LocalTriton) -> None:
    """16 connections allowed: the bystander's keep-alive one, 15 that hold, and 40 more refused."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, max_client_connections=16,
                                header_timeout_s=10)
    request = HEAD + b"content-length: %d\r\n\r\n%s" % (len(INFER_BODY), INFER_BODY)
    with GatewayThread(settings) as gateway:
        before = settled_inferences(triton)
        with Bystander(gateway, keep_alive=True) as bystander:
            wait_for(lambda: bystander.inferences, 10, what="the bystander's connection to open before the attack")
            with Attack(connection_flood, settings.port, 15, 40, request) as attack:
                refused = attack.result()
        bystander.check(rss_bound=64 * MB)
        for status, headers, body in refused:
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert body == {"error": "the gateway has 16 client connections open (max_client_connections): "
                                     "retry shortly"}
        assert len(refused) == 40 and triton_inferences(triton) - before <= bystander.inferences
        # the holders are gone: once the gateway has seen them close (a sleep raced that on a
        # loaded machine), new connections are served again
        wait_for(lambda: healthz_status(settings.port) == 200, 10, what="a new connection to be served")


def healthz_status(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status
    finally:
        connection.close()


def test_hop_by_hop_headers_are_not_forwarded_either_way(bounded: GatewayThread, triton: LocalTriton) -> None:
    """The request names extra hop-by-hop headers in Connection; Triton still answers, and
    nothing hop-by-hop comes back but our own framing. (What reaches Triton is checked in
    tests/unit/test_http_limits.py: real Triton does not echo request headers.)"""
    port = bounded.settings.port
    smuggled = HEAD + (b"connection: keep-alive, x-internal-auth\r\nx-internal-auth: let-me-in\r\n"
                       b"proxy-authorization: Basic Zm9vOmJhcg==\r\nte: trailers\r\nkeep-alive: timeout=600\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(INFER_BODY), INFER_BODY))
    upgrade_h2c = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n"
    before = settled_inferences(triton)
    with Bystander(bounded) as bystander:
        status, headers, body = asyncio.run(exchange(port, smuggled))
        upgraded_post = asyncio.run(exchange(port, HEAD + upgrade_h2c + b"content-length: %d\r\n\r\n%s" % (
            len(INFER_BODY), INFER_BODY)))
        upgraded_get = asyncio.run(exchange(port, b"GET /v2/health/ready HTTP/1.1\r\nhost: gateway\r\n"
                                            + upgrade_h2c + b"\r\n"))
    bystander.check(rss_bound=32 * MB)
    assert status == 200 and body["model_version"] == "2"
    hop_by_hop = {"keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
                  "upgrade", "x-internal-auth"}
    assert not hop_by_hop & set(headers), headers
    # httptools would hand an Upgrade request's body to the new protocol: refused, never forwarded empty
    assert upgraded_post[0] == 400 and "cannot carry Upgrade" in upgraded_post[2]["error"]
    assert upgraded_get[0] == 200 and "upgrade" not in upgraded_get[1]  # no body: served, Upgrade not honoured
    assert triton_inferences(triton) - before <= bystander.inferences + 1


def test_gzip_bomb_with_sequence_affinity(triton: LocalTriton) -> None:
    """Sequence affinity makes the gateway read the body's JSON header; an 80 MB gzip bomb
    (~80 KB on the wire) is inflated no further than 100 times its size (max_inflation_ratio;
    the 64 MiB limit before it), off the event loop, and refused with 413."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}, "sequence_affinity": True}})
    with GatewayThread(settings) as gateway:
        before = settled_inferences(triton)
        with Bystander(gateway) as bystander, Attack(gzip_bombs, settings.port, 3, 80) as attack:
            answers = attack.result()
        bystander.check(rss_bound=256 * MB)
        assert {(status, error) for status, error, size in answers} == {
            (413, f"request body decompresses to more than the limit of {100 * size} bytes (100 times its {size} "
                  "bytes: max_inflation_ratio)") for _, _, size in answers}
        assert max(size for _, _, size in answers) < 200_000
        assert triton_inferences(triton) - before <= bystander.inferences


def test_every_parse_error_is_answered_in_json(bounded: GatewayThread, triton: LocalTriton) -> None:
    """Malformed requests (a Transfer-Encoding whose last coding is not chunked, with or without
    Content-Length: the smuggling shapes) get Triton's error shape, not uvicorn's text/plain
    "Invalid HTTP request received."."""
    port = bounded.settings.port
    cases = {
        HEAD + b"transfer-encoding: gzip\r\ncontent-length: 4\r\n\r\n0\r\n\r\n":
            "malformed HTTP request: Request has invalid `Transfer-Encoding`",
        b"BREW /v2/models/qc/infer HTTP/1.1\r\nhost: gateway\r\n\r\n": "malformed HTTP request: Invalid method "
                                                                       "encountered",
        HEAD + b"content-length: x1\r\n\r\n": "malformed HTTP request: Invalid character in Content-Length",
        HEAD + b"bad header line\r\n\r\n": "malformed HTTP request: Invalid header token",
        HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n": "malformed HTTP request: Invalid character "
                                                                          "in chunk size",
    }
    before = settled_inferences(triton)
    with Bystander(bounded) as bystander:
        answers = {request: asyncio.run(exchange(port, request)) for request in cases}
    bystander.check(rss_bound=32 * MB)
    for request, error in cases.items():
        status, headers, body = answers[request]
        assert (status, headers["content-type"], body) == (400, "application/json", {"error": error}), request
    assert triton_inferences(triton) - before <= bystander.inferences


@pytest.fixture
def small_bodies(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, max_body_bytes=1 * MB,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def test_python_clients_read_the_413_of_a_body_over_the_limit(small_bodies: GatewayThread) -> None:
    """http.client sends the whole body, then reads. The gateway answers 413 at the headers and
    keeps reading and dropping what still comes (lingering close): the client reads the 413
    instead of a connection reset. Announced (Content-Length) and chunked bodies alike."""
    body = b"[" + b"0, " * (3 * MB) + b"0]"  # 9 MB, past max_body_bytes (1 MiB)
    for chunked in (False, True):
        connection = http.client.HTTPConnection("127.0.0.1", small_bodies.settings.port, timeout=10)
        try:
            connection.request("POST", "/v2/models/qc/infer", body=iter([body]) if chunked else body,
                               headers={"content-type": "application/json"}, encode_chunked=chunked)
            response = connection.getresponse()
            assert response.status == 413
            error = json.loads(response.read())["error"]
        finally:
            connection.close()
        assert "over the limit of 1048576 bytes" in error, error


def test_a_version_the_server_cannot_echo_is_still_answered(bounded: GatewayThread) -> None:
    """``1%0A2`` decodes to a version with a line break, which became a response header value
    uvicorn refuses to write: the connection dropped unanswered (100 of 100). Whatever a handler
    sets, the client gets a JSON answer."""
    for _ in range(3):
        request = HEAD.replace(b"/infer", b"/versions/1%0A2/infer") + b"content-length: %d\r\n\r\n" % len(INFER_BODY)
        status, headers, body = asyncio.run(exchange(bounded.settings.port, request + INFER_BODY))
        assert 400 <= status < 600 and headers["content-type"] == "application/json" and body["error"], body
    connection = http.client.HTTPConnection("127.0.0.1", bounded.settings.port, timeout=5)
    connection.request("GET", "/healthz")
    assert connection.getresponse().status == 200
    connection.close()


def test_the_control_gate_decides_on_the_normalised_path(bounded: GatewayThread) -> None:
    """``/v2/x/../repository/models/m/unload`` was classified as not-control and forwarded raw;
    it is refused in JSON, as are an encoded ``/`` and a read-only path spelled with ``..``."""
    port = bounded.settings.port
    for target, normalised in ((b"/v2/x/../repository/models/qc/unload", "/v2/repository/models/qc/unload"),
                               (b"/v2/repository%2Fmodels%2Fqc/unload", "/v2/repository/models/qc/unload"),
                               (b"/v2/x/%2E%2E/health/ready", "/v2/health/ready")):
        status, headers, body = asyncio.run(exchange(port, b"POST " + target + b" HTTP/1.1\r\nhost: gateway\r\n"
                                                     b"content-length: 2\r\n\r\n{}"))
        assert (status, headers["content-type"]) == (400, "application/json"), (target, body)
        assert f"resolved: {normalised}); send the normalised path" in body["error"], body
