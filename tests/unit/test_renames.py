"""The answers of a renamed target, byte level (gateway/proxy/renamed.py, gateway/grpc/renamed.py):
the called name replaces the answering model's where Triton writes it, and nothing else moves."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.grpc.renamed import grpc_rename, with_model
from gateway.proxy.renamed import rename, renamed_path

ANSWER = b'{"model_name":"qc_2026_12","model_version":"2","outputs":[{"name":"OUTPUT0","data":[12.0]}]}'


def test_paths_name_the_target_and_keep_the_rest() -> None:
    assert renamed_path(b"/v2/models/qc/infer?x=1", "qc_2026_12", "2") == b"/v2/models/qc_2026_12/versions/2/infer?x=1"
    assert renamed_path(b"/v2/models/qc/generate_stream", "tok", None) == b"/v2/models/tok/generate_stream"
    assert renamed_path(b"/v2/models/qc", "qc_2026_12", "2") == b"/v2/models/qc_2026_12/versions/2"
    assert renamed_path(b"/v2/models/q%20c/ready", "qc_2026_12", None) == b"/v2/models/qc_2026_12/ready"


def test_the_answers_name_is_the_called_one_and_nothing_else_changes() -> None:
    renamed = rename("qc_2026_12", "qc")
    assert renamed.body(200, ANSWER) == ANSWER.replace(b'"model_name":"qc_2026_12"', b'"model_name":"qc"')
    metadata = b'{"name":"qc_2026_12","versions":["1","2"],"inputs":[{"name":"qc_2026_12"}]}'
    assert renamed.body(200, metadata) == b'{"name":"qc","versions":["1","2"],"inputs":[{"name":"qc_2026_12"}]}'
    error = b'{"error":"Request for unknown model: \'qc_2026_12\' version 7 is not found; qc_2026_12x"}'
    assert renamed.body(404, error) == \
        b'{"error":"Request for unknown model: \'qc\' version 7 is not found; qc_2026_12x"}'
    other = b'{"model_name":"qc_2026_11","outputs":[]}'
    assert renamed.body(200, other) is other  # another model's answer: untouched


def test_a_name_is_looked_for_only_at_the_start_and_only_in_the_json_header() -> None:
    renamed = rename("qc_2026_12", "qc")
    late = b'{"outputs":[],"x":"' + b"y" * 100 + b'","model_name":"qc_2026_12"}'
    assert renamed.body(200, late) is late
    binary = b'{"model_version":"2"}' + b'"model_name":"qc_2026_12"'  # tensor bytes that happen to look alike
    assert renamed.body(200, binary, header_length=21) is binary


def test_a_binary_answer_gets_its_header_length_again() -> None:
    head = ANSWER
    tail = b"\x00\x00\x40\x41" * 4
    headers = [(b"content-type", b"application/octet-stream"), (b"Inference-Header-Content-Length", b"%d" % len(head))]
    out_headers, body = rename("qc_2026_12", "qc").answer(200, headers, head + tail, 1 << 20)
    length = int(dict(out_headers)[b"Inference-Header-Content-Length"])
    assert json.loads(body[:length])["model_name"] == "qc" and body[length:] == tail


def test_a_compressed_answer_is_compressed_again_with_its_own_coding() -> None:
    for coding, compress in ((b"gzip", gzip.compress), (b"deflate", zlib.compress)):
        headers = [(b"content-encoding", coding)]
        out_headers, body = rename("qc_2026_12", "qc").answer(200, headers, compress(ANSWER), 1 << 20)
        assert out_headers == headers
        assert json.loads(zlib.decompress(body, 47))["model_name"] == "qc"


class Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


EVENT = b'data: {"model_name":"tok","model_version":"2","text_output":"v2:%d"}\n\n'


@given(cuts=st.lists(st.integers(0, len(EVENT) * 3), max_size=8))
def test_events_are_renamed_wherever_the_chunks_are_cut(cuts: list[int]) -> None:
    stream = b"".join(EVENT % i for i in range(3))
    points = sorted({0, *cuts, len(stream)})
    chunks = [stream[a:b] for a, b in zip(points, points[1:]) if b > a]

    async def read() -> bytes:
        return b"".join([chunk async for chunk in rename("tok", "chat").events(Chunks(chunks))])  # type: ignore[arg-type]

    assert asyncio.run(read()) == stream.replace(b'"model_name":"tok"', b'"model_name":"chat"')


def test_grpc_requests_and_replies() -> None:
    request = service_pb2.ModelInferRequest(model_name="qc", id="r-1")
    request.raw_input_contents.append(b"\x00" * 16)
    sent = service_pb2.ModelInferRequest.FromString(with_model(request.SerializeToString(), "qc_2026_12", "2"))
    assert (sent.model_name, sent.model_version, sent.id) == ("qc_2026_12", "2", "r-1")
    assert sent.raw_input_contents == request.raw_input_contents

    renamed = grpc_rename("qc_2026_12", "qc")
    reply = service_pb2.ModelInferResponse(model_name="qc_2026_12", model_version="2", id="r-1")
    reply.raw_output_contents.append(b"\x01" * 16)
    out = service_pb2.ModelInferResponse.FromString(renamed.reply(reply.SerializeToString()))
    assert (out.model_name, out.model_version, out.id, out.raw_output_contents) == (
        "qc", "2", "r-1", reply.raw_output_contents)
    ready = service_pb2.ModelReadyResponse(ready=True).SerializeToString()
    assert renamed.reply(ready) == ready  # names nothing

    config = service_pb2.ModelConfigResponse(config=model_config_pb2.ModelConfig(name="qc_2026_12", max_batch_size=8))
    out_config = service_pb2.ModelConfigResponse.FromString(renamed.config_reply(config.SerializeToString()))
    assert (out_config.config.name, out_config.config.max_batch_size) == ("qc", 8)

    streamed = service_pb2.ModelStreamInferResponse(error_message="bad input for model 'qc_2026_12'",
                                                    infer_response=reply)
    out_stream = service_pb2.ModelStreamInferResponse.FromString(renamed.stream_reply(streamed.SerializeToString()))
    assert out_stream.error_message == "bad input for model 'qc'" and out_stream.infer_response.model_name == "qc"
    assert renamed.details("unexpected shape for model 'qc_2026_12'") == "unexpected shape for model 'qc'"


def test_a_stream_error_naming_no_model_gets_every_pending_targets_called_name() -> None:
    """A failed request's reply on a stream names no model, so the ledger charges it to the oldest
    request (here another model's): its words must say the called names all the same."""
    from typing import Any

    from gateway.grpc.router import GrpcRouter, StreamLedger
    from gateway.pipeline import Pipeline
    from gateway.policy_book import PolicyBook
    from gateway.routing import Decision, Reason
    from gateway.telemetry.recorder import Recorder

    upstream: Any = None  # nothing is sent: only a reply is read
    router = GrpcRouter(Pipeline(PolicyBook(), Recorder()), upstream)
    ledger = StreamLedger()
    ledger.sent("chat", Decision("tok", Reason.WEIGHTED), "tok", grpc_rename("tok", "chat"))
    ledger.sent("qc", Decision("qc_2026_12", Reason.RULE), "qc_2026_12", grpc_rename("qc_2026_12", "qc"))
    error = service_pb2.ModelStreamInferResponse(error_message="unexpected shape for model 'qc_2026_12'")
    out = service_pb2.ModelStreamInferResponse.FromString(router.record_stream_reply(ledger, error.SerializeToString()))
    assert out.error_message == "unexpected shape for model 'qc'"
