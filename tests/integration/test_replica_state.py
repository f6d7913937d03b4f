"""Replicas agree with the store whatever happens to it: a wiped store, unreadable records,
records from a newer version, a store outage (real Redis, real SQLite, real Triton)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from gateway.devtools.local_triton import LocalTriton, dies_with_parent, free_port
from gateway.settings import Settings
from tests.support import (
    TOKEN,
    BackgroundLoad,
    GatewayThread,
    admin_call,
    drive,
    gateway_settings,
    infer_version,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.triton


def routes_to(gateway: GatewayThread, version: str, within_s: float, since: float | None = None) -> float:
    """Seconds until ``gateway`` sends qc to ``version`` (asserts it happens within ``within_s``)."""
    started = time.monotonic() if since is None else since
    while infer_version(gateway.url) != version:
        assert time.monotonic() - started < within_s, f"{gateway.url} still routes elsewhere after {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


def sync_errors(gateway: GatewayThread, reason: str) -> float:
    text = urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'gateway_state_sync_errors_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError("gateway_state_sync_errors_total is not exported")


@pytest.mark.redis
def test_after_a_store_reset_a_put_reaches_both_replicas_within_a_second(triton: LocalTriton, redis_url: str) -> None:
    values = {"store_url": redis_url, "admin_token": TOKEN, "resync_interval_s": 30}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **values)) as b:
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})[0] == 200
        assert admin_call(a.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}})[0] == 200
        assert admin_call(a.url, "PUT", "/admin/models/tok/policy", {"weights": {"2": 100}})[0] == 200
        routes_to(b, "3", within_s=1)
        # tok's PUT came after qc's PATCH: its change may reach b a moment later
        wait_for(lambda: "tok" in b.app.book.snapshot(), 1, interval=0.02, what="tok in b's book")
        assert b.app.book.revision("qc") == 2

        client = redis.Redis.from_url(redis_url)
        client.flushall()  # the shipped k8s Redis has no volume: a restart is this
        client.close()
        changed_at = time.monotonic()
        status, doc = admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"1": 100}})
        assert (status, doc["revision"]) == (200, 1), "the wiped store counts revisions from 1 again"
        routes_to(a, "1", within_s=1, since=changed_at)
        routes_to(b, "1", within_s=1, since=changed_at)
        for replica in (a, b):  # models gone from the store leave the book (a's own write reached its
            # book at once; its rebuild comes with the change feed, within the same second)
            wait_for(lambda gw=replica: sorted(gw.app.book.snapshot()) == ["qc"],
                     1 - (time.monotonic() - changed_at), interval=0.02, what="tok to leave the book")
            assert admin_call(replica.url, "GET", "/admin/models/tok/policy")[0] == 404


@pytest.mark.redis
def test_a_corrupt_redis_record_is_skipped_and_counted_while_other_models_sync(triton: LocalTriton,
                                                                                redis_url: str) -> None:
    values = {"store_url": redis_url, "admin_token": TOKEN, "resync_interval_s": 0.3}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **values)) as b:
        assert admin_call(a.url, "PUT", "/admin/models/tok/policy", {"weights": {"2": 100}})[0] == 200
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})[0] == 200
        routes_to(b, "2", within_s=1)
        client = redis.Redis.from_url(redis_url)
        client.set("gateway:policy:tok", '{"revision": 9, "model": "tok", "spec": {"weights": ')  # cut short
        client.publish("gateway:changes", "tok")
        newer = {"revision": 7, "model": "qc", "updated_at": time.time(), "actor": "newer-gateway",
                 "spec": {"weights": {"3": 100}, "sticky_header": None, "rules": [], "canary_budget": 5}}
        client.set("gateway:policy:qc", json.dumps(newer))  # a field from a newer version
        client.publish("gateway:changes", "qc")
        client.close()
        for replica in (a, b):
            routes_to(replica, "3", within_s=1)  # the newer record is read, its unknown field ignored
            assert replica.app.book.snapshot()["tok"].revision == 1, "the unreadable model keeps its last policy"
        time.sleep(0.7)  # a few resyncs: every loop is still alive and counting
        assert admin_call(a.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"1": 100}})[0] == 200
        routes_to(b, "1", within_s=1)
        for replica in (a, b):
            assert sync_errors(replica, "corrupt_record") >= 2
            assert urllib.request.urlopen(f"{replica.url}/readyz", timeout=10).status == 200
        assert a.app.sync.restarts == {} and b.app.sync.restarts == {}, "nothing crashed"
        status, doc = admin_call(b.url, "GET", "/admin/models/tok/policy")
        assert status == 500 and "tok" in doc["error"], "the API names the unreadable record"
        assert admin_call(b.url, "PUT", "/admin/models/tok/policy", {"weights": {"1": 100}})[0] == 200
        assert admin_call(a.url, "GET", "/admin/models/tok/policy")[1]["weights"] == {"1": 100}, "repaired by a PUT"


def test_a_corrupt_sqlite_record_is_skipped_and_counted_while_other_models_sync(triton: LocalTriton,
                                                                                 tmp_path: Path) -> None:
    """Two replicas sharing one SQLite file (the embedded store's way to run several processes)."""
    path = tmp_path / "state.db"
    values = {"store_url": f"sqlite:///{path}", "admin_token": TOKEN, "resync_interval_s": 0.3}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **values)) as b:
        assert admin_call(a.url, "PUT", "/admin/models/tok/policy", {"weights": {"2": 100}})[0] == 200
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})[0] == 200
        routes_to(b, "2", within_s=2)
        db = sqlite3.connect(path)
        db.execute("UPDATE policies SET spec = ?, revision = 5 WHERE model = 'tok'",
                   (json.dumps({"weights": {"2": 90}}),))  # parses, but weights no longer sum to 100
        db.commit()
        db.close()
        assert admin_call(a.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}})[0] == 200
        for replica in (a, b):
            routes_to(replica, "3", within_s=2)
            assert replica.app.book.snapshot()["tok"].revision == 1
        time.sleep(0.7)
        for replica in (a, b):
            assert sync_errors(replica, "corrupt_record") >= 1
        assert a.app.sync.restarts == {} and b.app.sync.restarts == {}


