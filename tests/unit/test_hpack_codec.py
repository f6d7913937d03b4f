"""The HPACK decoder against the reference encoder (the ``hpack`` package), Huffman and all."""

from __future__ import annotations

import hpack
import pytest

from gateway.grpc.upstream import grpc_timeout
from gateway.http2.hpack_codec import (
    Decoder,
    HeaderListTooLarge,
    HpackError,
    encode_integer,
    literal,
    literal_indexed_name,
)

RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"x-gateway-route", b"weighted")]
TRAILERS = [(b"grpc-status", b"0"), (b"grpc-message", b"all good")]


@pytest.mark.parametrize("huffman", [True, False])
def test_decoder_follows_the_encoders_dynamic_table(huffman: bool) -> None:
    encoder, decoder = hpack.Encoder(), Decoder()
    for _ in range(3):  # the second and later blocks are indexed references into the dynamic table
        for headers in (RESPONSE, TRAILERS):
            block = encoder.encode(headers, huffman=huffman)
            assert decoder.decode(block) == headers
    assert len(encoder.encode(RESPONSE, huffman=huffman)) < 8, "the encoder should be reusing entries"


def test_a_repeated_block_means_what_the_table_says_now() -> None:
    """Decoded blocks are remembered while the table stays as it was; the same bytes after an
    insertion name another entry (every dynamic index shifts) and must be decoded afresh."""
    decoder = Decoder()
    newest = b"\xbe"  # indexed field 62: the newest dynamic entry
    for value in (b"a", b"b", b"c"):
        decoder.decode(b"\x40\x07x-value" + bytes([len(value)]) + value)  # literal with incremental indexing
        assert decoder.decode(newest) == [(b"x-value", value)]
        assert decoder.decode(newest) == [(b"x-value", value)]  # remembered: the table did not change
    repeated = decoder.decode(newest)
    repeated.append((b"x-added", b"by the caller"))  # a caller's list is its own
    assert decoder.decode(newest) == [(b"x-value", b"c")]
    decoder.decode(b"\x20")  # a size update to 0 empties the table: index 62 names nothing now
    with pytest.raises(HpackError):
        decoder.decode(newest)


def test_never_indexed_and_table_size_updates() -> None:
    encoder, decoder = hpack.Encoder(), Decoder()
    secret = hpack.HeaderTuple(b"authorization", b"Bearer abc")
    sensitive = hpack.NeverIndexedHeaderTuple(*secret)
    assert decoder.decode(encoder.encode([sensitive])) == [tuple(secret)]
    encoder.header_table_size = 64  # the next block starts with a size update: entries get evicted
    for value in (b"first-value-xxxxxxxxxx", b"second-value-yyyyyyyyy"):
        assert decoder.decode(encoder.encode([(b"x-long", value)])) == [(b"x-long", value)]
    assert decoder._size <= 64


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(HpackError):
        Decoder().decode(b"\xff\x80\x80\x80\x80\x80\x01")  # an integer past 2**28
    with pytest.raises(HpackError):
        Decoder().decode(b"\xbe")  # dynamic index 62 with an empty table
    with pytest.raises(HpackError):
        Decoder().decode(b"\x00\x05ab")  # truncated string
    with pytest.raises(HpackError):
        Decoder(max_table_size=100).decode(b"\x3f\xe1\x1f")  # size update above what we advertised


def test_encoded_requests_read_back() -> None:
    block = b"\x83\x86" + literal_indexed_name(4, b"/svc/Method") + literal(b"x-user", b"u" * 200)
    assert hpack.Decoder().decode(block, raw=True) == [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/svc/Method"), (b"x-user", b"u" * 200)]
    assert encode_integer(1337, 5) == b"\x1f\x9a\x0a"  # RFC 7541 C.1.2


def test_grpc_timeout_keeps_to_eight_digits() -> None:
    assert grpc_timeout(0.3) == b"300000u"
    assert grpc_timeout(0.0) == b"1u"
    assert grpc_timeout(250.0) == b"250000m"
    assert grpc_timeout(10**9) == b"99999999S"


def test_a_header_list_past_the_limit_is_not_built_but_the_table_stays_in_step() -> None:
    encoder, decoder = hpack.Encoder(), Decoder(max_list_size=1024)
    big = [(b"x-big", b"b" * 2000)]
    with pytest.raises(HeaderListTooLarge):
        decoder.decode(encoder.encode(big))  # indexed by the encoder: the decoder must index it too
    assert decoder._dynamic[0] == big[0]
    small = [(b"x-user-id", b"u1")]
    assert decoder.decode(encoder.encode(small)) == small


def test_references_to_one_entry_are_counted_not_copied() -> None:
    decoder = Decoder(max_list_size=16 << 10)
    block = b"\x40\x05x-big\x7f" + bytes([0x80 | ((4000 - 127) & 0x7F), (4000 - 127) >> 7]) + b"b" * 4000
    with pytest.raises(HeaderListTooLarge) as caught:
        decoder.decode(block + b"\xbe" * 10_000)
    assert caught.value.size > 40_000_000  # what the list would have been: never built


def test_a_table_size_update_after_a_field_is_refused() -> None:
    with pytest.raises(HpackError, match="after a header field"):
        Decoder().decode(b"\x82\x20")  # :method GET, then a size update
    assert Decoder().decode(b"\x20\x3f\xe1\x1f\x82") == [(b":method", b"GET")]  # two updates first are fine
