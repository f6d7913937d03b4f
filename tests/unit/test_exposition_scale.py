"""/metrics at 5,000 models: series only for versions with traffic (or named by a policy, as one
bounded set), a consistent snapshot, and the encoding off the loop. Counted, never timed.

Before issue 36 every routed version had zero-valued histograms for both protocols: 147
series per model with no traffic, 735,000 series and 80 MB at 5,000 models (bench/scale.py).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client.exposition import generate_latest

from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import Outcome, Recorder

MODELS = 5000
# per model with a policy of two versions and no traffic: 2 weights, 1 revision, 7 outcomes x 2 versions
# (rejected, issue 34: Triton's queue refusals, from 0 like the others so the Prometheus source counts the first)
SERIES_PER_IDLE_MODEL = 17


def book_of(models: int) -> PolicyBook:
    book = PolicyBook()
    spec = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
    book.rebuild("g", {f"m{index:05d}": (spec, 1) for index in range(models)}, {})
    return book


def series_of(text: bytes, model: str) -> int:
    return sum(1 for line in text.splitlines() if not line.startswith(b"#") and f'model="{model}"'.encode() in line)


def test_a_5000_model_exposition_holds_series_for_traffic_and_a_bounded_set_per_policy() -> None:
    book, recorder = book_of(MODELS), Recorder()
    for model in ("m00000", "m00001", "m00002"):
        recorder.record(model, "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    text = generate_latest(make_registry(GatewayCollector(recorder, book)))
    assert series_of(text, "m04999") == SERIES_PER_IDLE_MODEL
    busy = series_of(text, "m00000")
    assert busy == SERIES_PER_IDLE_MODEL + 1 + 33  # + gateway_requests_total, + one histogram (http, judged)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    assert series <= MODELS * SERIES_PER_IDLE_MODEL + 3 * 34 + 100  # + the process' and the state's own few
    assert len(text) <= 15_000_000, f"{len(text) / 1e6:.1f} MB at {MODELS} models"


def test_a_watched_version_has_its_histograms_from_zero_and_unwatched_ones_only_with_traffic() -> None:
    book, recorder = book_of(3), Recorder()
    recorder.watch_latencies("m00001", "3")
    text = generate_latest(make_registry(GatewayCollector(recorder, book)))
    histograms = [line for line in text.splitlines() if line.startswith(b"gateway_request_duration_seconds_count")]
    assert len(histograms) == 2 and all(b'model="m00001"' in line and b'version="3"' in line for line in histograms)


def test_the_exposition_is_one_moments_numbers() -> None:
    """Copied on the loop, encoded later: what is recorded in between is not in it, and every
    histogram's count is its +Inf bucket."""
    book, recorder = book_of(1), Recorder()
    recorder.record("m00000", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    registry = make_registry(GatewayCollector(recorder, book))
    frozen = registry.freeze()
    for _ in range(5):
        recorder.record("m00000", "2", Outcome.SUCCESS, 0.04, "weighted", "http", "200")
    text = generate_latest(frozen)
    assert b'gateway_request_duration_seconds_count{judged="true",model="m00000",protocol="http",version="2"} 1.0' \
        in text
    assert b'gateway_request_duration_seconds_bucket{judged="true",le="+Inf",model="m00000",protocol="http",' \
        b'version="2"} 1.0' in text
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {
        "model": "m00000", "version": "2", "protocol": "http", "judged": "true"}) == 6


async def test_the_encoding_runs_on_a_thread_of_its_own_and_concurrent_scrapes_share_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import prometheus_client.exposition

    calls: list[int] = []
    release = threading.Event()
    real = prometheus_client.exposition.generate_latest

    def held(registry: object) -> bytes:
        calls.append(threading.get_ident())
        release.wait(10)
        return bytes(real(registry))  # type: ignore[arg-type]

    monkeypatch.setattr(prometheus_client.exposition, "generate_latest", held)
    registry = make_registry(GatewayCollector(Recorder(), book_of(2)))
    try:
        scrapes = [asyncio.create_task(registry.render(None)) for _ in range(3)]
        ticks = 0
        while not calls:  # the loop runs on while the text is built
            ticks += 1
            await asyncio.sleep(0.001)
        for _ in range(10):
            ticks += 1
            await asyncio.sleep(0)
        assert not any(scrape.done() for scrape in scrapes)
        release.set()
        answers = await asyncio.gather(*scrapes)
    finally:
        release.set()
        registry.close()
    assert calls and threading.get_ident() not in calls and len(calls) == 1, "one encoding, off the loop"
    assert {body for body, _ in answers} == {answers[0][0]} and b"gateway_route_weight" in answers[0][0]


async def test_the_rendering_thread_hands_the_loop_the_interpreter_lock_every_few_hundred_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that only computes keeps the interpreter's lock for 5 ms each time the loop lets
    go of it: the loop made ~150 turns a second while a 5,000-model exposition was built, ~900
    without. The rendering thread pauses (a sleep: the lock goes to the loop at once) every
    PACE_EVERY samples it builds or writes, and nowhere else."""
    from gateway.telemetry import exposition

    pauses: list[int] = []

    class CountedTime:
        @staticmethod
        def sleep(seconds: float) -> None:
            pauses.append(threading.get_ident())

    monkeypatch.setattr(exposition, "time", CountedTime, raising=False)
    registry = make_registry(GatewayCollector(Recorder(), book_of(1000)))
    try:
        body, _ = await registry.render(None)
        rendered = len(pauses)
        assert b"gateway_route_weight" in generate_latest(registry.freeze())  # on this thread: no pause
    finally:
        registry.close()
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    built = 1000 * (2 * 6 + 2)  # the big families' samples, paced as they are built: outcomes and weights
    assert samples >= 1000 * SERIES_PER_IDLE_MODEL
    assert rendered >= (built + samples) // exposition.PACE_EVERY - 2, \
        f"{rendered} pauses for {built} samples built and {samples} written"
    assert len(pauses) == rendered and threading.get_ident() not in pauses, "only the rendering thread pauses"
