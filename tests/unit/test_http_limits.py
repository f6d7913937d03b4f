"""The HTTP port's bounds as pure parts: whole-body reading, bounded inflation, hop-by-hop headers."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import MutableMapping
from typing import Any

import pytest

from gateway.byte_budget import ByteBudget
from gateway.errors import BadRequest, ClientGone, GatewayBusy, PayloadTooLarge
from gateway.pipeline import checked_model, checked_version
from gateway.proxy.limits import BodyReader, end_to_end, inflate
from gateway.proxy.shadow import GrpcMirror, Mirror, ShadowMirror, _decoded, agree
from gateway.sequences import checked_sequence_id
from gateway.settings import Settings, SettingsError
from gateway.telemetry.recorder import Recorder
from gateway.upstream import HttpUpstream


class Pieces:
    """An ASGI ``receive`` handing out body pieces, then (optionally) a disconnect."""

    def __init__(self, *pieces: bytes, disconnect: bool = False) -> None:
        self.messages: list[MutableMapping[str, Any]] = [
            {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1 or disconnect}
            for i, piece in enumerate(pieces)]
        if disconnect:
            self.messages.append({"type": "http.disconnect"})
        self.calls = 0

    async def __call__(self) -> MutableMapping[str, Any]:
        self.calls += 1
        return self.messages.pop(0)


def test_a_body_is_read_whole_and_held_until_released() -> None:
    reader = BodyReader(max_body=100, max_buffered=1000)
    body = asyncio.run(reader.read(b"ab", Pieces(b"cd", b"ef"), [(b"content-length", b"6")]))
    assert body == b"abcdef" and reader.held == 6
    reader.release(len(body))
    assert reader.held == 0


def test_an_announced_body_over_the_limit_is_refused_unread() -> None:
    reader, receive = BodyReader(max_body=100, max_buffered=1000), Pieces(b"x")
    with pytest.raises(PayloadTooLarge, match="1000000000 bytes is over the limit of 100"):
        asyncio.run(reader.read(b"", receive, [(b"content-length", b"1000000000")]))
    assert receive.calls == 0 and reader.held == 0


@pytest.mark.parametrize(("reader", "pieces", "error"), [
    (BodyReader(max_body=10, max_buffered=1000), Pieces(b"x" * 6, b"x" * 6), PayloadTooLarge),  # chunked, too long
    (BodyReader(max_body=100, max_buffered=10), Pieces(b"x" * 6, b"x" * 6), GatewayBusy),  # all bodies together
    (BodyReader(max_body=100, max_buffered=1000), Pieces(b"x" * 6, disconnect=True), ClientGone),
])
def test_a_refused_body_holds_nothing(reader: BodyReader, pieces: Pieces, error: type[Exception]) -> None:
    with pytest.raises(error):
        asyncio.run(reader.read(b"abc", pieces, []))
    assert reader.held == 0


def test_overload_is_answered_with_retry_after() -> None:
    assert (b"retry-after", b"1") in GatewayBusy("busy").headers and GatewayBusy.status == 503
    assert (b"connection", b"close") in PayloadTooLarge("big").headers  # the unread body is not parsed


def test_inflation_is_bounded() -> None:
    bomb = gzip.compress(b" " * 1_000_000)
    with pytest.raises(PayloadTooLarge, match="decompresses to more than the limit of 1000 bytes"):
        inflate(bomb, b"gzip", 1000)
    assert inflate(bomb, b"gzip", 1000, prefix=10) == b" " * 10  # only the prefix is inflated
    for prefix in (0, -1, 1001):  # 0 used to reach zlib as max_length=0: no bound at all (1 MB back)
        with pytest.raises(PayloadTooLarge):
            inflate(bomb, b"gzip", 1000, prefix=prefix)
    assert inflate(zlib.compress(b"{}"), b"deflate", 1000) == b"{}"
    assert inflate(b"plain", None, 3) == b"plain"  # not compressed: nothing to inflate
    with pytest.raises(zlib.error):
        inflate(b"not gzip", b"gzip", 1000)


def test_decompressing_off_the_loop_gives_the_same_bytes() -> None:
    reader = BodyReader(max_body=1000)
    assert asyncio.run(reader.decoded(gzip.compress(b'{"a": 1}'), b"gzip")) == b'{"a": 1}'
    with pytest.raises(PayloadTooLarge):
        asyncio.run(reader.decoded(gzip.compress(b" " * 2000), b"gzip"))


def test_response_hop_by_hop_headers_are_dropped() -> None:
    headers = [(b"Content-Type", b"application/json"), (b"Content-Length", b"2"), (b"Connection", b"X-Secret, close"),
               (b"X-Secret", b"1"), (b"Keep-Alive", b"timeout=5"), (b"Proxy-Authenticate", b"Basic"),
               (b"Upgrade", b"h2c"), (b"Trailer", b"x"), (b"inference-header-content-length", b"2")]
    assert end_to_end(headers) == [(b"Content-Type", b"application/json"),
                                   (b"inference-header-content-length", b"2")]
    usual = [(b"Content-Type", b"application/json"), (b"Content-Length", b"2")]
    assert end_to_end(usual) == usual[:1]


def test_request_hop_by_hop_headers_are_not_sent_upstream() -> None:
    upstream = HttpUpstream("http://triton:8000")
    head = upstream._head(b"POST", b"/v2/models/qc/infer", [
        (b"content-type", b"application/json"), (b"connection", b"keep-alive, x-internal, X-Other"),
        (b"x-internal", b"secret"), (b"x-other", b"1"), (b"proxy-authorization", b"Basic Zm9v"),
        (b"te", b"trailers"), (b"upgrade", b"h2c"), (b"keep-alive", b"timeout=9"), (b"trailer", b"x"),
        (b"transfer-encoding", b"chunked"), (b"x-user-id", b"42")], b"{}", None)
    assert head == (b"POST /v2/models/qc/infer HTTP/1.1\r\nhost: triton:8000\r\ncontent-type: application/json\r\n"
                    b"x-user-id: 42\r\ncontent-length: 2\r\n\r\n")


def test_shadow_compares_compressed_answers_by_their_content() -> None:
    answer = json.dumps({"outputs": [{"name": "OUT", "datatype": "FP32", "shape": [1], "data": [1.0]}]}).encode()
    packed = asyncio.run(_decoded(gzip.compress(answer), [(b"Content-Encoding", b"gzip")]))
    assert packed is not None and agree(answer, packed)
    assert asyncio.run(_decoded(gzip.compress(b" " * (65 << 20)), [(b"content-encoding", b"gzip")])) is None


def test_the_buffer_budget_holds_one_largest_body() -> None:
    with pytest.raises(SettingsError, match="max_buffered_body_bytes .* must be at least twice max_body_bytes"):
        Settings.load(None, max_body_bytes=2048, max_buffered_body_bytes=1024)
    with pytest.raises(SettingsError, match="what it inflates to, must fit"):  # a gRPC message and its inflation too
        Settings.load(None, max_body_bytes=1 << 20, grpc_max_message_bytes=64 << 20, max_buffered_body_bytes=96 << 20)


def test_the_budget_is_released_on_every_way_out() -> None:
    budget = ByteBudget(100)
    with budget.charged(60):
        assert budget.held == 60 and not budget.try_take(41) and budget.try_take(40)
        budget.release(40)
        with pytest.raises(GatewayBusy):
            budget.take(41)
    assert budget.held == 0
    with pytest.raises(RecursionError), budget.charged(100):  # any exception, not only the gateway's own
        raise RecursionError
    assert budget.held == 0


def test_a_json_header_is_charged_while_it_is_parsed() -> None:
    """The inflated (or cut) JSON header of a sequence request counts against the budget while the
    front parses it; a budget without room answers 503."""
    from gateway.pipeline import Pipeline
    from gateway.policy_book import PolicyBook
    from gateway.proxy.http import HttpProxy

    budget = ByteBudget(1 << 20)
    proxy = HttpProxy(Pipeline(PolicyBook(), Recorder()), HttpUpstream("http://127.0.0.1:9"),
                      bodies=BodyReader(max_body=1 << 20, budget=budget))
    header = json.dumps({"parameters": {"sequence_id": 7, "sequence_start": True}}).encode()
    headers = [(b"content-encoding", b"gzip")]
    assert asyncio.run(proxy._sequence(headers, gzip.compress(header))) is not None and budget.held == 0
    budget.take((1 << 20) - 10)  # the header is 50 bytes: no room for it
    with pytest.raises(GatewayBusy):
        asyncio.run(proxy._sequence(headers, gzip.compress(header)))
    budget.release((1 << 20) - 10)
    assert budget.held == 0


def test_shadow_copies_are_charged_until_their_worker_is_done() -> None:
    """The shadow queue holds up to 1,000 copies with their bodies: they count against the budget too."""
    recorder = Recorder()
    budget = ByteBudget(1000)
    shadow = ShadowMirror(HttpUpstream("http://127.0.0.1:9"), recorder, budget=budget)
    first = Mirror("qc", "3", b"POST", b"/v2/models/qc/versions/3/infer", [], b"x" * 400, 200, b"y" * 200)
    shadow.offer(first)
    assert budget.held == 600
    shadow.offer(GrpcMirror("qc", "3", None, "/x", b"x" * 300, (), b"y" * 200))
    assert budget.held == 600 and shadow.stats["qc", "3"].dropped == 1  # no room: dropped and counted
    asyncio.run(shadow.stop())  # never sent: released
    assert budget.held == 0


@pytest.mark.parametrize("value", [[1], {"a": 1}, True, 1.5, -3, 1 << 64, "s" * 129])
def test_a_sequence_id_is_what_triton_takes(value: object) -> None:
    with pytest.raises(BadRequest, match="sequence_id"):
        checked_sequence_id(value)


def test_sequence_ids_triton_takes_are_kept_as_sent() -> None:
    assert [checked_sequence_id(v) for v in (None, 0, "", 7, (1 << 64) - 1, "s" * 128)] == [
        None, None, None, 7, (1 << 64) - 1, "s" * 128]


@pytest.mark.parametrize("version", ["", "abc", "1\n2", "1\"2", "1 ", "-1", "+1", "1" * 20, "\u0661"])
def test_a_pinned_version_is_digits(version: str) -> None:
    with pytest.raises(BadRequest, match="is not a version"):
        checked_version(version)


def test_a_pinned_version_reads_as_triton_reads_it() -> None:
    assert [checked_version(v) for v in ("2", "0002", "9" * 19)] == ["2", "2", "9" * 19]


def test_a_model_name_fits_a_model_repository() -> None:
    assert checked_model("m" * 255) == "m" * 255
    for name in ("m" * 256, "\u00e9" * 128, "q\nc", "q\x7fc"):
        with pytest.raises(BadRequest):
            checked_model(name)
