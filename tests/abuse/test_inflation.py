"""A gzip bomb holds what it pays for: besides the size bound, a compressed body or gRPC message
inflates to at most ``max_inflation_ratio`` times its size (issue 32: a 199 KiB gzip body held
64 MiB of the shared budget before its 413, so two a second kept the budget full for everyone)."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator

import pytest

from gateway.byte_budget import ByteBudget
from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import Attacker, frame, request_headers, watch
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
MB = 1 << 20
RESOURCE_EXHAUSTED = 8
BOMB = gzip.compress(b"\0" * (200 * MB), 9)  # ~199 KiB on the wire


@pytest.fixture
def peak_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The most any gateway's budget held at once, seen at every charge (not sampled)."""
    peak = [0]
    take, try_take = ByteBudget.take, ByteBudget.try_take

    def counted_take(self: ByteBudget, size: int) -> None:
        take(self, size)
        peak[0] = max(peak[0], self.held)

    def counted_try_take(self: ByteBudget, size: int) -> bool:
        taken = try_take(self, size)
        peak[0] = max(peak[0], self.held)
        return taken

    monkeypatch.setattr(ByteBudget, "take", counted_take)
    monkeypatch.setattr(ByteBudget, "try_take", counted_try_take)
    yield peak


def test_a_grpc_bomb_holds_at_most_its_ratio(gateway: GatewayThread, triton: LocalTriton,
                                            peak_held: list[int]) -> None:
    limit = 100 * len(BOMB)  # the default max_inflation_ratio
    with watch(gateway, triton, rss_bound_mb=64):
        attacker = Attacker(gateway.settings.grpc_port)
        message = b"\x01" + len(BOMB).to_bytes(4, "big") + BOMB
        attacker.send(attacker.headers(1, request_headers(extra=[(b"grpc-encoding", b"gzip")])))
        for at in range(0, len(message), 16 << 10):
            attacker.send(frame(0, 1 if at + (16 << 10) >= len(message) else 0, 1, message[at:at + (16 << 10)]))
        assert attacker.statuses(1, until=10) == {1: RESOURCE_EXHAUSTED}
        attacker.close()
    assert peak_held[0] <= limit + len(message) + (1 << 10), f"{peak_held[0] / MB:.1f} MiB held"


def test_an_http_bomb_is_refused_at_its_ratio(triton: LocalTriton, peak_held: list[int]) -> None:
    """Sequence affinity makes the gateway read the body's JSON header, inflating it."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}, "sequence_affinity": True}})
    limit = 100 * len(BOMB)
    with GatewayThread(settings) as gateway, watch(gateway, triton, rss_bound_mb=64):
        sock = socket.create_connection(("127.0.0.1", settings.port), timeout=10)
        sock.sendall(b"POST /v2/models/qc/infer HTTP/1.1\r\nhost: gw\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(BOMB), BOMB))
        answer = sock.recv(1 << 16)
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
    assert (f"decompresses to more than the limit of {limit} bytes (100 times its {len(BOMB)} bytes: "
            "max_inflation_ratio)").encode() in answer, answer
    assert peak_held[0] <= len(BOMB) + (1 << 10), f"{peak_held[0] / MB:.1f} MiB held"


def test_small_compressed_bodies_inflate_past_the_ratio() -> None:
    """Below 64 KiB the ratio is not looked at: 1,000 JSON zeros compress 100:1 and more."""
    from gateway.byte_budget import INFLATION_FLOOR, inflation_limit

    assert inflation_limit(40, 64 * MB, 100) == INFLATION_FLOOR == 64 << 10
    assert inflation_limit(len(BOMB), 64 * MB, 100) == 100 * len(BOMB)
    assert inflation_limit(len(BOMB), 64 * MB, 1000) == 64 * MB
