"""Fleets against TWO real Triton servers (the session's ``triton_pair``): balance, load across the
fleet, a server killed under load and brought back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from tests.fleet_support import INFER as INFER_PATH
from tests.fleet_support import drive_grpc, fleet_settings, infer_message, ready_versions, successes
from tests.processes import stub_regions
from tests.support import (
    INFER_BODY,
    TOKEN,
    GatewayProcess,
    GatewayThread,
    LoadResult,
    LoadThread,
    admin_call,
    drive,
    wait_for,
)

pytestmark = pytest.mark.triton


def shares(before: tuple[int, int], pair: tuple[LocalTriton, LocalTriton]) -> tuple[int, int]:
    return successes(pair[0]) - before[0], successes(pair[1]) - before[1]


def counted_shares(before: tuple[int, int], pair: tuple[LocalTriton, LocalTriton],
                   sent: int) -> tuple[int, int]:
    def all_counted() -> tuple[int, int] | None:
        counted = shares(before, pair)
        return counted if sum(counted) >= sent else None

    counted: tuple[int, int] = wait_for(all_counted, 10, interval=0.05, what=f"Triton to count all {sent} answers")
    return counted


def test_http_and_grpc_requests_split_evenly_between_two_servers(triton_pair: tuple[LocalTriton, LocalTriton],
                                                                 tmp_path: Path) -> None:
    """The gateway runs as its own process here, as it does in production. In a thread of the
    process that also drives the load, the driver and the gateway share one GIL: gRPC answers from
    one server then sat unread for ~150 ms at a time (measured: 8 requests stuck on one server while
    the other served everything), and power-of-two-choices rightly sent the traffic elsewhere,
    44-60% splits. As a process: 48-52% over 8 runs of each protocol, until a full CI run on a
    busy node read 5541/4459: the balancer then steered on every difference of one request in
    flight, so shares followed which Triton the scheduler favoured; it now steers on a clear gap
    only (see gateway/fleet/balancer.py), and equal servers alternate.

    The load is paced (600 req/s, within what this node serves): an unpaced closed loop saturates
    two cores with four busy processes, and then one Triton at a time sits descheduled with 8
    calls in flight while the other answers (sampled from /admin/fleets: (0, 8), (8, 1), ...).
    Those servers are not equal, and steering from the stalled one is the balancer's job, not a
    fault: 37/63 splits under load average 6. Paced, both protocols split 4989-5011 under the same load.
    Triton counts a success after its answer is sent, so the counts are read once both have
    counted all of them."""
    env = {"GATEWAY_TRITON_URL": triton_pair[0].http_url, "GATEWAY_TRITON_GRPC_URL": triton_pair[0].grpc_url,
           "GATEWAY_FLEETS": json.dumps({"default": {"servers": [{"http": s.http_url, "grpc": s.grpc_url}
                                                                 for s in triton_pair]}}),
           "GATEWAY_POLICIES": json.dumps({"qc": {"weights": {"2": 100}}}), "GATEWAY_ADMIN_TOKEN": TOKEN,
           "GATEWAY_STORE_URL": f"sqlite:///{tmp_path / 'state.db'}"}
    gw = GatewayProcess(env).start()
    try:
        before = (successes(triton_pair[0]), successes(triton_pair[1]))
        result = asyncio.run(drive(gw.url, 10_000, concurrency=16, rate=600))
        assert result.statuses == Counter({200: 10_000}), result.failures[:3]
        first, second = counted_shares(before, triton_pair, 10_000)
        assert first + second == 10_000
        assert 0.45 <= first / 10_000 <= 0.55, (first, second)

        before = (successes(triton_pair[0]), successes(triton_pair[1]))
        codes = asyncio.run(drive_grpc(f"127.0.0.1:{gw.grpc_port}", 10_000, concurrency=16, rate=600))
        assert codes == Counter({StatusCode.OK: 10_000}), codes
        first, second = counted_shares(before, triton_pair, 10_000)
        assert first + second == 10_000
        assert 0.45 <= first / 10_000 <= 0.55, (first, second)
        status, body = admin_call(gw.url, "GET", "/admin/fleets")
        servers = body["fleets"]["default"]
        assert status == 200 and len(servers) == 2 and all(int(s["requests"]) > 8_000 for s in servers), body
    finally:
        gw.stop()


def test_a_load_answers_200_only_when_ready_on_both_and_fails_on_neither_half(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    first, second = triton_pair
    with GatewayThread(fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}})) as gw:
        # version 5 exists in the first server's repository only: the second refuses, the first is undone
        status, body = admin_call(gw.url, "POST", "/admin/models/qc/versions/5/load")
        assert status == 422, body
        assert second.http_url.removeprefix("http://") in body["error"], body
        assert ready_versions(first) == ready_versions(second) == {"1", "2", "3"}

        # READY on one server only (loaded behind the gateway's back): no weight for it
        _triton_load(first, "qc", [1, 2, 3, 5])
        wait_for(lambda: "5" in ready_versions(first), 30, what="version 5 on the first server")
        status, body = admin_call(gw.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 90, "5": 10}})
        assert status == 409 and second.http_url.removeprefix("http://") in body["error"], body
        _triton_load(first, "qc", [1, 2, 3])

        # unload, then load through the gateway: 200 means READY on both
        status, body = admin_call(gw.url, "POST", "/admin/models/qc/versions/1/unload")
        assert status == 200, body
        assert ready_versions(first) == ready_versions(second) == {"2", "3"}
        status, body = admin_call(gw.url, "POST", "/admin/models/qc/versions/1/load")
        assert status == 200 and body["state"] == "READY", body
        assert ready_versions(first) == ready_versions(second) == {"1", "2", "3"}
        status, body = admin_call(gw.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 90, "1": 10}})
        assert status == 200, body


def _triton_load(server: LocalTriton, model: str, versions: list[int]) -> None:
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/config", timeout=5) as response:
        config = json.loads(response.read())
    config["version_policy"] = {"specific": {"versions": versions}}
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/repository/models/{model}/load", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


class PacedLoad(LoadThread):
    """~``rate`` inference requests per second from a thread, every response counted with its time."""

    def __init__(self, url: str, rate: float = 200, concurrency: int = 8) -> None:
        super().__init__()
        self.url, self.interval, self.concurrency = url, concurrency / rate, concurrency
        self.result = LoadResult()
        self.failed_at: list[float] = []
        self.served_at: list[float] = []

    async def _run(self) -> None:
        from gateway.upstream import HttpUpstream

        client = HttpUpstream(self.url, max_connections=self.concurrency, request_timeout_s=10)

        async def worker(offset: float) -> None:
            await asyncio.sleep(offset)
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                    payload = await response.read()
                    status = response.status
                except Exception as exc:  # counted; the test asserts on it
                    payload, status = repr(exc).encode(), 0
                self.result.statuses[status] += 1
                if status == 200:
                    self.served_at.append(time.monotonic())
                else:
                    self.result.failures.append(payload.decode(errors="replace")[:200])
                    self.failed_at.append(time.monotonic())
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

        await asyncio.gather(*(worker(i * self.interval / self.concurrency) for i in range(self.concurrency)))
        await client.aclose()


class PacedGrpcLoad(PacedLoad):
    """The same over gRPC (our lean HTTP/2 client), counting status codes."""

    def __init__(self, address: str, rate: float = 50, concurrency: int = 4) -> None:
        super().__init__("", rate, concurrency)
        self.address = address
        self.codes: Counter[int] = Counter()

    async def _run(self) -> None:
        from gateway.grpc.upstream import GrpcUpstream

        client, message = GrpcUpstream(self.address), infer_message()

        async def worker(offset: float) -> None:
            await asyncio.sleep(offset)
            while not self._stop.is_set():
                started = time.monotonic()
                code, details, _ = await client.unary(INFER_PATH, message, (), 10.0)
                self.codes[code] += 1
                if code != StatusCode.OK:
                    self.result.failures.append(details[:200])
                    self.failed_at.append(time.monotonic())
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

        await asyncio.gather(*(worker(i * self.interval / self.concurrency) for i in range(self.concurrency)))
        await client.aclose()


def test_a_server_killed_under_load_is_ejected_and_rejoins_with_the_fleets_versions(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    first, second = triton_pair
    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        fleet = gw.app.fleets.default
        victim = next(s for s in fleet.servers.values() if s.spec.http == second.http_url)
        # the fleet's loaded set becomes {2, 3}: the restarted server (which loads 1, 2, 3 at start) must match it
        assert admin_call(gw.url, "POST", "/admin/models/qc/versions/1/unload")[0] == 200
        try:
            with PacedLoad(gw.url, rate=200) as load, \
                    PacedGrpcLoad(f"127.0.0.1:{gw.settings.grpc_port}", rate=50) as grpc_load:
                load_started = time.monotonic()
                time.sleep(1.0)
                assert second.pid is not None
                before_kill = load.result.total
                regions = stub_regions(second.pid)
                killed_at = time.monotonic()
                os.killpg(second.pid, signal.SIGKILL)
                wait_for(lambda: not victim.in_service, 2.0, interval=0.02, what="the killed server's ejection")
                ejected_after = time.monotonic() - killed_at
                time.sleep(1.0)
                second.stop()  # reap the killed process
                left = [region for region in regions if Path("/dev/shm", region).exists()]
                during, window_ended = load.result.total - before_kill, time.monotonic()
                second.start()  # returns once Triton is ready (it loads qc 1, 2, 3 by itself)
                restarted_at = time.monotonic()
                seen_in_service: list[set[str]] = []

                def back() -> bool:
                    if victim.in_service and not seen_in_service:
                        seen_in_service.append(ready_versions(second))
                    return victim.in_service

                wait_for(back, 5.0, interval=0.02, what="the restarted server back in service")
                rejoined_after = time.monotonic() - restarted_at
                served = successes(second)
                time.sleep(1.0)
                assert successes(second) > served, "it takes traffic again"
        finally:
            admin_call(gw.url, "POST", "/admin/models/qc/versions/1/load")
    assert ejected_after < 2.0
    assert rejoined_after < 5.0, rejoined_after
    # the killed server's stubs had regions that nobody unloaded: stop() removes them
    assert regions and left == [], (regions, left)
    assert seen_in_service == [{"2", "3"}], "the fleet's loaded set was applied before it took traffic"
    failed = [t for t in load.failed_at]
    assert len(failed) <= load.concurrency, load.result.failures  # at most the requests in flight at the kill
    assert all(killed_at <= t <= killed_at + 1.0 for t in failed), load.result.failures
    # the steady client kept being served meanwhile: no pause of a second in its answers from the kill until
    # the killed server was reaped, and at least half the rate it had before the kill. (A fixed floor of 150
    # answers read 128 once in a full suite, cause not traced: each of its clients sends again only once
    # answered, so a loaded machine slows it as a stalled gateway would; its own rate before the kill and the
    # gaps in its answers tell the two apart.)
    answers = [killed_at, *(t for t in load.served_at if killed_at <= t <= window_ended), window_ended]
    assert max(later - earlier for earlier, later in zip(answers, answers[1:])) < 1.0, answers
    rate_before = before_kill / (killed_at - load_started)
    assert during / (window_ended - killed_at) >= 0.5 * rate_before, (during, window_ended - killed_at, rate_before)
    # gRPC: only calls in flight at the kill fail, each with one clear UNAVAILABLE
    assert set(grpc_load.codes) <= {StatusCode.OK, StatusCode.UNAVAILABLE}, grpc_load.codes
    assert grpc_load.codes[StatusCode.UNAVAILABLE] <= grpc_load.concurrency, grpc_load.result.failures
    assert all(killed_at <= t <= killed_at + 1.0 for t in grpc_load.failed_at), grpc_load.result.failures
    assert grpc_load.codes[StatusCode.OK] > 200
    assert ready_versions(second) == ready_versions(first) == {"1", "2", "3"}


def test_per_server_metrics_and_ctl_fleets(triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """Each server's count in /metrics and in ``gateway ctl fleets`` is what that Triton says it
    served, exactly. (It used to ask each server for more than 50 of the 200: under load average
    7-12 on 2 cores the unpaced closed loop leaves one Triton at a time descheduled with calls in
    flight and the balancer rightly steers away; splits from 82/118 to 117/83 were read under
    load 9-10, and 1 run in 11 fell to 50 or below. How evenly a fleet splits is
    test_http_and_grpc_requests_split_evenly_between_two_servers's question; this one's is
    whether the gateway's per-server numbers are true.)"""
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    from tests.support import TOKEN

    with GatewayThread(fleet_settings(*triton_pair)) as gw:
        before = (successes(triton_pair[0]), successes(triton_pair[1]))
        result = asyncio.run(drive(gw.url, 200, concurrency=4))
        assert result.statuses == Counter({200: 200})
        served = counted_shares(before, triton_pair, 200)  # Triton's own count, per server
        text = urllib.request.urlopen(f"{gw.url}/metrics").read().decode()
        samples = {(s.name, s.labels.get("server")): s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name.startswith("gateway_fleet_server_")}
        names = [t.http_url.removeprefix("http://") for t in triton_pair]
        assert all(samples[("gateway_fleet_server_up", name)] == 1.0 for name in names)
        counted = tuple(samples[("gateway_fleet_server_requests_total", name)] for name in names)
        assert counted == served and sum(served) == 200, (counted, served)
        assert min(served) > 0, f"both servers served some, or per-server counts prove nothing: {served}"
        assert all(("gateway_fleet_server_ejections_total", name) in samples for name in names)

        env = {"GATEWAY_ADMIN_TOKEN": TOKEN, "PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ctl = subprocess.run([sys.executable, "-m", "gateway", "ctl", "--url", gw.url, "--json", "fleets"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert ctl.returncode == 0, ctl.stderr
        servers = json.loads(ctl.stdout)["fleets"]["default"]
        assert sorted(s["server"] for s in servers) == sorted(names)
        requests = {s["server"]: int(s["requests"]) for s in servers}
        assert tuple(requests[name] for name in names) == served, (requests, served)
        assert all(s["in_service"] and s["ready"]["qc"] == ["1", "2", "3"] for s in servers), servers
        table = subprocess.run([sys.executable, "-m", "gateway", "ctl", "--url", gw.url, "fleets"],
                               capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "200"})
        assert table.returncode == 0 and all(name in table.stdout for name in names), table.stdout
        assert "in service" in table.stdout


def _http_sequence_step(url: str, sequence_id: int, start: bool, end: bool) -> tuple[str, str]:
    body = json.loads(INFER_BODY)
    body["parameters"] = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
    request = urllib.request.Request(f"{url}/v2/models/qc/infer", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["model_version"]), response.headers["x-gateway-route"]


def _grpc_sequence_message(sequence_id: int, start: bool, end: bool) -> bytes:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest()
    request.ParseFromString(infer_message())
    request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return bytes(request.SerializeToString())


def test_a_sequence_stays_on_one_server_and_one_version_while_weights_change(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    from tritonclient.grpc import service_pb2

    from gateway.grpc.upstream import GrpcUpstream

    async def grpc_step(client: GrpcUpstream, sequence_id: int, start: bool, end: bool) -> str:
        code, details, answer = await client.unary(INFER_PATH, _grpc_sequence_message(sequence_id, start, end), (),
                                                   10.0)
        assert code == StatusCode.OK, details
        reply = service_pb2.ModelInferResponse()
        reply.ParseFromString(answer)
        return str(reply.model_version)

    async def run_sequence(url: str, grpc_address: str, protocol: str, sequence_id: int) -> list[str]:
        client = GrpcUpstream(grpc_address)
        versions: list[str] = []
        for step in range(20):
            start, end = step == 0, step == 19
            if step in (5, 12):  # the weights move, twice: away from the sequence's version, then back
                other = "3" if versions[0] == "2" else "2"
                weights = {other: 100} if step == 5 else {versions[0]: 100}
                status, body = admin_call(url, "PATCH", "/admin/models/qc/policy/weights", {"weights": weights})
                assert status == 200, body
            if protocol == "http":
                version, route = _http_sequence_step(url, sequence_id, start, end)
                assert step == 0 or route == "sequence", route
            else:
                version = await grpc_step(client, sequence_id, start, end)
            versions.append(version)
        await client.aclose()
        return versions

    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 50, "3": 50},
                                                             "sequence_affinity": True}})
    with GatewayThread(settings) as gw:
        for protocol, sequence_id in (("http", 4101), ("grpc", 4102)):
            before = [successes(server) for server in triton_pair]
            versions = asyncio.run(run_sequence(gw.url, f"127.0.0.1:{gw.settings.grpc_port}", protocol, sequence_id))
            assert len(set(versions)) == 1, (protocol, versions)
            served = counted_shares((before[0], before[1]), triton_pair, 20)  # Triton counts just after answering
            assert sorted(served) == [0, 20], (protocol, served)
            status, body = admin_call(gw.url, "PATCH", "/admin/models/qc/policy/weights",
                                      {"weights": {"2": 50, "3": 50}})
            assert status == 200, body


def test_a_dns_fleet_finds_its_server_by_name(triton: LocalTriton) -> None:
    """'localhost' resolves to 127.0.0.1 here: the fleet discovers the session's Triton by name."""
    fleet = {"dns": {"name": "localhost", "http_port": triton.http_port, "grpc_port": triton.grpc_port}}
    settings = fleet_settings(triton, fleets={"default": fleet}, fleet_dns_refresh_s=0.2)
    with GatewayThread(settings) as gw:
        result = asyncio.run(drive(gw.url, 50, concurrency=4))
        assert result.statuses == Counter({200: 50}), result.failures[:3]
        servers = gw.app.fleets.default.describe()
        assert [s["server"] for s in servers] == [f"127.0.0.1:{triton.http_port}"]
        assert servers[0]["in_service"] and servers[0]["requests"] == 50
        time.sleep(0.5)  # a few re-resolutions later, the same server (not a new one) is still there
        assert gw.app.fleets.default.describe()[0]["requests"] == 50
