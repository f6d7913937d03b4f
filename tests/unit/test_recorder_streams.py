"""Streaming response timings in the recorder: histograms for /metrics, samples for the judge."""

from __future__ import annotations

from gateway.grpc.router import GrpcRouter
from gateway.grpc.upstream import GrpcUpstream
from gateway.pipeline import DEFAULT, Pipeline
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.routing import Decision, Reason
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import LATENCY_BOUNDS, MAX_SERIES, UNKNOWN_MODEL, Recorder


def test_stream_timings_are_sampled_only_while_the_version_is_watched() -> None:
    recorder = Recorder()
    recorder.record_stream("tok", "2", True, 0.5)
    assert recorder.take_stream("tok", "2") == ([], [])
    recorder.watch_latencies("tok", "2")
    recorder.watch_latencies("tok", "2")  # idempotent
    recorder.record_stream("tok", "2", True, 0.004)
    recorder.record_stream("tok", "2", False, 0.011)
    recorder.record_stream("tok", "2", False, 0.012)
    recorder.record_stream("tok", "1", True, 0.003)  # not watched
    assert recorder.take_stream("tok", "2") == ([0.004], [0.011, 0.012])
    assert recorder.take_stream("tok", "2") == ([], []), "a take starts the samples over"
    assert recorder.take_latencies("tok", "2") == [], "stream timings are not request latencies"
    recorder.unwatch_latencies("tok", "2")
    recorder.record_stream("tok", "2", True, 0.004)
    assert recorder.take_stream("tok", "2") == ([], [])
    stream = recorder.streams[("tok", "2")]
    assert (stream.first.count, stream.gap.count) == (3, 2), "the cumulative totals count every response"
    assert stream.first.hist[LATENCY_BOUNDS.index(0.005)] == 2 and abs(stream.gap.sum - 0.023) < 1e-12


def test_stream_series_are_bounded() -> None:
    recorder = Recorder()
    for index in range(MAX_SERIES + 10):
        recorder.record_stream(f"m{index}", "1", True, 0.001)
    assert len(recorder.streams) == MAX_SERIES + 1
    assert recorder.streams[(UNKNOWN_MODEL, "")].first.count == 10


def test_prometheus_shows_stream_histograms_per_version_of_streaming_models_only() -> None:
    book, recorder = PolicyBook(), Recorder()
    book.put("tok", PolicySpec.model_validate({"weights": {"1": 90, "2": 10}}), 1)
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 1)
    registry = make_registry(GatewayCollector(recorder, book))
    first, gap = "gateway_stream_time_to_first_response_seconds", "gateway_stream_response_gap_seconds"
    assert registry.get_sample_value(f"{first}_count", {"model": "tok", "version": "1"}) is None
    recorder.record_stream("tok", "1", True, 0.004)
    recorder.record_stream("tok", "1", False, 0.02)
    recorder.record_stream("tok", "1", False, 0.04)
    assert registry.get_sample_value(f"{first}_count", {"model": "tok", "version": "1"}) == 1
    assert registry.get_sample_value(f"{gap}_count", {"model": "tok", "version": "1"}) == 2
    assert registry.get_sample_value(f"{gap}_bucket", {"model": "tok", "version": "1", "le": "0.03"}) == 1
    assert registry.get_sample_value(f"{gap}_sum", {"model": "tok", "version": "1"}) == 0.06
    # the canary of a streaming model from 0, before its first stream; a model that never streams: nothing
    assert registry.get_sample_value(f"{first}_count", {"model": "tok", "version": "2"}) == 0
    assert registry.get_sample_value(f"{first}_count", {"model": "qc", "version": "2"}) is None


def test_grpc_stream_replies_are_timed_from_the_request_then_from_each_other() -> None:
    recorder = Recorder()
    router = GrpcRouter(Pipeline(PolicyBook(), recorder), GrpcUpstream("127.0.0.1:1"))
    decision = Decision("2", Reason.WEIGHTED)
    recorder.watch_latencies("tok", "2")
    ok, failed = b"\x12\x00", b"\x0a\x04boom"  # ModelStreamInferResponse: infer_response / error_message
    replied = router.record_stream_reply("tok", decision, ok, started=0.0)
    assert replied > 0
    again = router.record_stream_reply("tok", decision, ok, 0.0, replied)
    assert router.record_stream_reply("tok", decision, failed, 0.0, again) == again, "a failed reply is not timed"
    first, gaps = recorder.take_stream("tok", "2")
    assert first == [replied] and len(gaps) == 1 and 0 < gaps[0] == again - replied
    router.record_stream_reply("tok", DEFAULT, ok, 0.0)  # Triton's default version: recorded under ""
    assert recorder.streams[("tok", "")].first.count == 1


def test_stream_replies_to_a_version_the_client_chose_are_shown_but_not_judged() -> None:
    recorder = Recorder()
    router = GrpcRouter(Pipeline(PolicyBook(), recorder), GrpcUpstream("127.0.0.1:1"))
    recorder.watch_latencies("tok", "2")
    ok = b"\x12\x00"
    for reason in (Reason.PINNED, Reason.RULE):
        replied = router.record_stream_reply("tok", Decision("2", reason), ok, started=0.0)
        router.record_stream_reply("tok", Decision("2", reason), ok, 0.0, replied)
    assert recorder.take_stream("tok", "2") == ([], []), "never in the judge's samples"
    stream = recorder.streams[("tok", "2")]
    assert (stream.first.count, stream.gap.count) == (2, 2), "in /metrics all the same"
    router.record_stream_reply("tok", Decision("2", Reason.STICKY), ok, started=0.0)
    assert len(recorder.take_stream("tok", "2")[0]) == 1
