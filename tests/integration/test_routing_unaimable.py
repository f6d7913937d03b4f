"""What a client can learn about, or do to, the split (issue 23, against the real Triton): a
shadow does not move it, and answers need not say which version served them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, drive, gateway_settings

pytestmark = pytest.mark.triton
REQUESTS = 10_000


@pytest.mark.parametrize("shadow", ["2", "3"])
def test_a_shadow_on_either_version_leaves_the_split_as_configured(triton: LocalTriton, shadow: str) -> None:
    """Sequential clients, 50/50, half the requests mirrored: each version within 0.5 points of
    50%. Before the shadow gate had its own sequence, a shadow on the canary gave 61.8/38.2."""
    settings = gateway_settings(triton.http_url, policies={
        "qc": {"weights": {"2": 50, "3": 50}, "shadow": {"version": shadow, "percent": 50}}})
    with GatewayThread(settings) as gw:
        result = asyncio.run(drive(gw.url, REQUESTS, concurrency=1))
        stats = gw.app.recorder.shadow_stats("qc", shadow)
        mirrored = stats.requests + stats.dropped
    assert result.statuses[200] == REQUESTS, result.failures[:3]
    shares = {version: 100 * count / REQUESTS for version, count in result.versions.items()}
    assert abs(shares["2"] - 50) <= 0.5 and abs(shares["3"] - 50) <= 0.5, shares
    # the shadow really ran beside the split: about half of the other version's 5,000 answers
    assert 2_000 <= mirrored <= 3_000, mirrored


def _grpc_metadata(port: int) -> dict[str, str]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="qc")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.array([[1, 2, 3, 4]], dtype=np.float32).tobytes())
        response, call = stub.ModelInfer.with_call(request, timeout=10)
        assert response.model_version in ("2", "3")
        return {key: value for key, value in call.initial_metadata()}
    finally:
        channel.close()


@pytest.fixture(params=[True, False], ids=["exposed", "hidden"])
def exposing_gateway(request: pytest.FixtureRequest, triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                expose_version_headers=request.param,
                                policies={"qc": {"weights": {"2": 50, "3": 50}}})
    with GatewayThread(settings) as gw:
        yield gw


def test_expose_version_headers_controls_both_protocols(exposing_gateway: GatewayThread) -> None:
    import urllib.request

    from tests.support import INFER_BODY

    gw = exposing_gateway
    request = urllib.request.Request(f"{gw.url}/v2/models/qc/infer", data=INFER_BODY, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        http_headers = {name.lower() for name in response.headers.keys()}
    grpc_keys = set(_grpc_metadata(gw.settings.grpc_port))
    routing = {"x-gateway-model-version", "x-gateway-route"}
    if gw.settings.expose_version_headers:
        assert routing <= http_headers and routing <= grpc_keys
    else:
        assert not routing & http_headers and not routing & grpc_keys, (http_headers, grpc_keys)
