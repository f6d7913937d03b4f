"""/metrics: what the recorder saw, in Prometheus' text format, with bounded cardinality."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import TOKEN, GatewayThread, admin_call, drive, gateway_settings

pytestmark = pytest.mark.triton


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request) as response:
        return response.read().decode(), response.headers["Content-Type"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_report_what_the_recorder_saw(triton: LocalTriton, faults: Faults) -> None:
    faults.set("qc", "3", error_rate=1.0)
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, policies={"qc": {"weights": {"2": 80, "3": 20}}})
    with GatewayThread(settings) as gw:
        result = asyncio.run(drive(gw.url, 500, concurrency=4))
        text, content_type = scrape(gw.url)
        assert content_type.startswith("text/plain")
        values = samples(text)
        ok = values[("gateway_requests_total", (("code", "200"), ("model", "qc"), ("protocol", "http"),
                                                ("route", "weighted"), ("version", "2")))]
        failed = values[("gateway_requests_total", (("code", "500"), ("model", "qc"), ("protocol", "http"),
                                                    ("route", "weighted"), ("version", "3")))]
        assert ok == result.versions["2"] and ok + failed == 500
        count = values[("gateway_request_duration_seconds_count", (("judged", "true"), ("model", "qc"),
                                                                   ("protocol", "http"), ("version", "2")))]
        assert count == ok
        assert values[("gateway_route_weight", (("model", "qc"), ("version", "3")))] == 20
        assert values[("gateway_policy_revision", (("model", "qc"),))] == 1
        assert values[("gateway_inflight_requests", (("model", "qc"), ("version", "2")))] == 0
        assert any(name == "process_cpu_seconds_total" for name, _ in values)
        window = gw.app.recorder.window("qc", "3", 60)
        assert window.errors == failed and window.requests == failed
        _, openmetrics = scrape(gw.url, "application/openmetrics-text; version=1.0.0")
        assert openmetrics.startswith("application/openmetrics-text")
        admin_call(gw.url, "POST", "/admin/models/qc/rollout", {"canary": "3", "interval_s": 60})
        text, _ = scrape(gw.url)
        assert samples(text)[("gateway_rollout_state", (("model", "qc"), ("state", "progressing")))] == 1


def test_unknown_model_names_do_not_grow_the_series(triton: LocalTriton) -> None:
    with GatewayThread(gateway_settings(triton.http_url)) as gw:
        before_keys = samples(scrape(gw.url)[0])
        before = len(before_keys)

        async def random_models() -> None:
            from gateway.upstream import HttpUpstream

            client = HttpUpstream(gw.url, max_connections=8)

            async def one(i: int) -> None:
                name = f"nope-{uuid.uuid4().hex}".encode()
                response = await client.request(b"POST", b"/v2/models/%s/infer" % name, [], b"{}")
                await response.read()
                assert response.status == 404
                pinned = await client.request(b"POST", b"/v2/models/%s/versions/%d/infer" % (name, i), [], b"{}")
                await pinned.read()

            await asyncio.gather(*(one(i) for i in range(50)))
            firsts.update(samples(scrape(gw.url)[0]))
            for start in range(50, 5000, 50):
                await asyncio.gather(*(one(i) for i in range(start, start + 50)))
            await client.aclose()

        firsts: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        asyncio.run(random_models())
        after = samples(scrape(gw.url)[0])
        # The first 100 unknown names add one fixed set, the _unknown model's: its 404 counter, its
        # latency histogram (31 buckets, count, sum) and its 7 outcomes (rejected the 7th since
        # 8242cf3); the next 9,900 add none.
        assert len(firsts) - before <= 1 + 33 + 7, "\n".join(
            f"{name} {dict(labels)}" for name, labels in sorted(set(firsts) - set(before_keys)))
        assert set(after) == set(firsts), "9,900 more requests for unknown names add no series"
        assert not any("nope-" in value for _, labels in after for _, value in labels)


def test_access_log_is_structured_and_batched(triton: LocalTriton) -> None:
    import io
    import json as jsonlib
    import time

    settings = gateway_settings(triton.http_url, access_log=True, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        assert gw.app.access_log is not None
        stream = io.StringIO()
        gw.app.access_log.stream = stream
        asyncio.run(drive(gw.url, 20, concurrency=2, headers_for=lambda i: {"traceparent": f"00-{i:032x}-{i:016x}-01"}))
        time.sleep(1.0)
        lines = [jsonlib.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 20
    assert {(line["model"], line["version"], line["route"], line["protocol"], line["status"]) for line in lines} == {
        ("qc", "2", "weighted", "http", 200)}
    assert all(line["latency_ms"] > 0 and line["type"] == "access" for line in lines)
