"""A client's ModelStreamInfer streams on Triton, open or left, are bounded (``grpc.client_streams``).

A stream whose client cancels is never reset on Triton (resets crash Triton 2.51): Triton
answers what it was sent. Before the bound, a client could open a stream asking a decoupled
model for a long generation, cancel it and open the next, without limit: every one kept running
on Triton while the client's own connection limits counted none. Checked with the bound's check
disabled: the third stream opened and each test failed on it. (A first version counted only left
streams, from when they were left: a burst opened before any was left passed whole.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings, tokens_request, wait_for

pytestmark = pytest.mark.triton
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def stream(channel: grpc.Channel, count: int, delay_ms: int, leave_after: int | None) -> int:
    """Replies read of a stream asking for ``count`` tokens; cancelled after ``leave_after`` of them."""
    done = threading.Event()

    def requests() -> Iterator[bytes]:
        yield tokens_request(count, delay_ms)
        done.wait(30)

    replies = channel.stream_stream(STREAM_INFER)(requests(), timeout=30)
    read = 0
    try:
        for reply in replies:
            response = service_pb2.ModelStreamInferResponse.FromString(reply)
            assert not response.error_message, response.error_message
            read += 1
            if read == leave_after or read == count:
                break
    finally:
        replies.cancel()
        done.set()
    return read


def refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refusal:
        stream(channel, 2, 0, leave_after=None)
    assert refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.value
    assert "grpc_max_streams_per_client is 2" in (refusal.value.details() or "")
    return refusal.value


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_client_at_its_bound_waits_for_triton_to_end_a_stream_it_left(triton: LocalTriton, grpc_server: str) -> None:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=grpc_server,
                                grpc_max_streams_per_client=2)
    with GatewayThread(settings) as gw, grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
        assert gw.app.grpc_router is not None
        counts = gw.app.grpc_router.streams.counts
        for _ in range(2):  # 40 tokens 50 ms apart: each runs ~2 s on Triton after its client left
            assert stream(channel, 40, 50, leave_after=1) == 1
        assert sum(counts.values()) == 2  # left, still running on Triton
        refused(channel)
        # Triton ends them (their requests were ended, never reset): the count goes with them
        wait_for(lambda: not counts, 30, what="Triton ending the left streams")
        assert stream(channel, 2, 0, leave_after=None) == 2
        wait_for(lambda: not counts, 30, what="the last stream's end on Triton")  # read whole, then closed


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_burst_of_streams_opened_at_once_and_then_left_is_held_to_the_bound(triton: LocalTriton,
                                                                              grpc_server: str) -> None:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=grpc_server,
                                grpc_max_streams_per_client=2)
    with GatewayThread(settings) as gw, grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
        assert gw.app.grpc_router is not None
        counts = gw.app.grpc_router.streams.counts
        with ThreadPoolExecutor(6) as pool:  # six at once, each left after its first reply
            outcomes = list(pool.map(lambda _: _attempt(channel), range(6)))
        assert sorted(outcomes) == ["left"] * 2 + ["refused"] * 4, outcomes
        assert sum(counts.values()) <= 2
        wait_for(lambda: not counts, 30, what="Triton ending the left streams")


def _attempt(channel: grpc.Channel) -> str:
    try:
        stream(channel, 40, 50, leave_after=1)
        return "left"
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return "refused"
