"""A rollback that always happens: store outages at the moment of rollback, a crash between the
controller's two writes, a human writing during a tick, and a deposed lease holder. Real
Triton, real SQLite file, real redis-server."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.devtools.local_triton import LocalTriton, dies_with_parent, free_port
from gateway.rollout.lease import LEASE
from gateway.telemetry.recorder import Window
from gateway.telemetry.sources import MetricsSource
from tests.conftest import Faults
from tests.support import (
    TOKEN,
    BackgroundLoad,
    GatewayProcess,
    GatewayThread,
    admin_call,
    gateway_settings,
    rollout_status,
    wait_for,
    wait_stepped,
)

pytestmark = pytest.mark.triton
TICK = 0.2


def policy_weights(url: str) -> dict[str, int]:
    status, doc = admin_call(url, "GET", "/admin/models/qc/policy")
    assert status == 200, doc
    return {v: int(w) for v, w in doc["weights"].items() if w}


def book_weights(gw: GatewayThread) -> dict[str, int]:
    policy = gw.app.book.get("qc")
    assert policy is not None
    return {v: int(w) for v, w in policy.spec.weights.items() if w}


def begin(url: str, **spec: Any) -> dict[str, Any]:
    status, doc = admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", **spec})
    assert status == 200, doc
    assert isinstance(doc, dict)
    return doc


class GatedSource:
    """What the controller judges from, behind a gate the test opens: a tick slowed on purpose
    (real Prometheus cannot be told to hold one answer). It wraps ``judged_source()``, the source
    the judge reads (with the recorder source, every replica's published windows summed), taken
    anew at each read as the controller does."""

    def __init__(self, inner: Callable[[], MetricsSource]) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    async def window(self, model: str, version: str, seconds: float) -> Window:
        if not self.gate.is_set():
            self.entered.set()
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
        return await self.inner().window(model, version, seconds)


def gate(gw: GatewayThread) -> GatedSource:
    controller = gw.app.rollouts
    source = GatedSource(controller.judged_source)
    controller.judged_source = lambda: source  # type: ignore[method-assign]
    return source


class OwnRedis:
    """A redis-server of this test's own (with an append-only file), to stop and start again."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run the suite through `make test`"
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
        wait_for(lambda: self._pings(), 10, what="redis-server")
        return self

    def _pings(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def rolled_back_and_applied(url: str) -> dict[str, Any] | None:
    # The first call after Redis comes back may meet a pooled connection Redis closed: a 503 here
    # is the admin API's honest answer for that one call, not the rollout's state.
    status, doc = admin_call(url, "GET", "/admin/models/qc/rollout")
    if status == 503:
        return None
    assert status == 200, doc
    return doc if doc["state"] == "rolled_back" and doc["applied"] else None


def roll_back_through_an_outage(gw: GatewayThread, faults: Faults, outage: Any, recover: Any) -> None:
    """Shared by both stores: a canary failing half its requests is judged while the store is
    out; this replica (the lease holder) sends it nothing at once; once the store is back the
    stored policy and status catch up within two ticks."""
    with BackgroundLoad(gw.url, concurrency=4):
        begin(gw.url, steps=[20, 100], interval_s=1, min_requests=10, failure_limit=1)
        wait_for(lambda: gw.app.rollouts.fence is not None, 5, what="the lease")
        faults.set("qc", "3", error_rate=0.5)
        outage()
        try:
            wait_for(lambda: book_weights(gw) == {"2": 100}, 15, what="the canary at 0% during the outage")
        finally:
            recovered_at = time.monotonic()
            recover()
        doc = wait_for(lambda: rolled_back_and_applied(gw.url), 10, interval=0.05,
                       what="rolled_back, applied, in the store")
        took = time.monotonic() - recovered_at
    assert policy_weights(gw.url) == {"2": 100} and "error rate" in doc["reason"]
    # Two ticks, plus the write that was waiting on the store when it came back.
    assert took <= 2 * (TICK + gw.settings.controller_call_timeout_s), f"{took:.2f}s after the store returned"


def test_sqlite_locked_at_the_moment_of_rollback(triton: LocalTriton, faults: Faults, tmp_path: Path) -> None:
    """Another connection holds the database with BEGIN EXCLUSIVE: every write of the gateway
    waits out SQLite's busy timeout and fails (reads still work: WAL)."""
    path = tmp_path / "state.db"
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, controller_tick_s=TICK, store_url=f"sqlite:///{path}",
                                policies={"qc": {"weights": {"2": 100}}})
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    with GatewayThread(settings) as gw:
        roll_back_through_an_outage(gw, faults, lambda: locker.execute("BEGIN EXCLUSIVE"),
                                    lambda: locker.execute("ROLLBACK"))
    locker.close()


def test_redis_stopped_at_the_moment_of_rollback(triton: LocalTriton, faults: Faults, own_redis: OwnRedis) -> None:
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, controller_tick_s=TICK, store_url=own_redis.url,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        roll_back_through_an_outage(gw, faults, own_redis.stop, own_redis.start)


def test_kill_9_between_the_policy_write_and_the_rollout_write_resumes_at_the_same_step(
        triton: LocalTriton, tmp_path: Path) -> None:
    """The crash point is made deterministic inside SQLite itself: a trigger arms on the policy
    write, and from then on refuses every rollout write, so the gateway process is stuck exactly
    between its policy write and its rollout write when the test sends SIGKILL. No hook in the
    gateway's code."""
    path = tmp_path / "state.db"
    env = {"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_STORE_URL": f"sqlite:///{path}",
           "GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_CONTROLLER_TICK_S": str(TICK),
           # a short lease, so the restarted process takes over from the dead one in 2 s; a store
           # call is given half of it, as the defaults do (at 0.25 s, SQLite calls of a loaded run time
           # out and the lease goes unrenewed: test_rollout's killed-mid-rollout test, ci-18)
           "GATEWAY_CONTROLLER_LEASE_TTL_S": "2", "GATEWAY_CONTROLLER_CALL_TIMEOUT_S": "1.0"}
    first = GatewayProcess(env).start()
    try:
        admin_call(first.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})
        with BackgroundLoad(first.url, concurrency=4):
            # thresholds: a verdict, and so a step (a policy write), every interval. No p99 ratio: the
            # resume is tested, not the judge (a loaded run's latency can roll a canary back)
            begin(first.url, steps=[10, 20, 50, 100], interval_s=1, min_requests=10, judge="thresholds",
                  max_p99_ratio=None)
            db = sqlite3.connect(path, isolation_level=None)
            db.executescript("""
                CREATE TABLE crash_point (armed INTEGER); INSERT INTO crash_point VALUES (0);
                CREATE TRIGGER arm AFTER INSERT ON policies BEGIN UPDATE crash_point SET armed = 1; END;
                CREATE TRIGGER refuse BEFORE INSERT ON rollouts WHEN (SELECT armed FROM crash_point) = 1
                    BEGIN SELECT RAISE(ABORT, 'crash point'); END;
            """)
            wait_for(lambda: db.execute("SELECT armed FROM crash_point").fetchone()[0] == 1, 10,
                     what="the next policy write")
            time.sleep(2 * TICK)  # a retry or two hits the trigger too: still between the writes
            first.kill()
        written = db.execute("SELECT revision, spec FROM policies WHERE model = 'qc'").fetchone()
        stuck = rollout_document(db)
        db.executescript("DROP TRIGGER arm; DROP TRIGGER refuse; DROP TABLE crash_point;")
        db.close()
    finally:
        first.kill()
    assert stuck["pending_revision"] == written[0] and not stuck["applied"], "killed between the two writes"
    second = GatewayProcess(env, port=first.port).start()
    try:
        with BackgroundLoad(second.url, concurrency=4):
            doc = wait_for(lambda: (d := rollout_status(second.url))["applied"] and d, 6, what="the write adopted")
            # The adopting tick may judge its interval at once (it is long due after the crash) and
            # advance: what matters is that it carried on from the crashed step, never paused.
            assert doc["state"] == "progressing", doc["reason"]
            after_crash = [h for h in doc["history"] if h["at"] > stuck["history"][-1]["at"]]
            assert all(h["to"] == "progressing" and h["step"] == stuck["step"] + i + 1
                       for i, h in enumerate(after_crash)), after_crash
            assert doc["step"] == stuck["step"] + len(after_crash)
            assert doc["policy_revision"] >= written[0]
            wait_stepped(second.url, past=stuck["step"], within_s=15)  # fails at once, with why, if it ends
    finally:
        second.stop()


