"""A client's left ModelStreamInfer streams are bounded (``grpc.left_streams``).

A stream whose client cancels is never reset on Triton (resets crash Triton 2.51): Triton
answers what it was sent. Before the bound, a client could open a stream asking a decoupled
model for a long generation, cancel it and open the next, without limit: every one kept running
on Triton while the client's own connection limits counted none. Checked against the code
before the bound: the third stream opened and the test failed on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings, wait_for

pytestmark = pytest.mark.triton
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def tokens_request(count: int, delay_ms: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="tok")
    for name, datatype in (("text_input", "BYTES"), ("max_tokens", "INT32"), ("delay_ms", "INT32")):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend([1])
    request.inputs[0].contents.bytes_contents.append(b"hi")
    request.inputs[1].contents.int_contents.append(count)
    request.inputs[2].contents.int_contents.append(delay_ms)
    encoded: bytes = request.SerializeToString()
    return encoded


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


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_a_client_at_its_left_streams_bound_waits_for_triton_to_end_one(triton: LocalTriton, grpc_server: str) -> None:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=grpc_server,
                                grpc_max_left_streams_per_client=2)
    with GatewayThread(settings) as gw, grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
        assert gw.app.grpc_router is not None
        left = gw.app.grpc_router.left
        for _ in range(2):  # 40 tokens 50 ms apart: each runs ~2 s on Triton after its client left
            assert stream(channel, 40, 50, leave_after=1) == 1
        wait_for(lambda: sum(left.counts.values()) == 2, 10, what="both streams counted as left")
        with pytest.raises(grpc.RpcError) as refused:
            stream(channel, 2, 0, leave_after=None)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "grpc_max_left_streams_per_client is 2" in (refused.value.details() or "")
        # Triton ends them (their requests were ended, never reset): the count goes with them
        wait_for(lambda: not left.counts, 30, what="Triton ending the left streams")
        assert stream(channel, 2, 0, leave_after=None) == 2  # a stream read to its end leaves nothing behind
        assert not left.counts
