"""An unload drains every replica, not only the one asked: two gateways on one Redis, a real
Triton of the test's own (it loads and unloads versions), requests delayed by its faults."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import INFER_BODY, TOKEN, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = [pytest.mark.triton, pytest.mark.redis]


@pytest.fixture
def delayed_triton(tmp_path: Path) -> Iterator[tuple[LocalTriton, Faults]]:
    path = tmp_path / "faults.json"
    path.write_text("{}")
    with LocalTriton.on_free_ports(models=("qc",), faults_file=path) as server:
        yield server, Faults(path)


def ready_versions(triton: LocalTriton) -> set[str]:
    request = urllib.request.Request(f"{triton.http_url}/v2/repository/index", data=b"{}", method="POST")
    index = json.loads(urllib.request.urlopen(request).read())
    return {str(m["version"]) for m in index if m.get("name") == "qc" and m.get("state") == "READY"}


def infer(url: str, path: str = "/v2/models/qc/infer", **parameters: object) -> str:
    body = json.loads(INFER_BODY)
    if parameters:
        body["parameters"] = parameters
    request = urllib.request.Request(url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["model_version"])


def replicas(triton: LocalTriton, redis_url: str, **values: object) -> tuple[GatewayThread, GatewayThread]:
    settings = {"store_url": redis_url, "admin_token": TOKEN, "triton_grpc_url": triton.grpc_url,
                "controller_enabled": False, **values}
    return (GatewayThread(gateway_settings(triton.http_url, **settings)),
            GatewayThread(gateway_settings(triton.http_url, **settings)))


def test_an_unload_through_a_waits_for_a_request_in_flight_on_b(delayed_triton: tuple[LocalTriton, Faults],
                                                               redis_url: str) -> None:
    triton, faults = delayed_triton
    a, b = replicas(triton, redis_url)
    with a, b:
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 50, "3": 50}})[0] == 200
        faults.set("qc", "3", delay_ms=1500)
        answered: dict[str, object] = {}

        def slow_request() -> None:
            answered["version"] = infer(b.url, "/v2/models/qc/versions/3/infer")
            answered["at"] = time.monotonic()

        sender = threading.Thread(target=slow_request)
        sender.start()
        # the request is now waiting on Triton, through B (a 0.4 s sleep raced its arrival under load)
        wait_for(lambda: b.app.recorder.inflight.get(("qc", "3")) == 1, 5, interval=0.01, what="B's request")
        assert not a.app.recorder.inflight.get(("qc", "3"))
        # a version with weight cannot be unloaded (409, issue 13): take it out of the split first
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100, "3": 0}},
                          headers={"If-Match": '"1"'})[0] == 200
        status, body = admin_call(a.url, "POST", "/admin/models/qc/versions/3/unload")
        unloaded_at = time.monotonic()
        sender.join(10)
        assert status == 200, body
        assert answered["version"] == "3", "B's request was served by the version it went to"
        assert unloaded_at >= answered["at"], "the unload went ahead before B's request finished"  # type: ignore[operator]
        assert body["drain"].startswith("idle on 2 replica(s)"), body
        assert ready_versions(triton) == {"1", "2"}


def test_a_sequence_pinned_on_b_makes_the_unload_refuse_until_it_ends(delayed_triton: tuple[LocalTriton, Faults],
                                                                       redis_url: str) -> None:
    triton, _ = delayed_triton
    a, b = replicas(triton, redis_url, drain_timeout_s=1.0)
    with a, b:
        policy = {"weights": {"3": 100}, "sequence_affinity": True}
        assert admin_call(a.url, "PUT", "/admin/models/qc/policy", policy)[0] == 200
        deadline = time.monotonic() + 2
        while b.app.book.revision("qc") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert infer(b.url, sequence_id=41, sequence_start=True, sequence_end=False) == "3"
        assert admin_call(a.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 100}})[0] == 200

        status, body = admin_call(a.url, "POST", "/admin/models/qc/versions/3/unload")
        assert status == 409, body
        assert "1 open sequence(s)" in body["error"] and b.app.replicas.replica in body["error"], body
        assert "3" in ready_versions(triton), "not unloaded: the sequence would break"
        assert infer(b.url, sequence_id=41, sequence_start=False, sequence_end=False) == "3", "the sequence goes on"

        assert infer(b.url, sequence_id=41, sequence_start=False, sequence_end=True) == "3"
        status, body = admin_call(a.url, "POST", "/admin/models/qc/versions/3/unload")
        assert status == 200, body
        assert ready_versions(triton) == {"1", "2"}


def test_a_sequence_pinned_before_a_restart_keeps_its_version_after_it(triton: LocalTriton, redis_url: str) -> None:
    """The session's Triton: nothing is loaded or unloaded here."""
    values = {"store_url": redis_url, "admin_token": TOKEN, "controller_enabled": False}
    with GatewayThread(gateway_settings(triton.http_url, **values)) as first:
        policy = {"weights": {"3": 100}, "sequence_affinity": True}
        assert admin_call(first.url, "PUT", "/admin/models/qc/policy", policy)[0] == 200
        assert infer(first.url, sequence_id=52, sequence_start=True, sequence_end=False) == "3"
        assert infer(first.url, sequence_id="text-id", sequence_start=True, sequence_end=False) == "3"
        assert admin_call(first.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 100}})[0] == 200
        client = redis.Redis.from_url(redis_url)
        saved = wait_for(lambda: sorted(client.scan_iter("gateway:pin:*")), 2, what="the background save")
        client.close()
        assert saved == [b'gateway:pin:["qc", "text-id"]', b'gateway:pin:["qc", 52]'], "saved while serving"
    with GatewayThread(gateway_settings(triton.http_url, **values)) as second:
        assert infer(second.url, sequence_id=52, sequence_start=False, sequence_end=False) == "3"
        assert infer(second.url, sequence_id="text-id", sequence_start=False, sequence_end=True) == "3"
        assert infer(second.url, sequence_id=53, sequence_start=True, sequence_end=False) == "2", "new ones move"
        assert infer(second.url, sequence_id="text-id", sequence_start=False, sequence_end=False) == "2", "it ended"
