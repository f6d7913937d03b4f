"""Triton's answers pass verbatim, the gateway's own say so, and a hung Triton is found.

A Triton of this module's own (never the session one: it is stopped with SIGSTOP here), with
the sample repository plus ``qcq``: qc with a dynamic batcher whose queue holds one request, so
Triton's real queue-full answer can be produced. The TCP path that goes silent (a blackholed
address, a node lost without a reset) is a fake: a real Triton cannot produce it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from gateway.devtools.local_triton import SAMPLE_REPOSITORY, LocalTriton
from tests.conftest import Faults
from tests.fleet_support import INFER, fleet_settings, infer_message
from tests.integration.test_http_failures import post
from tests.support import GatewayThread, gateway_settings, get_json, stop_process, wait_for

pytestmark = pytest.mark.triton
T = TypeVar("T")
QUEUE_OF_ONE = """
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""


@pytest.fixture(scope="module")
def own_triton(faults_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    repository = tmp_path_factory.mktemp("queue") / "models"
    shutil.copytree(SAMPLE_REPOSITORY, repository)
    shutil.copytree(repository / "qc", repository / "qcq")
    for version in ("2", "3", "4"):
        shutil.rmtree(repository / "qcq" / version)
    config = (repository / "qc" / "config.pbtxt").read_text().replace('name: "qc"', 'name: "qcq"')
    config = config.replace("versions: [1, 2, 3]", "versions: [1]")
    (repository / "qcq" / "config.pbtxt").write_text(config + QUEUE_OF_ONE)
    with LocalTriton.on_free_ports(repository=repository, models=("qc", "qcq"), faults_file=faults_path) as server:
        yield server


def at_once(calls: int, call: Callable[[], T]) -> list[T]:
    with ThreadPoolExecutor(calls) as pool:
        return list(pool.map(lambda _: call(), range(calls)))


def grpc_infer(address: str, message: bytes, timeout: float | None = None) -> tuple[str, str, float]:
    """(status code name, details, seconds) of one ModelInfer; ``timeout`` None: no client deadline
    (the test still gives up after 15 s, which is the failure: the call hung)."""
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        future = channel.unary_unary(INFER).future(message, timeout=timeout)
        try:
            future.result(timeout=15)
            return "OK", "", time.monotonic() - started
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", time.monotonic() - started
        except grpc.FutureTimeoutError:
            future.cancel()
            return "HUNG", "", time.monotonic() - started


STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def stream_until_fault(address: str, message: bytes, fault: Callable[[], None]) -> tuple[str, str, float]:
    """One ModelStreamInfer with no client deadline: a message answered, then ``fault()``, then a
    second message: (status code name, details, seconds from the fault to the stream's end).
    "HUNG" if nothing ended it within 15 s (the test's own limit, which is the failure)."""
    requests: queue.Queue[bytes | None] = queue.Queue()

    def sent() -> Iterator[bytes]:
        while (request := requests.get()) is not None:
            yield request

    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(1) as pool:
        call = channel.stream_stream(STREAM_INFER)(sent())
        requests.put(message)
        assert pool.submit(next, call).result(timeout=15)  # a reply: the stream works
        fault()
        started = time.monotonic()
        requests.put(message)
        pending = pool.submit(list, call)
        try:
            pending.result(timeout=15)
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        except TimeoutError:
            code, details = "HUNG", ""
        finally:
            requests.put(None)
            call.cancel()
        return code, details, time.monotonic() - started


def said_by_the_gateway(text: str) -> bool:
    return text.startswith("gateway: ") and "127.0.0.1" not in text


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_tritons_queue_full_answer_passes_as_triton_sent_it(own_triton: LocalTriton, faults: Faults,
                                                           grpc_server: str) -> None:
    faults.set("qcq", "1", delay_ms=1500)  # one runs, one waits in the queue of one: the rest are refused
    path = "/v2/models/qcq/infer"
    direct = [answer for answer in at_once(4, lambda: post(own_triton.http_url + path)) if answer[0] != 200]
    assert direct, "Triton refused nothing: the queue never filled"
    status, _, triton_body = direct[0]
    assert status == 503 and b"Exceeds maximum queue size" in triton_body
    message = infer_message("qcq")
    direct_grpc = [r for r in at_once(4, lambda: grpc_infer(own_triton.grpc_url, message, 10)) if r[0] != "OK"]
    assert direct_grpc and direct_grpc[0][0] == "UNAVAILABLE", direct_grpc
    triton_details = direct_grpc[0][1]
    settings = gateway_settings(own_triton.http_url, triton_grpc_url=own_triton.grpc_url, grpc_server=grpc_server)
    with GatewayThread(settings) as gw:
        refused = [answer for answer in at_once(4, lambda: post(gw.url + path)) if answer[0] != 200]
        assert refused, "Triton refused nothing through the gateway"
        for status, headers, body in refused:
            assert (status, body) == (503, triton_body), (status, body)
            assert "Retry-After" not in headers and "retry-after" not in headers
        address = f"127.0.0.1:{gw.settings.grpc_port}"
        refused_grpc = [r for r in at_once(4, lambda: grpc_infer(address, message, 10)) if r[0] != "OK"]
        assert refused_grpc, "Triton refused nothing through the gateway (gRPC)"
        assert all(r[:2] == ("UNAVAILABLE", triton_details) for r in refused_grpc), (refused_grpc, triton_details)
        assert sum(server.refused for server in gw.app.fleets.default.servers.values()) >= 2


def test_a_stopped_triton_fails_calls_within_the_deadline_gives_slots_back_and_returns(
        own_triton: LocalTriton) -> None:
    """SIGSTOP: the process holds its sockets and answers nothing, never a reset."""
    settings = fleet_settings(own_triton, request_timeout_s=2, upstream_keepalive_s=1,
                              upstream_keepalive_timeout_s=3, fleet_health_interval_s=0.5, connect_timeout_s=1,
                              max_inflight_per_server=4, queue_timeout_ms=200)
    pid = own_triton.pid
    assert pid is not None
    with GatewayThread(settings) as gw:
        address = f"127.0.0.1:{gw.settings.grpc_port}"
        message = infer_message("qc", "2")
        assert grpc_infer(address, message)[0] == "OK" and post(f"{gw.url}/v2/models/qc/infer")[0] == 200
        server = gw.app.fleets.default.servers[own_triton.http_url.removeprefix("http://")]
        stop_process(pid)
        try:
            calls = at_once(4, lambda: grpc_infer(address, message))  # as many as admitted, no client deadline
            for code, details, seconds in calls:
                assert code in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and said_by_the_gateway(details), calls
                assert seconds < 2 + 3, calls  # request_timeout_s, and a tick or two
            status, _, body = post(f"{gw.url}/v2/models/qc/versions/2/infer")
            error = json.loads(body)["error"]
            assert status == 504 and said_by_the_gateway(error), (status, error)
            assert server.inflight == 0 and not server.waiters, "every admission slot came back"
            wait_for(lambda: not server.in_service, 10, what="the stopped server to leave service")
            started = time.monotonic()
            status, answer = get_json(f"{gw.url}/readyz")
            assert status == 503 and time.monotonic() - started < 3 and "127.0.0.1" not in answer["error"]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: server.in_service, 15, what="the server to return after SIGCONT")
        assert grpc_infer(address, message)[0] == "OK" and post(f"{gw.url}/v2/models/qc/infer")[0] == 200


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_stream_on_a_stopped_triton_ends_unavailable_within_the_keepalive_bound(own_triton: LocalTriton,
                                                                                 grpc_server: str) -> None:
    """SIGSTOP under an open ModelStreamInfer without a client deadline: keepalive PINGs find it
    (grpcio's front once streamed through a grpc.aio channel without keepalive: it hung for ever)."""
    settings = fleet_settings(own_triton, grpc_server=grpc_server, upstream_keepalive_s=1,
                              upstream_keepalive_timeout_s=2, fleet_health_interval_s=0.5, connect_timeout_s=1)
    pid = own_triton.pid
    assert pid is not None
    with GatewayThread(settings) as gw:
        server = gw.app.fleets.default.servers[own_triton.http_url.removeprefix("http://")]
        try:
            code, details, seconds = stream_until_fault(f"127.0.0.1:{gw.settings.grpc_port}", infer_message("qc", "2"),
                                                        lambda: stop_process(pid))
            assert code == "UNAVAILABLE" and said_by_the_gateway(details), (code, details, seconds)
            assert seconds < 1 + 2 + 1 + 3, seconds  # keepalive_s + keepalive_timeout_s, PING timing, ticks
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: server.in_service, 15, what="the server to return after SIGCONT")


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_stream_to_an_unresolvable_triton_names_no_host(own_triton: LocalTriton, grpc_server: str) -> None:
    """Triton's gRPC address does not resolve (DNS): the client hears the gateway's words, not
    the internal host name (grpcio's channel put it in the status of a stream)."""
    hidden = "triton-internal.invalid"
    fleet = {"default": {"servers": [{"http": own_triton.http_url, "grpc": f"{hidden}:8001"}]}}
    settings = fleet_settings(own_triton, fleets=fleet, grpc_server=grpc_server, connect_timeout_s=2)
    with GatewayThread(settings) as gw, grpc.insecure_channel(f"127.0.0.1:{gw.settings.grpc_port}") as channel:
        call = channel.stream_stream(STREAM_INFER)(iter([infer_message("qc", "2")]), timeout=15)
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
        details = raised.value.details() or ""
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, (raised.value.code(), details)
        assert said_by_the_gateway(details) and hidden not in details and "8001" not in details, details
        assert "resolve" in details and "Unknown error" not in details, details