def test_readyz_reports_a_sync_that_keeps_failing_and_recovers(triton: LocalTriton) -> None:
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, resync_interval_s=0.1, sync_unready_after_s=0.5,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        assert urllib.request.urlopen(f"{gw.url}/readyz", timeout=10).status == 200
        healthy = gw.app.store.scan_policies

        async def broken() -> None:
            raise KeyError("a bug in the sync path")

        gw.app.store.scan_policies = broken  # type: ignore[method-assign,assignment]
        time.sleep(1.0)
        status = admin_call(gw.url, "GET", "/readyz")
        assert status[0] == 503 and "policy sync has been failing" in status[1]["error"], status
        assert infer_version(gw.url) == "2", "the data path still serves the last policies"
        assert sync_errors(gw, "internal") >= 1
        gw.app.store.scan_policies = healthy  # type: ignore[method-assign]
        deadline = time.monotonic() + 5
        while admin_call(gw.url, "GET", "/readyz")[0] != 200:
            assert time.monotonic() < deadline, "the restarted sync loop did not recover"
            time.sleep(0.1)


class OwnRedis:
    """A redis-server of the test's own (append-only file on, so a restart keeps the data),
    which the test stops and starts again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run the suite through `make test`"
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        preexec_fn=dies_with_parent())
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def metric(gateway: GatewayThread, name: str) -> float:
    text = urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.redis
def test_a_redis_outage_keeps_inference_going_and_a_change_after_it_reaches_both_within_a_second(
        triton: LocalTriton, own_redis: OwnRedis) -> None:
    values = {"store_url": own_redis.url, "admin_token": TOKEN, "resync_interval_s": 30}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **values)) as b:
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})[0] == 200
        routes_to(b, "2", within_s=1)
        with BackgroundLoad(a.url, concurrency=2) as load_a, BackgroundLoad(b.url, concurrency=2) as load_b:
            own_redis.stop()
            stopped_at = time.monotonic()
            wait_for(lambda: metric(a, "gateway_store_up") == 0 and metric(b, "gateway_store_up") == 0, 5,
                     what="both replicas to notice the store is gone")
            while time.monotonic() - stopped_at < 10:
                for replica in (a, b):
                    assert urllib.request.urlopen(f"{replica.url}/readyz", timeout=10).status == 200
                time.sleep(1)
            status, _ = admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"3": 100}})
            assert status == 503, "no change is accepted while it cannot be stored"
            own_redis.start()
            time.sleep(0.5)  # let the load see the store back too
        for load in (load_a, load_b):
            assert load.result.statuses[200] > 50 and set(load.result.statuses) == {200}, load.result.failures[:3]
            assert set(load.result.versions) == {"2"}, "served by the last policy throughout"
        # a PUT the store cannot take yet is refused whole (503, nothing changed): the first write after
        # Redis restarts may meet a connection of the old one (ci-11, under a full run's load)
        status, doc = wait_for(lambda: (answer := admin_call(a.url, "PUT", "/admin/models/qc/policy",
                                                             {"weights": {"1": 100}}))[0] != 503 and answer,
                               10, interval=0.2, what="the store to take a write again")
        changed_at = time.monotonic()
        assert (status, doc["revision"]) == (200, 2), "the store came back with its data"
        routes_to(a, "1", within_s=1, since=changed_at)
        routes_to(b, "1", within_s=1, since=changed_at)
        wait_for(lambda: metric(a, "gateway_store_up") == 1 and metric(b, "gateway_store_up") == 1, 2,
                 what="gateway_store_up back to 1")


@pytest.mark.redis
async def test_the_redis_change_feed_stays_up_when_quiet_and_notices_a_frozen_server(own_redis: OwnRedis) -> None:
    import signal

    from gateway.errors import StoreError
    from gateway.store.base import RESYNC
    from gateway.store.redis import RedisStore

    store = RedisStore(own_redis.url, heartbeat_s=0.2)
    await store.open()
    feed = store.changes()
    try:
        assert await asyncio.wait_for(feed.__anext__(), 2) == RESYNC
        waiter = asyncio.ensure_future(feed.__anext__())
        await asyncio.sleep(1.5)  # quiet for several heartbeats: the feed must not give up
        assert not waiter.done()
        publisher = redis.asyncio.Redis.from_url(own_redis.url)
        await publisher.publish("gateway:changes", "qc")
        await publisher.aclose()
        assert await asyncio.wait_for(waiter, 2) == "qc"
        assert own_redis.process is not None
        stop_process(own_redis.process.pid)  # alive to TCP, answers nothing: as a partition looks
        try:
            started = time.monotonic()
            with pytest.raises(StoreError, match="no answer"):
                await asyncio.wait_for(feed.__anext__(), 5)
            assert time.monotonic() - started < 2
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
    finally:
        await feed.aclose()  # type: ignore[attr-defined]
        await store.close()


def config_settings(triton: LocalTriton, config: Path, store_url: str) -> Settings:
    """What `gateway serve --config` builds: the YAML file under the test's ports."""
    return Settings.load(config, host="127.0.0.1", port=free_port(), grpc_port=free_port(),
                         triton_url=triton.http_url, store_url=store_url, admin_token=TOKEN)