def rollout_document(db: sqlite3.Connection) -> dict[str, Any]:
    import json

    row = db.execute("SELECT document FROM rollouts WHERE model = 'qc'").fetchone()
    document: dict[str, Any] = json.loads(row[0])
    return document


def test_an_sre_patch_during_a_slowed_tick_pauses_and_keeps_the_sres_weights(triton: LocalTriton) -> None:
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, controller_tick_s=TICK,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw, BackgroundLoad(gw.url, concurrency=4):
        source = gate(gw)
        begin(gw.url, steps=[10, 50, 100], interval_s=1, min_requests=10)
        source.gate.clear()
        assert source.entered.wait(5), "the tick reached the metrics query"
        status, body = admin_call(gw.url, "PATCH", "/admin/models/qc/policy/weights",
                                  {"weights": {"2": 70, "3": 30}, "reason": "hand-tuning"})
        assert status == 200, body
        source.gate.set()
        doc = wait_for(lambda: (d := rollout_status(gw.url))["state"] == "paused" and d, 5, what="the pause")
        time.sleep(5 * TICK)
        assert "admin" in doc["reason"] and "manual policy change" in doc["reason"]
        assert policy_weights(gw.url) == {"2": 70, "3": 30} and book_weights(gw) == {"2": 70, "3": 30}
        assert rollout_status(gw.url)["state"] == "paused"