class SilentPath:
    """A TCP relay that can go silent: bytes either way are then dropped, nothing is closed or
    reset. A fake, for a fault a real Triton cannot produce (a blackholed address, a lost node)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                if not self.silent.is_set():
                    sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_a_silent_connection_is_dropped_by_keepalive_and_counts_toward_ejection(
        own_triton: LocalTriton, caplog: pytest.LogCaptureFixture) -> None:
    path = SilentPath(own_triton.grpc_port)
    fleet = {"default": {"servers": [{"http": own_triton.http_url, "grpc": path.address}]}}
    settings = fleet_settings(own_triton, fleets=fleet, request_timeout_s=30, upstream_keepalive_s=1,
                              upstream_keepalive_timeout_s=1, fleet_health_interval_s=0.5)
    try:
        with GatewayThread(settings) as gw:
            address = f"127.0.0.1:{gw.settings.grpc_port}"
            message = infer_message("qc", "2")
            assert grpc_infer(address, message)[0] == "OK"
            (server,) = gw.app.fleets.default.servers.values()
            path.silent.set()
            calls = at_once(3, lambda: grpc_infer(address, message))  # no client deadline; request_timeout_s 30
            for code, details, seconds in calls:
                assert code == "UNAVAILABLE" and said_by_the_gateway(details) and "keepalive" in details, calls
                assert seconds < 1 + 1 + 2, calls  # keepalive_s + keepalive_timeout_s, and a tick or two
            assert server.inflight == 0, "the admission slots came back"
            assert server.ejections == 1, "3 broken calls in a row eject the server (fleet_eject_after 3)"
            # why it was ejected, from the ejection's own log line: the server's last_error is cleared when its
            # HTTP health check (the real Triton's, every 0.5 s) puts it back, which a loaded run did before this read
            ejected = [r.getMessage() for r in caplog.records if "ejected after" in r.getMessage()]
            assert ejected and "keepalive" in ejected[0], ejected
            path.silent.clear()  # the path works again: a new connection is opened and used
            wait_for(lambda: grpc_infer(address, message, 5)[0] == "OK", 15, what="gRPC through the path again")
    finally:
        path.close()


def test_readyz_answers_from_the_live_server_while_another_hangs(own_triton: LocalTriton) -> None:
    """Fleet of two: the first server's HTTP behind a relay that goes silent (a fake: a hung node
    that keeps its connections), the second the real Triton. /readyz once asked them one after
    another and waited the first one's whole ``connect_timeout_s``; now all at once, within 1 s."""
    path = SilentPath(own_triton.http_port)
    fleet = {"default": {"servers": [{"http": f"http://{path.address}", "grpc": own_triton.grpc_url},
                                     {"http": own_triton.http_url, "grpc": own_triton.grpc_url}]}}
    # health checks far apart: the silent server stays in service, so /readyz asks it too
    settings = fleet_settings(own_triton, fleets=fleet, connect_timeout_s=5, fleet_health_interval_s=60)
    pid = own_triton.pid
    assert pid is not None
    try:
        with GatewayThread(settings) as gw:
            wait_for(lambda: len(gw.app.fleets.default.in_service()) == 2, 15, what="both servers in service")
            assert get_json(f"{gw.url}/readyz")[0] == 200
            path.silent.set()
            for _ in range(3):
                started = time.monotonic()
                status, answer = get_json(f"{gw.url}/readyz")
                assert status == 200 and time.monotonic() - started < 2.5, (status, answer)  # was 5 s
            stop_process(pid)  # now neither answers: unready within the budget, not 2 x 5 s
            try:
                started = time.monotonic()
                status, answer = get_json(f"{gw.url}/readyz")
                seconds = time.monotonic() - started
            finally:
                os.kill(pid, signal.SIGCONT)
            assert status == 503 and seconds < 2.5 and "127.0.0.1" not in answer["error"], (status, answer, seconds)
    finally:
        path.close()


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_stream_opens_on_another_server_when_the_picked_one_refuses(own_triton: LocalTriton,
                                                                      grpc_server: str) -> None:
    """Fleet of two whose first server's gRPC port refuses connections (a closed port: nothing
    of Triton's), the second the real Triton: every stream opens, on the second when the first
    is picked (grpcio's front once sent every stream to the first server)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    relay = SilentPath(own_triton.http_port)  # never silenced: only gives the second server its own name
    fleet = {"default": {"servers": [{"http": own_triton.http_url, "grpc": f"127.0.0.1:{closed.getsockname()[1]}"},
                                     {"http": f"http://{relay.address}", "grpc": own_triton.grpc_url}]}}
    settings = fleet_settings(own_triton, fleets=fleet, grpc_server=grpc_server, fleet_eject_after=100)
    try:
        with GatewayThread(settings) as gw, grpc.insecure_channel(f"127.0.0.1:{gw.settings.grpc_port}") as channel:
            for _ in range(10):
                replies = list(channel.stream_stream(STREAM_INFER)(iter([infer_message("qc", "2")]), timeout=15))
                assert len(replies) == 1
            refused = gw.app.fleets.default.servers[own_triton.http_url.removeprefix("http://")]
            assert refused.errors > 0, "the closed server was picked (and counted) at least once"
    finally:
        relay.close()
        closed.close()
