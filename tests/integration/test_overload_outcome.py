"""Overload answers are their own outcome, never an error of the version that gave them; Triton's
full queue is the version's capacity (rejected), judged apart from its errors (issue 34)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.integration.test_http_failures import GarbageServer
from tests.support import INFER_BODY, GatewayThread, gateway_settings


def answer(status: str, error: str) -> bytes:
    body = json.dumps({"error": error}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


@pytest.fixture(params=[
    ("429 Too Many Requests", "slow down", "overload"),
    ("503 Service Unavailable", "Exceeds maximum queue size", "rejected"),
    ("503 Service Unavailable", "Request timeout expired", "rejected"),
    ("503 Service Unavailable", "Request for unknown model: 'qc' version 3 is not at ready state", "error"),
])
def upstream(request: pytest.FixtureRequest) -> Iterator[tuple[GarbageServer, str]]:
    """A fake upstream: a real Triton never answers 429 (and its queue-full and queue-timeout 503s
    are tested against the real Triton with the sample model ``batched``)."""
    status, error, expected = request.param
    server = GarbageServer(answer(status, error))
    yield server, expected
    server.close()


def test_overload_is_counted_apart_and_not_against_the_version(upstream: tuple[GarbageServer, str]) -> None:
    server, expected = upstream
    settings = gateway_settings(f"http://127.0.0.1:{server.port}", policies={"qc": {"weights": {"3": 100}}})
    with GatewayThread(settings) as gw:  # routed by the policy: a version in the URL is never judged
        request = urllib.request.Request(f"{gw.url}/v2/models/qc/infer", data=INFER_BODY, method="POST")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=10)
        window = gw.app.recorder.window("qc", "3", 10)
    if expected == "overload":
        assert (window.overloads, window.rejected, window.errors, window.requests) == (1, 0, 0, 0)
    elif expected == "rejected":
        assert (window.overloads, window.rejected, window.errors, window.requests) == (0, 1, 0, 0)
    else:
        assert (window.overloads, window.rejected, window.errors, window.requests) == (0, 0, 1, 1)
