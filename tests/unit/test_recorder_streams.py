"""Streaming response timings in the recorder: histograms for /metrics, samples for the judge."""

from __future__ import annotations

import pytest

from gateway.grpc.router import GrpcRouter, StreamLedger
from gateway.grpc.upstream import GrpcUpstream
from gateway.pipeline import DEFAULT, Pipeline
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.routing import Decision, Reason
from gateway.telemetry.prometheus import GatewayCollector, make_registry
from gateway.telemetry.recorder import LATENCY_BOUNDS, MAX_SERIES, UNKNOWN_MODEL, Outcome, Recorder


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
    # a watched canary of a streaming model from 0, before its first stream; a model that never streams,
    # or a version no rollout watches: nothing
    assert registry.get_sample_value(f"{first}_count", {"model": "tok", "version": "2"}) is None
    recorder.watch_latencies("tok", "2")
    recorder.watch_latencies("qc", "2")
    assert registry.get_sample_value(f"{first}_count", {"model": "tok", "version": "2"}) == 0
    assert registry.get_sample_value(f"{first}_count", {"model": "qc", "version": "2"}) is None


def reply(model: str = "tok", error: str = "", final: bool | None = True, request_id: str = "") -> bytes:
    """A ModelStreamInferResponse as Triton sends it (tritonclient's protos)."""
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelStreamInferResponse(error_message=error)
    response.infer_response.model_name = model
    response.infer_response.id = request_id
    if final is not None:
        response.infer_response.parameters["triton_final_response"].bool_param = final
    return bytes(response.SerializeToString())


def new_router() -> tuple[GrpcRouter, Recorder]:
    recorder = Recorder()
    return GrpcRouter(Pipeline(PolicyBook(), recorder), GrpcUpstream("127.0.0.1:1")), recorder


def test_grpc_stream_replies_are_timed_from_the_request_then_from_each_other() -> None:
    router, recorder = new_router()
    decision = Decision("2", Reason.WEIGHTED)
    recorder.watch_latencies("tok", "2")
    ledger = StreamLedger()
    ledger.sent("tok", decision)
    router.record_stream_reply(ledger, reply(final=False))
    router.record_stream_reply(ledger, reply(final=False))
    router.record_stream_reply(ledger, reply(error="injected fault in version 2"))
    assert not ledger.pending, "the failed reply was the request's last"
    first, gaps = recorder.take_stream("tok", "2")
    assert len(first) == 1 and len(gaps) == 1 and first[0] > 0 and gaps[0] > 0, "a failed reply is not timed"
    ledger.sent("tok", DEFAULT)
    router.record_stream_reply(ledger, reply())  # Triton's default version: recorded under ""
    assert recorder.streams[("tok", "")].first.count == 1


def test_stream_replies_to_a_version_the_client_chose_are_shown_but_not_judged() -> None:
    router, recorder = new_router()
    recorder.watch_latencies("tok", "2")
    ledger = StreamLedger()
    for reason in (Reason.PINNED, Reason.RULE):
        ledger.sent("tok", Decision("2", reason))
        router.record_stream_reply(ledger, reply(final=False))
        router.record_stream_reply(ledger, reply())
    assert recorder.take_stream("tok", "2") == ([], []), "never in the judge's samples"
    stream = recorder.streams[("tok", "2")]
    assert (stream.first.count, stream.gap.count) == (2, 2), "in /metrics all the same"
    ledger.sent("tok", Decision("2", Reason.STICKY))
    router.record_stream_reply(ledger, reply())
    assert len(recorder.take_stream("tok", "2")[0]) == 1


def test_each_stream_reply_is_charged_to_the_decision_that_routed_its_own_request() -> None:
    """Issue 23: a canary-routed request, a pinned one and a stable-routed one on one stream,
    answered in order. Before, every reply was charged to the stream's last routed message (the
    stable's here), and replies to pinned messages with it."""
    router, recorder = new_router()
    router.book.put("qc", PolicySpec.model_validate({"weights": {"2": 90, "3": 10}}), 1)
    ledger = StreamLedger()
    ledger.sent("qc", Decision("3", Reason.WEIGHTED))
    ledger.sent("qc", Decision("3", Reason.PINNED))
    ledger.sent("qc", Decision("2", Reason.WEIGHTED))
    router.record_stream_reply(ledger, reply("qc", error="injected fault in version 3"))
    router.record_stream_reply(ledger, reply("qc", error="injected fault in version 3"))
    router.record_stream_reply(ledger, reply("qc"))
    outcomes = recorder.outcome_totals()
    assert outcomes[("qc", "3")][Outcome.UPSTREAM_ERROR] == 1, "the canary's own failure, judged"
    assert outcomes[("qc", "2")][Outcome.SUCCESS] == 1 and outcomes[("qc", "2")][Outcome.UPSTREAM_ERROR] == 0
    pinned = recorder.steered_outcome_totals()[("qc", "3")]
    assert pinned[Outcome.UPSTREAM_ERROR] == 1, "the pinned reply: shown, not judged"
    assert not ledger.pending


def test_a_reply_answers_the_oldest_request_of_its_own_model() -> None:
    """Triton answers one model's requests in order, not a stream's: a fast model's reply may
    overtake a slow one's."""
    router, recorder = new_router()
    ledger = StreamLedger()
    ledger.sent("tok", Decision("1", Reason.WEIGHTED))
    ledger.sent("qc", Decision("3", Reason.WEIGHTED))
    router.record_stream_reply(ledger, reply("qc", error="injected fault in version 3"))
    router.record_stream_reply(ledger, reply("tok"))
    outcomes = recorder.outcome_totals()
    assert outcomes[("qc", "3")][Outcome.UPSTREAM_ERROR] == 1 and outcomes[("tok", "1")][Outcome.SUCCESS] == 1


@pytest.mark.parametrize(("error", "request_id", "outcome"), [
    ("injected fault in version 3", "", Outcome.UPSTREAM_ERROR),
    # Triton's own words for input it could not accept, as a real Triton sends them in a stream
    ("unexpected inference input 'X' for model 'qc'", "", Outcome.CLIENT_ERROR),
    ("[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model 'qc'. Expected [-1,4], got [1,5].",
     "", Outcome.CLIENT_ERROR),
    ("[request id: r1] expected 1 inputs but got 0 inputs for model 'qc'.", "r1", Outcome.CLIENT_ERROR),
    ("Exceeds maximum queue size", "", Outcome.REJECTED),  # the version's capacity (issue 34; overload before)
    ("Request timeout expired", "", Outcome.REJECTED),
    # words in the client's own request id (echoed in the reply) classify nothing
    ("injected fault in version 3", "Exceeds maximum queue size", Outcome.UPSTREAM_ERROR),
    ("injected fault in version 3", "unexpected inference input 'X'", Outcome.UPSTREAM_ERROR),
])
def test_in_stream_errors_are_classified_by_triton_s_words(error: str, request_id: str, outcome: Outcome) -> None:
    router, recorder = new_router()
    ledger = StreamLedger()
    ledger.sent("qc", Decision("3", Reason.WEIGHTED))
    router.record_stream_reply(ledger, reply("qc", error=error, request_id=request_id, final=None))
    counts = recorder.outcome_totals()[("qc", "3")]
    assert {name: n for name, n in counts.items() if n} == {outcome: 1}
