"""Streaming metrics against the real Triton: the decoupled sample model ``tok`` streamed over
HTTP generate_stream and gRPC ModelStreamInfer through the real gateway."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from gateway.devtools.local_triton import LocalTriton
from gateway.upstream import HttpUpstream
from tests.conftest import Faults
from tests.support import TOKEN, GatewayThread, LoadThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton
STREAM = b"/v2/models/tok/generate_stream"
FIRST = "gateway_stream_time_to_first_response_seconds"
GAP = "gateway_stream_response_gap_seconds"


class StreamLoad(LoadThread):
    """generate_stream calls from ``concurrency`` clients until stopped: ``tokens`` responses
    each, ``delay_ms`` apart; counts the versions that answered."""

    def __init__(self, url: str, concurrency: int = 8, tokens: int = 6, delay_ms: int = 40) -> None:
        super().__init__()
        self.url = url
        self.concurrency = concurrency
        self.body = json.dumps({"text_input": "hi", "max_tokens": tokens, "delay_ms": delay_ms}).encode()
        self.versions: Counter[str] = Counter()
        self.failures: list[str] = []

    async def _run(self) -> None:
        client = HttpUpstream(self.url, max_connections=self.concurrency, request_timeout_s=30)

        async def worker() -> None:
            while not self._stop.is_set():
                try:
                    response = await client.request(b"POST", STREAM, [], self.body)
                    payload = await response.read()
                except Exception as exc:  # counted; the test asserts on it
                    self.failures.append(repr(exc))
                    continue
                if response.status != 200:
                    self.failures.append(payload.decode(errors="replace")[:200])
                    continue
                self.versions[dict(response.headers)[b"x-gateway-model-version"].decode()] += 1

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        await client.aclose()


def scraped(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def count(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, version: str) -> float:
    return metrics.get((f"{name}_count", (("model", "tok"), ("version", version))), 0.0)


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                controller_tick_s=0.2, policies={"tok": {"weights": {"1": 100}}})
    with GatewayThread(settings) as running:
        yield running


def finished(url: str) -> dict[str, Any] | None:
    status, doc = admin_call(url, "GET", "/admin/models/tok/rollout")
    assert status == 200, doc
    return doc if doc["state"] != "progressing" else None


def streamed_rollout(gateway: GatewayThread, load: StreamLoad, timeout_s: float) -> dict[str, Any]:
    """Once 20 streams went through (version 1 warm), a rollout of tok's version 2 (steps 20, 50,
    100; 2 s intervals and warm-up) under ``load``: the rollout as it ended."""
    wait_for(lambda: sum(load.versions.values()) >= 20, 30, what="streams to flow")
    status, doc = admin_call(gateway.url, "POST", "/admin/models/tok/rollout",
                             {"canary": "2", "steps": [20, 50, 100], "interval_s": 2, "latency_warmup_s": 2})
    assert status == 200, doc
    ended: dict[str, Any] = wait_for(lambda: finished(gateway.url), timeout_s, what="the rollout to end")
    return ended


def test_a_canary_whose_first_response_comes_5x_later_is_rolled_back_on_it(gateway: GatewayThread,
                                                                          faults: Faults) -> None:
    """tok 2's first response waits 10 ms more: the stable's comes in 1-2 ms through the gateway
    on a quiet machine (measured here), a few ms under CPU load, so the canary's comes well over
    2x later, while its whole stream (~200 ms of 40 ms gaps) is only ~5% longer, well inside the
    +20% floor: only the stream metric, judged against that same floor, can catch it. (With
    4 ms more, a loaded run measured the effect at 0.81: the stable's own first response had
    slowed, not the canary's advantage.)"""
    faults.set("tok", "2", first_delay_ms=10)
    with StreamLoad(gateway.url) as load:
        doc = streamed_rollout(gateway, load, 90)
    assert not load.failures, load.failures[:3]
    assert doc["state"] == "rolled_back", doc["reason"]
    assert "time to first response worse" in doc["reason"], doc["reason"]
    metrics = {m["name"]: m for m in doc["verdicts"][-1]["metrics"]}
    failed = [name for name, m in metrics.items() if m["verdict"] == "fail"]
    assert failed[0] == "time_to_first_response", doc["reason"]
    assert metrics["time_to_first_response"]["effect"] > 1.0, "the canary's first response came > 2x later"
    assert metrics["latency"]["verdict"] != "fail" and metrics["response_gap"]["verdict"] != "fail"
    assert doc["evidence"]["first_response"]["canary_n"] > 0 and doc["evidence"]["response_gap"]["canary_n"] > 0
    seen = scraped(gateway.url)
    for version in ("1", "2"):
        assert count(seen, FIRST, version) > 0 and count(seen, GAP, version) > 0, version
    assert seen[("gateway_rollbacks_total", (("model", "tok"), ("reason", "time_to_first_response")))] == 1


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_grpc_model_stream_infer_responses_are_timed_per_version(triton: LocalTriton, grpc_server: str) -> None:
    """tok sends its first response at once, then one every 50 ms. The gateway times the first
    from when it sent the request and each later one from the previous one, so response i went
    out at ``first + gaps[0] + ... + gaps[i-1]`` after that request: the sum is checked between
    two bounds no load can move. Triton cannot produce response i before i pauses of 50 ms,
    and the gateway times it before forwarding it, so the client, which had started before the
    gateway sent the request, receives it no sooner than that. (Per-gap bounds such as
    ``0.04 < gap`` measured scheduling: a response the gateway read late shortens the next gap,
    to 38 ms under CPU load.) A first response timed to the stream's end, or gaps timed from
    the request, land past the client's receipt: a broken timer still fails."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                grpc_server=grpc_server, policies={"tok": {"weights": {"1": 100}}})
    delay_s = 0.05
    with GatewayThread(settings) as gw:
        recorder = gw.app.recorder

        async def watch() -> None:
            recorder.watch_latencies("tok", "1")

        gw.call(watch())
        client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{settings.grpc_port}")
        results: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((time.monotonic(), error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
        tokens.set_data_from_numpy(np.array([4], dtype=np.int32))
        delay = grpcclient.InferInput("delay_ms", [1], "INT32")
        delay.set_data_from_numpy(np.array([round(delay_s * 1000)], dtype=np.int32))
        started = time.monotonic()
        client.async_stream_infer("tok", [text, tokens, delay])
        answers = [results.get(timeout=10) for _ in range(4)]
        client.stop_stream()
        client.close()
        assert [error for _, error in answers] == [None] * 4

        async def take() -> tuple[list[float], list[float]]:
            return recorder.take_stream("tok", "1")

        first, gaps = gw.call(take())
        seen = scraped(gw.url)
    assert len(first) == 1 and len(gaps) == 3, (first, gaps)
    timed = [first[0] + sum(gaps[:i]) for i in range(4)]  # response i, since the gateway sent the request
    received = [at - started for at, _ in answers]  # response i, since the client sent the request
    for i in range(4):  # 1 ms: the clocks' float rounding, nothing more
        assert i * delay_s - 0.001 <= timed[i] <= received[i], (i, timed, received)
    assert first[0] > 0 and all(gap > 0 for gap in gaps), (first, gaps)
    assert count(seen, FIRST, "1") == 1 and count(seen, GAP, "1") == 3


def test_a_streaming_canary_like_the_stable_is_promoted_on_the_streaming_metrics(gateway: GatewayThread) -> None:
    """Over 30 s: an identical canary is promoted only on evidence, at the statistical judge's default 3 s
    intervals over every step."""
    with StreamLoad(gateway.url) as load:
        doc = streamed_rollout(gateway, load, 120)
    assert not load.failures, load.failures[:3]
    assert doc["state"] == "promoted", doc["reason"]
    metrics = {m["name"]: m["verdict"] for m in doc["verdicts"][-1]["metrics"]}
    # the six comparisons with the stable (both streaming ones and Triton's REJECTED included) and the canary's own
    # error ceiling
    assert metrics == dict.fromkeys(["error_rate", "capacity_error_rate", "client_error_rate", "latency",
                                     "time_to_first_response", "response_gap", "error_ceiling"], "pass")
