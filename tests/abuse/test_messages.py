"""Message-size attacks: a declared giant message and a deflate bomb, both RESOURCE_EXHAUSTED."""

from __future__ import annotations

import zlib

import grpc
import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import DATA, END_STREAM, MB, Attacker, frame, request_headers, watch
from tests.support import GatewayThread

pytestmark = pytest.mark.triton
RESOURCE_EXHAUSTED = 8


def test_a_message_declared_above_the_limit_is_refused_before_its_bytes(gateway: GatewayThread,
                                                                         triton: LocalTriton) -> None:
    """A 5-byte prefix announcing 100 MiB (the default limit is 64 MiB): answered at once."""
    with watch(gateway, triton, rss_bound_mb=32):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(attacker.headers(1, request_headers()) + frame(DATA, 0, 1, b"\x00" + (100 * MB).to_bytes(4, "big")
                                                                     + b"x" * 1000))
        assert attacker.statuses(1) == {1: RESOURCE_EXHAUSTED}
        attacker.close()


def deflate_bomb(inflated_mb: int, wbits: int) -> bytes:
    """``inflated_mb`` MiB of zeros, compressed ~230:1 (level 1: quick to build)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, wbits)
    zeros = bytes(MB)
    return b"".join(compressor.compress(zeros) for _ in range(inflated_mb)) + compressor.flush()


@pytest.mark.parametrize(("encoding", "wbits"), [(b"gzip", 16 + zlib.MAX_WBITS), (b"deflate", zlib.MAX_WBITS)])
def test_a_deflate_bomb_is_inflated_no_further_than_the_limit(gateway: GatewayThread, triton: LocalTriton,
                                                              encoding: bytes, wbits: int) -> None:
    """~600 KB that inflate to 128 MiB: inflation stops past the 64 MiB limit, the call is RESOURCE_EXHAUSTED."""
    bomb = deflate_bomb(128, wbits)
    with watch(gateway, triton, rss_bound_mb=192):
        attacker = Attacker(gateway.settings.grpc_port)
        message = b"\x01" + len(bomb).to_bytes(4, "big") + bomb
        data = b"".join(frame(DATA, 0, 1, message[i:i + 16384]) for i in range(0, len(message), 16384))
        attacker.send(attacker.headers(1, request_headers(extra=[(b"grpc-encoding", encoding)])) + data
                      + frame(DATA, END_STREAM, 1))
        assert attacker.statuses(1, until=5) == {1: RESOURCE_EXHAUSTED}
        attacker.close()


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_a_large_compressed_message_is_inflated_in_slices_and_answered(gateway: GatewayThread,
                                                                       compression: grpc.Compression) -> None:
    """Not an attack: 20 MiB that compress to ~20 KB are inflated a slice per loop turn, then
    forwarded, with the messages that came after them in order."""
    unknown_field = b"\x7a" + _varint(20 * MB) + bytes(20 * MB)  # field 15, skipped by Triton's parser
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}",
                                    options=[("grpc.max_send_message_length", 32 * MB)])
    call = channel.unary_unary("/inference.GRPCInferenceService/ServerMetadata")
    answers = [call(unknown_field, timeout=20, compression=compression) for _ in range(2)]
    channel.close()
    assert all(b"triton" in answer for answer in answers)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
