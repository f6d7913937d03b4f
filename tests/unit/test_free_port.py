"""``free_port`` never hands out the same port twice in a row of calls: a gateway's HTTP and
gRPC ports are both chosen before either is bound, and the same one for both fails its start."""

from __future__ import annotations

import random
import socket

import pytest

import gateway.devtools.local_triton as local_triton
from gateway.devtools.local_triton import free_port


def _unused() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ports_handed_out_are_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = _unused(), _unused()
    draws = iter([one, one, one, two])  # the same draw thrice, as random can give
    chooser = random.Random(7)
    monkeypatch.setattr(local_triton, "_ephemeral_range", lambda: (60000, 61000))
    monkeypatch.setattr(random, "randrange", lambda low, high: next(draws, chooser.randrange(low, high)))
    assert (free_port(), free_port()) == (one, two)
    many = [free_port() for _ in range(500)]
    assert len(set(many)) == len(many)
