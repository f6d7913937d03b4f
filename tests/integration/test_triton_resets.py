"""No client can take Triton down through the gateway by cancelling its calls.

Triton 2.51 (the nvidia-pytriton wheel's) segfaults or aborts when a gRPC call is reset at the
wrong moment (triton-inference-server/server#8034): measured against the sample models, streams
cancelled between a decoupled model's replies killed it within 5-540 streams, sent straight to it
or through the gateway, which passed its clients' resets on (one worker's session Triton died
under the parallel suite, and 47 tests after it failed on "connection refused"). The gateway now
leaves such calls to finish upstream (``grpc.upstream``). Each front has a Triton of its own: on
the old code it dies. Checked by running this module with gateway/ checked out from the commit
before the fix: through the lean front Triton died within 32-414 streams in 10 of 10 runs
(SIGSEGV or SIGABRT); through the grpcio front, whose cancels reach the gateway later (mostly
after Triton's last reply, when there is nothing left to reset), within 600 in about 2 runs of 5
and within 3,000 in 8 of 10, so its 600 here guard the path rather than prove the crash every
time. 600 streams take 2-3 s on the fixed code (each front's Triton ~4 s to start).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings, tokens_request

pytestmark = pytest.mark.triton
STREAMS = 600
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def cancelled_between_replies(channel: grpc.Channel) -> None:
    """A stream asking for 4 tokens, cancelled by its client after the first."""
    opened = threading.Event()

    def requests() -> Iterator[bytes]:
        yield tokens_request(4)
        opened.wait(20)

    replies = channel.stream_stream(STREAM_INFER)(requests(), timeout=20)
    try:
        for count, _ in enumerate(replies, 1):
            if count == 1:
                break
    finally:
        replies.cancel()
        opened.set()


@pytest.mark.parametrize("grpc_server", ["lean", "grpcio"])
def test_streams_cancelled_between_replies_leave_triton_running(grpc_server: str) -> None:
    with LocalTriton.on_free_ports(models=("tok",)) as triton:
        settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=grpc_server)
        with GatewayThread(settings), grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            for done in range(STREAMS):
                try:
                    cancelled_between_replies(channel)
                except grpc.RpcError as exc:
                    raise AssertionError(f"stream {done + 1}: {exc.code().name} {exc.details()}; Triton's exit "
                                         f"status: {triton.returncode}") from None
                assert triton.returncode is None, f"Triton died ({triton.returncode}) after {done + 1} streams"
        assert triton.is_ready()
