"""Failure behaviour of the HTTP data path: Triton down, deadlines, clients that leave."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton, free_port
from gateway.telemetry.recorder import Outcome
from tests.conftest import Faults
from tests.support import INFER_BODY, TOKEN, GatewayThread, admin_call, gateway_settings, get_json

pytestmark = pytest.mark.triton


def post(url: str, body: bytes = INFER_BODY, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_triton_stopped_mid_run_gives_json_503_then_recovers_without_restart(tmp_path: object) -> None:
    triton = LocalTriton.on_free_ports(models=("qc",)).start()
    settings = gateway_settings(triton.http_url, connect_timeout_s=1.0,
                                policies={"qc": {"weights": {"2": 50, "3": 50}}})
    try:
        with GatewayThread(settings) as gw:
            assert post(f"{gw.url}/v2/models/qc/infer")[0] == 200
            triton.stop()
            started = time.monotonic()
            status, headers, body = post(f"{gw.url}/v2/models/qc/infer")
            assert time.monotonic() - started < settings.connect_timeout_s + 0.5
            assert status in (502, 503)
            assert headers["content-type"] == "application/json"
            error = json.loads(body)["error"]
            assert error.startswith("gateway: ") and "127.0.0.1" not in error, "the gateway answered; no address"
            assert get_json(f"{gw.url}/readyz")[0] == 503
            triton.start()
            status, _, body = post(f"{gw.url}/v2/models/qc/infer")
            assert status == 200 and json.loads(body)["model_version"] in {"2", "3"}
            assert get_json(f"{gw.url}/readyz")[0] == 200
    finally:
        triton.stop()


def test_upstream_deadline_gives_504(triton: LocalTriton, faults: Faults) -> None:
    faults.set("qc", "3", delay_ms=1500)
    settings = gateway_settings(triton.http_url, request_timeout_s=0.5)
    with GatewayThread(settings) as gw:
        started = time.monotonic()
        status, _, body = post(f"{gw.url}/v2/models/qc/versions/3/infer")
        assert status == 504 and "0.5s" in json.loads(body)["error"]
        assert time.monotonic() - started < 1.4


def test_client_that_disconnects_cancels_its_upstream_request(triton: LocalTriton, faults: Faults) -> None:
    faults.set("qc", "3", delay_ms=2000)
    with GatewayThread(gateway_settings(triton.http_url, policies={"qc": {"weights": {"3": 100}}})) as gw:
        sock = socket.create_connection(("127.0.0.1", gw.settings.port))
        sock.sendall(b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(INFER_BODY), INFER_BODY))
        time.sleep(0.3)
        assert gw.app.upstream.open_connections == 1
        sock.close()
        deadline = time.monotonic() + 1.0  # well before Triton's 2 s answer
        while gw.app.upstream.open_connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.app.upstream.open_connections == 0, "the upstream connection was closed"
        totals = gw.app.recorder.totals
        assert any(label[:2] == ("qc", "3") and label[4] == "499" for label in totals)
        window = gw.app.recorder.window("qc", "3", 10)
        assert window.requests == 0, "a cancelled request is never counted against the version"


def test_recorder_counts_upstream_errors_but_not_client_errors(triton: LocalTriton, faults: Faults) -> None:
    faults.set("qc", "3", error_rate=1.0)
    with GatewayThread(gateway_settings(triton.http_url, policies={"qc": {"weights": {"3": 100}}})) as gw:
        status, _, body = post(f"{gw.url}/v2/models/qc/infer")
        assert status == 500 and "injected fault" in json.loads(body)["error"]
        assert post(f"{gw.url}/v2/models/qc/infer", body=b'{"inputs": []}')[0] == 400
        window = gw.app.recorder.window("qc", "3", 10)
        assert (window.requests, window.errors, window.client_errors) == (1, 1, 1)
        # the client chose the version: counted in /metrics by route, never judged
        assert post(f"{gw.url}/v2/models/qc/versions/3/infer")[0] == 500
        assert gw.app.recorder.window("qc", "3", 10) == window
        assert gw.app.recorder.totals[("qc", "3", "pinned", "http", "500")].count == 1
        assert Outcome.UPSTREAM_ERROR.value == "upstream_error"


class GarbageServer:
    """A fake upstream for faults a real Triton cannot be made to produce: it answers
    every request with bytes that are not HTTP, or closes mid-response."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.port = free_port()
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def garbage() -> Iterator[GarbageServer]:
    server = GarbageServer(b"SPAM SPAM SPAM\r\n\r\n")
    yield server
    server.close()


@pytest.fixture
def truncating() -> Iterator[GarbageServer]:
    server = GarbageServer(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\":")
    yield server
    server.close()


def test_invalid_upstream_response_is_a_502_json_never_a_traceback(garbage: GarbageServer) -> None:
    with GatewayThread(gateway_settings(f"http://127.0.0.1:{garbage.port}")) as gw:
        status, headers, body = post(f"{gw.url}/v2/models/qc/infer")
        assert status == 502 and headers["content-type"] == "application/json"
        assert "invalid HTTP response" in json.loads(body)["error"]
        assert b"Traceback" not in body


def test_upstream_closing_mid_body_is_not_a_success(truncating: GarbageServer) -> None:
    with GatewayThread(gateway_settings(f"http://127.0.0.1:{truncating.port}")) as gw:
        try:
            status, _, body = post(f"{gw.url}/v2/models/qc/infer")
        except (ConnectionError, urllib.error.URLError, http_incomplete()):
            return  # headers were out already: the client sees a broken response, as it should
        assert status == 502 and b"Traceback" not in body


def http_incomplete() -> type[Exception]:
    import http.client

    return http.client.IncompleteRead


def test_refused_connection_is_the_gateways_answer_and_names_the_server_only_to_admins() -> None:
    port = free_port()
    with GatewayThread(gateway_settings(f"http://127.0.0.1:{port}", admin_token=TOKEN)) as gw:
        status, _, body = post(f"{gw.url}/v2/models/qc/infer")
        error = json.loads(body)["error"]
        assert status == 503 and error.startswith("gateway: ") and "refused" in error, error
        assert "127.0.0.1" not in error and str(port) not in error, "no internal address in a client's answer"
        status, fleets = admin_call(gw.url, "GET", "/admin/fleets")
        (server,) = fleets["fleets"]["default"]
        assert server["server"] == f"127.0.0.1:{port}" and "refused" in server["last_error"], server


def test_many_concurrent_clients_share_a_bounded_pool(triton: LocalTriton) -> None:
    from tests.support import drive

    with GatewayThread(gateway_settings(triton.http_url, pool_size=4)) as gw:
        result = asyncio.run(drive(gw.url, 400, concurrency=32))
        assert result.statuses == {200: 400}
        assert gw.app.upstream.open_connections <= 4
