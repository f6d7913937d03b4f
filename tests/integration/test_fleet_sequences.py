"""A sequence on a fleet of two real Triton servers stays on one server, however its requests are
framed: the HTTP front reads the sequence fields once (compressed bodies included) and hands them
to the fleet with the request; the fleet no longer parses bodies itself (it read only the first
4 KiB of uncompressed ones, and missed the rest)."""

from __future__ import annotations

import gzip
import json
import time
import urllib.request
import zlib

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.fleet_support import fleet_settings, successes
from tests.support import GatewayThread

pytestmark = pytest.mark.triton
STEPS = 8


def body(sequence_id: int | str, start: bool, end: bool, padding: int) -> bytes:
    """An inference whose sequence fields come after ``padding`` bytes of the JSON header."""
    request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
               "id": "x" * padding,
               "parameters": {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}}
    return json.dumps(request).encode()


def send(url: str, data: bytes, headers: dict[str, str]) -> None:
    request = urllib.request.Request(f"{url}/v2/models/qc/infer", data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize(("framing", "padding"), [("gzip", 0), ("deflate", 0), ("identity", 8192), ("binary", 0)])
def test_a_sequence_stays_on_one_server_however_its_body_is_framed(triton_pair: tuple[LocalTriton, LocalTriton],
                                                                   framing: str, padding: int) -> None:
    """No sequence affinity policy: only the fleet keeps the sequence together. Four sequences of
    eight requests each; every one is served by exactly one of the two servers."""
    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        for sequence in range(4):
            sequence_id = f"{framing}-{sequence}" if sequence % 2 else 9000 + sequence
            before = [successes(server) for server in triton_pair]
            for step in range(STEPS):
                data = body(sequence_id, step == 0, step == STEPS - 1, padding)
                headers = {"content-type": "application/json"}
                if framing == "gzip":
                    data, headers["content-encoding"] = gzip.compress(data), "gzip"
                elif framing == "deflate":
                    data, headers["content-encoding"] = zlib.compress(data), "deflate"
                elif framing == "binary":  # the tensor after the JSON header (Inference-Header-Content-Length)
                    request = json.loads(data)
                    request["inputs"][0].pop("data")
                    request["inputs"][0]["parameters"] = {"binary_data_size": 16}
                    header = json.dumps(request).encode()
                    data = header + bytes(16)
                    headers["inference-header-content-length"] = str(len(header))
                send(gw.url, data, headers)
            deadline = time.monotonic() + 5  # Triton counts a request just after answering it
            while sum(served := [successes(server) - count for server, count in zip(triton_pair, before,
                                                                                     strict=True)]) < STEPS \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sorted(served) == [0, STEPS], (framing, sequence_id, served)


def test_a_grpc_sequence_id_past_the_bound_is_refused_before_the_fleet_pins_it(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """No sequence affinity policy: the fleet reads the id itself, and used to pin any string
    (up to the message size) in its table. Now: INVALID_ARGUMENT past 128 characters."""
    import grpc
    from tritonclient.grpc import service_pb2

    settings = fleet_settings(*triton_pair, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        codes = []
        for sequence_id in ("s" * 128, "s" * 129, "x" * 100_000):
            request = service_pb2.ModelInferRequest(model_name="qc")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(bytes(16))
            request.parameters["sequence_id"].string_param = sequence_id
            request.parameters["sequence_start"].bool_param = True
            try:
                infer(request.SerializeToString(), timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        channel.close()
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT]
        assert len(gw.app.fleets.default.sequences) == 1  # only the id within the bound was pinned