def config_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.config"]
    caplog.clear()
    return lines


def test_the_config_file_is_declared_intent_across_restarts(triton: LocalTriton, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.config")
    config = tmp_path / "gateway.yaml"
    store = f"sqlite:///{tmp_path}/state.db"
    config.write_text('policies:\n  qc: {weights: {"2": 80, "3": 20}}\n')
    with GatewayThread(config_settings(triton, config, store)) as gw:
        assert config_lines(caplog) == ["policy of qc: applied from the config file as revision 1 (new in the "
                                        "config file)"]
        assert admin_call(gw.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 50, "3": 50}})[0] == 200

    with GatewayThread(config_settings(triton, config, store)) as gw:  # the same file: the API change stays
        lines = config_lines(caplog)
        assert len(lines) == 1 and "the config file and the store differ: kept the store's a different policy, " \
            "revision 2 by admin at" in lines[0], lines
        assert admin_call(gw.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"2": 50, "3": 50}

    config.write_text('policies:\n  qc: {weights: {"2": 99.5, "3": 0.5}}\n')
    with GatewayThread(config_settings(triton, config, store)) as gw:  # a changed entry is applied
        assert config_lines(caplog) == ["policy of qc: applied from the config file as revision 3 (the config file "
                                        "entry changed since it was last applied)"]
        status, doc = admin_call(gw.url, "GET", "/admin/models/qc/policy")
        assert (status, doc["revision"], doc["weights"]) == (200, 3, {"2": 99.5, "3": 0.5})
        latest = admin_call(gw.url, "GET", "/admin/events?model=qc&limit=1")[1]["events"][0]
        assert (latest["actor"], latest["action"]) == ("config", "apply_config")
        assert latest["before"]["weights"] == {"2": 50, "3": 50} and latest["after"]["weights"]["3"] == 0.5
        result = asyncio.run(drive(gw.url, 10_000, concurrency=16))
        assert result.statuses == {200: 10_000}, result.failures[:3]
        assert 0.003 <= result.share("3") <= 0.007, result.versions

    with GatewayThread(config_settings(triton, config, store)):  # unchanged again, and the store agrees
        lines = config_lines(caplog)
        assert len(lines) == 1 and lines[0].startswith("policy of qc: kept from the store, revision 3 by config at")
        assert lines[0].endswith("(the same as the config file)")


@pytest.mark.redis
def test_a_wiped_store_gets_the_config_files_policies_again_once(triton: LocalTriton, redis_url: str) -> None:
    policies = {"qc": {"weights": {"2": 100}}, "tok": {"weights": {"1": 100}}}
    values = {"store_url": redis_url, "admin_token": TOKEN, "resync_interval_s": 0.3, "policies": policies}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as a, \
            GatewayThread(gateway_settings(triton.http_url, **values)) as b:
        assert admin_call(a.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}})[0] == 200
        routes_to(b, "3", within_s=1)
        client = redis.Redis.from_url(redis_url)
        client.flushall()  # Redis restarted without a volume: the file's intent is gone from the store too
        client.close()
        wiped_at = time.monotonic()
        for replica in (a, b):
            routes_to(replica, "2", within_s=3, since=wiped_at)  # not Triton's default (the newest version)
            assert replica.app.book.snapshot()["tok"].spec.basis_points() == {"1": 10_000}
        events = admin_call(a.url, "GET", "/admin/events")[1]["events"]
        assert sorted((e["model"], e["actor"], e["action"]) for e in events) == [
            ("qc", "config", "apply_config"), ("tok", "config", "apply_config")], "one write per model, not per replica"
