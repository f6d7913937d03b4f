"""Judging goes on when the lease holder dies (issue 32, item 3): two replicas on Redis, a rollout
whose canary starts failing as the replica that holds the controller lease is killed with -9;
the other replica takes the lease over and the rollback is applied within 5 s of the kill (the
lease moved 14.6 s after the kill with the 15 s lease renewed by ticks)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from gateway.devtools.local_triton import LocalTriton
from gateway.rollout.lease import LEASE
from tests.conftest import Faults
from tests.support import TOKEN, BackgroundLoad, GatewayProcess, admin_call, wait_for

pytestmark = pytest.mark.triton


def replica(triton: LocalTriton, redis_url: str) -> GatewayProcess:
    return GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
                           "GATEWAY_STORE_URL": redis_url, "GATEWAY_ADMIN_TOKEN": TOKEN,
                           "GATEWAY_POLICIES": '{"qc": {"weights": {"2": 100}}}'})


def holder_pid(client: redis.Redis) -> int:
    """The lease holder is the replica's name, ``host-pid-suffix``: which process judges."""
    holder = client.hget(f"gateway:fence:{LEASE}", "holder")
    assert holder, "a lease holder"
    return int(str(holder).rsplit("-", 2)[1])


def test_a_rollback_is_applied_within_5_s_of_the_lease_holder_dying(triton: LocalTriton, redis_url: str,
                                                                      faults: Faults, tmp_path: Path) -> None:
    """Default lease settings. ~35 s on the shared machine: two gateway processes start, each the
    whole gateway, and the failover is awaited after the kill."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    one, two = replica(triton, redis_url).start(), replica(triton, redis_url).start()
    try:
        wait_for(lambda: client.exists(f"gateway:fence:{LEASE}:live"), 10, what="a lease holder")
        pid = holder_pid(client)
        killed, survivor = (one, two) if one.process.pid == pid else (two, one)
        assert killed.process.pid == pid, "the holder is one of the two"
        status, doc = admin_call(survivor.url, "POST", "/admin/models/qc/rollout", {
            "canary": "3", "judge": "thresholds", "steps": list(range(10, 101, 10)), "interval_s": 1,
            "min_requests": 5, "failure_limit": 1, "max_error_rate": 0.05})  # judged every second
        assert status == 200, doc
        with BackgroundLoad(survivor.url, concurrency=4) as load:
            wait_for(lambda: load.result.versions.get("3", 0) >= 20, 10, what="the canary takes traffic")
            killed.kill()  # -9
            died = time.monotonic()
            faults.set("qc", "3", error_rate=1.0)  # from now on the canary fails: the survivor must judge

            def rolled_back() -> bool:
                status, doc = admin_call(survivor.url, "GET", "/admin/models/qc/policy")
                return status == 200 and doc["weights"].get("3", 0) == 0 and doc["weights"]["2"] == 100

            wait_for(rolled_back, 15, interval=0.05, what="the rollback")
            took = time.monotonic() - died
        assert took <= 5.0, f"the rollback was applied {took:.1f} s after the holder died"
        assert holder_pid(client) == survivor.process.pid
        assert admin_call(survivor.url, "GET", "/admin/models/qc/rollout")[1]["state"] == "rolled_back"
    finally:
        for gateway in (one, two):
            gateway.stop()
        client.close()
