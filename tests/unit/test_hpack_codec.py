"""The HPACK decoder against the reference encoder (the ``hpack`` package), Huffman and all."""

from __future__ import annotations

import hpack
import pytest

from gateway.grpc.upstream import grpc_timeout
from gateway.http2.hpack_codec import Decoder, HpackError, encode_integer, literal, literal_indexed_name

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
