"""/metrics keeps each series' line between scrapes and writes again only the ones whose numbers
changed: a 5,000-model exposition is ~85,000 lines, and writing all of them with
prometheus-client's encoders on every scrape held the interpreter's lock, which the loop serving
inference shares, for seconds (issue 36: an active client's worst latency during a scrape 1.5-2.5x
its worst without one). Counted, never timed: the sample values formatted per scrape.
The lines kept are the encoders' own, to the byte, in both formats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import prometheus_client.exposition
import prometheus_client.openmetrics.exposition
import prometheus_client.utils
import pytest
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS

from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.telemetry import exposition
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import Outcome, Recorder


def book_of(models: int) -> PolicyBook:
    book = PolicyBook()
    spec = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
    book.rebuild("g", {f"m{index:05d}": (spec, 1) for index in range(models)}, {})
    return book


def families(text: bytes) -> dict[bytes, bytes]:
    """Family name -> its block (HELP, TYPE, samples), the process' own (they move) left out."""
    blocks: dict[bytes, list[bytes]] = {}
    name = b""
    for line in text.splitlines(keepends=True):
        if line.startswith(b"# HELP "):
            name = line.split()[2]
        if not name.startswith(b"process_") and line != b"# EOF\n":
            blocks.setdefault(name, []).append(line)
    return {name: b"".join(lines) for name, lines in blocks.items()}


def busy_recorder() -> Recorder:
    recorder = Recorder()
    recorder.record("m00001", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    recorder.record("m00001", "3", Outcome.UPSTREAM_ERROR, 0.2, "weighted", "grpc", "500")
    recorder.record("m00002", "3", Outcome.SUCCESS, 0.01, "pinned", "http", "200")
    recorder.record('we"ird\\name\n', "1", Outcome.CLIENT_ERROR, 0.001, "weighted", "http", "400")
    recorder.watch_latencies("m00003", "3")
    recorder.set_rollout_state("m00001", "progressing", ("progressing", "paused"))
    return recorder


# every format and name escaping a scraper may ask for (Prometheus 3 negotiates the escaping:
# under "dots" a name's underscores are written __, and kept lines spelled them as written once)
ACCEPTS = [None, OPENMETRICS, "text/plain;version=1.0.0;escaping=dots", "text/plain;version=1.0.0;escaping=values",
           "text/plain;version=1.0.0;escaping=underscores", "text/plain;version=1.0.0;escaping=allow-utf-8",
           f"{OPENMETRICS};escaping=dots", f"{OPENMETRICS};escaping=values", f"{OPENMETRICS};escaping=underscores",
           f"{OPENMETRICS};escaping=allow-utf-8"]


@pytest.mark.parametrize("accept", ACCEPTS)
async def test_the_kept_lines_are_the_encoders_own_in_every_format(accept: str | None) -> None:
    registry = make_registry(GatewayCollector(busy_recorder(), book_of(20)))
    try:
        first, _ = await registry.render(accept)
        second, _ = await registry.render(accept)  # from the kept lines
    finally:
        registry.close()
    encode, _ = choose_encoder(accept or "")
    expected = families(encode(registry.freeze()))
    assert families(first) == expected and families(second) == expected
    text = b"".join(expected.values())
    assert b"gateway_version_requests" in text or b"gateway__version__requests" in text
    assert b'we\\"ird\\\\name\\n' in text
    if accept and accept.startswith(OPENMETRICS):
        assert first.endswith(b"# EOF\n") and first.count(b"# EOF") == 1


async def test_a_scrape_after_one_request_formats_that_requests_series_alone_at_5000_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    formatted = [0]
    real = cast(Callable[[Any], str], prometheus_client.utils.floatToGoString)

    def counted(value: Any) -> str:
        formatted[0] += 1
        return real(value)

    for module in (prometheus_client.exposition, prometheus_client.openmetrics.exposition, exposition):
        monkeypatch.setattr(module, "floatToGoString", counted, raising=False)
    recorder = Recorder()
    recorder.record("m00007", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    registry = make_registry(GatewayCollector(recorder, book_of(5000)))
    try:
        await registry.render(None)
        assert formatted[0] > 5000 * 17, "the first scrape writes every line"
        recorder.record("m00007", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
        formatted[0] = 0
        body, _ = await registry.render(None)
    finally:
        registry.close()
    # m00007 version 2's request counter, its histogram (31 buckets, count, sum) and its 7 outcomes,
    # plus the process' own few and the small families that are not kept (state, sync errors)
    assert formatted[0] <= 1 + 33 + 7 + 40, f"{formatted[0]} values formatted for one request"
    assert b'gateway_requests_total{code="200",model="m00007",protocol="http",route="weighted",version="2"} 2.0' \
        in body
    assert families(body) == families(generate_latest(registry.freeze()))


async def test_a_warm_scrape_at_5000_models_sets_off_no_garbage_collection() -> None:
    """A scrape whose rows lived as lists through the rendering promoted ~75,000 objects into the
    collector's oldest generation each time and set off full collections (20-100 ms each with the
    interpreter's lock held: the loop stopped). Rows made as they are read die as they are
    written: counted, the collections during warm scrapes."""
    import gc

    recorder = Recorder()
    recorder.record("m00007", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
    registry = make_registry(GatewayCollector(recorder, book_of(5000)))
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    try:
        await registry.render(None)  # cold: every row's line is made and kept
        gc.collect()
        gc.callbacks.append(counted)
        try:
            for _ in range(3):
                recorder.record("m00007", "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
                await registry.render(None)
        finally:
            gc.callbacks.remove(counted)
    finally:
        registry.close()
    assert len(collections) <= 3 and 2 not in collections, f"collections during 3 warm scrapes: {collections}"
