"""Header attacks: the HPACK bomb, and header lists past SETTINGS_MAX_HEADER_LIST_SIZE."""

from __future__ import annotations

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import (
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    Attacker,
    frame,
    infer_message,
    request_headers,
    watch,
)
from tests.support import GatewayThread

pytestmark = pytest.mark.triton
RESOURCE_EXHAUSTED = 8


def bomb(attacker: Attacker, references: int) -> bytes:
    """A request whose one 4 KB header is added to the HPACK table once, then referenced ``references`` times
    (4,000 bytes: the entry must fit the 4,096-byte table to stay in it)."""
    head = attacker.block(request_headers() + [(b"x-big", b"b" * 4000)])  # the encoder indexes it: newest entry
    return head + b"\xbe" * references  # 0xbe: dynamic index 62, the newest entry


def test_hpack_bomb_is_refused_at_the_frame_header(gateway: GatewayThread, triton: LocalTriton) -> None:
    """One 4 KB header referenced 100,000 times (a 100 KB block, a 400 MB header list): refused
    by its size before a byte of it is decoded, spread over CONTINUATION frames or not."""
    with watch(gateway, triton, rss_bound_mb=32):
        for split in (False, True):
            attacker = Attacker(gateway.settings.grpc_port)
            block = bomb(attacker, 100_000)
            if split:
                pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)]
                data = frame(HEADERS, END_STREAM, 1, pieces[0]) + b"".join(
                    frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, 1, piece)
                    for i, piece in enumerate(pieces[1:], 1))
            else:
                data = frame(HEADERS, END_STREAM | END_HEADERS, 1, block)
            attacker.send(data)
            assert attacker.goaway().code == ENHANCE_YOUR_CALM
            attacker.close()


def test_a_header_list_past_the_limit_is_never_built(gateway: GatewayThread, triton: LocalTriton) -> None:
    """A 5 KB block that decodes to 4 MB of headers: answered RESOURCE_EXHAUSTED on its stream,
    and the connection (its HPACK table in step) serves the next request."""
    with watch(gateway, triton, rss_bound_mb=32, completed=[1]):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(frame(HEADERS, END_STREAM | END_HEADERS, 1, bomb(attacker, 1000)))
        attacker.send(attacker.headers(3, request_headers()) + frame(0, END_STREAM, 3, infer_message()))
        assert attacker.statuses(1, 3) == {1: RESOURCE_EXHAUSTED, 3: 0}, "and the connection still serves requests"
        attacker.close()