def test_two_gateways_on_one_redis_a_deposed_holders_writes_are_rejected(
        triton: LocalTriton, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two gateways share Redis. The holder's tick is held at its metrics query; the test lets
    its lease expire (its renewals stop, as a paused process's would, and the live key goes, as
    the TTL would take it) so the other gateway takes it with the next epoch; the deposed
    holder's verdict write is then refused by the store."""
    # A database of its own: the lease must be contested by these two gateways only, never by a
    # gateway another test left running on the session Redis's database 0.
    redis_url = redis_url.rsplit("/", 1)[0] + "/7"

    def settings() -> Any:
        return gateway_settings(triton.http_url, admin_token=TOKEN, controller_tick_s=TICK, store_url=redis_url,
                                policies={"qc": {"weights": {"2": 100}}})

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    with GatewayThread(settings()) as one, GatewayThread(settings()) as two, BackgroundLoad(one.url, concurrency=4):
        holder, other = (one, two) if wait_for(lambda: one.app.rollouts.fence or two.app.rollouts.fence, 5,
                                               what="a lease holder") is one.app.rollouts.fence else (two, one)
        held, waiting = gate(holder), gate(other)
        begin(holder.url, steps=[10, 50, 100], interval_s=1, min_requests=10)
        epoch = holder.app.rollouts.fence.epoch  # type: ignore[union-attr]
        held.gate.clear()
        waiting.gate.clear()
        assert held.entered.wait(5), "the holder's tick is at its metrics query"
        before = client.get("gateway:rollout:qc")
        paused = asyncio.Event()  # never set: the holder's lease keeper waits for ever, as if paused

        async def pause(*_: Any) -> Any:
            await paused.wait()

        keeper_store: Any = holder.app.rollouts.lease.store
        keeper_store.renew_fenced_lease = keeper_store.acquire_fenced_lease = pause
        client.delete(f"gateway:fence:{LEASE}:live")  # the lease lapses mid-tick
        wait_for(lambda: other.app.rollouts.fence is not None, 5, what="the other gateway to take the lease")
        assert other.app.rollouts.fence.epoch == epoch + 1  # type: ignore[union-attr]
        assert waiting.entered.wait(5), "the new holder's tick is at its metrics query too"
        with caplog.at_level(logging.WARNING, logger="gateway.rollout"):
            held.gate.set()  # the deposed holder goes on with its tick and tries to write its verdict
            wait_for(lambda: holder.app.rollouts.fence is None, 5, what="the holder to learn it was deposed")
        assert client.get("gateway:rollout:qc") == before, "the deposed holder's write changed nothing"
        assert any("deposed" in r.getMessage() and f"epoch {epoch}" in r.getMessage() for r in caplog.records)
        waiting.gate.set()
        wait_for(lambda: client.get("gateway:rollout:qc") != before, 5, what="the new holder's write")
    client.close()


class TimedLoad(BackgroundLoad):
    """BackgroundLoad that also keeps when each answer came, and from which version."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        super().__init__(url, concurrency)
        self.answers: list[tuple[float, str]] = []

    async def _run(self) -> None:
        import json

        from gateway.upstream import HttpUpstream
        from tests.support import INFER_BODY

        client = HttpUpstream(self.url, max_connections=self.concurrency, request_timeout_s=30)

        async def worker() -> None:
            while not self._stop.is_set():
                response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                payload = await response.read()
                # a failed answer names no version in its body: the routing header does
                version = json.loads(payload)["model_version"] if response.status == 200 \
                    else _version_header(response.headers)
                self.answers.append((time.monotonic(), version))

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        await client.aclose()

    def canary_share(self, start: float, end: float, canary: str = "3") -> tuple[float, int]:
        window = [version for at, version in self.answers if start <= at <= end]
        return (sum(v == canary for v in window) / len(window) if window else 1.0), len(window)


def _version_header(headers: Any) -> str:
    for name, value in headers:
        if name.lower() == b"x-gateway-model-version":
            return str(value.decode())
    return "?"


def test_a_rollback_lands_while_another_process_holds_the_sqlite_file_for_12_seconds(
        triton: LocalTriton, faults: Faults, tmp_path: Path) -> None:
    """Issue 23, with the gateway's default settings: a canary at 20% starts failing half its
    requests just as another process takes the state file in BEGIN EXCLUSIVE for 12 s. The
    lease holder decides the rollback with the store locked and puts it into its own policy
    book within two ticks: over the lock's last 6 s the canary answers at most 1% of the
    requests. (Before: every store call waited out SQLite's 5 s busy timeout, one behind the
    other, and the canary kept its 20% until the lock was released.)"""
    path = tmp_path / "state.db"
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, store_url=f"sqlite:///{path}",
                                policies={"qc": {"weights": {"2": 100}}})
    script = "import sqlite3, sys, time\n" \
             "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n" \
             "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(12); db.execute('ROLLBACK')\n"
    import sys

    with GatewayThread(settings) as gw, TimedLoad(gw.url, concurrency=4) as load:
        # the judge's first unhealthy verdict decides: what is measured is how fast a decided
        # rollback lands, not how many intervals the judge wants
        begin(gw.url, steps=[20, 100], interval_s=1, min_requests=10, failure_limit=1)
        wait_for(lambda: rollout_status(gw.url)["applied"], 10, what="the 20% step in place")
        wait_for(lambda: gw.app.rollouts.fence is not None, 5, what="the lease")
        time.sleep(3)  # the 20% split measured before the lock
        locker = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
            locked_at = time.monotonic()
            faults.set("qc", "3", error_rate=0.5)
            locker.wait(20)
        finally:
            locker.kill()
            locker.communicate()
        released_at = time.monotonic()
        doc = wait_for(lambda: rolled_back_and_applied(gw.url), 15, what="the rollback in the store after the lock")
        stored = policy_weights(gw.url)
    share, answers = load.canary_share(released_at - 6, released_at)
    before, _ = load.canary_share(locked_at - 3, locked_at)
    assert before > 0.1, f"the canary took {before:.1%} before the lock: the test did not start at the 20% step"
    assert answers > 50, answers
    last = max((at for at, version in load.answers if version == "3" and at <= released_at), default=locked_at)
    print(f"canary share: {before:.1%} in the 3 s before the lock, {share:.2%} of {answers} in its last 6 s; "
          f"its last answer {last - locked_at:.1f} s into the lock")
    assert share <= 0.01, f"the canary answered {share:.1%} of {answers} requests in the lock's last 6 s"
    assert stored == {"2": 100} and doc["state"] == "rolled_back"
