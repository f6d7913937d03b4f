"""Helpers for the fleet tests: per-server Triton statistics, a lean gRPC load generator, fleet settings."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from typing import Any

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.upstream import GrpcUpstream
from gateway.settings import Settings
from tests.support import TOKEN, gateway_settings, paced

INFER = "/inference.GRPCInferenceService/ModelInfer"


def fleet_settings(*servers: LocalTriton, **values: Any) -> Settings:
    fleet = {"servers": [{"http": s.http_url, "grpc": s.grpc_url} for s in servers]}
    values.setdefault("fleets", {"default": fleet})
    return gateway_settings(servers[0].http_url, triton_grpc_url=servers[0].grpc_url, admin_token=TOKEN, **values)


def successes(server: LocalTriton, model: str = "qc", version: str = "") -> int:
    """Inferences this Triton server ran (its own statistics), of one version or of all."""
    path = f"/v2/models/{model}/versions/{version}/stats" if version else f"/v2/models/{model}/stats"
    with urllib.request.urlopen(f"{server.http_url}{path}", timeout=5) as response:
        stats = json.loads(response.read())
    return sum(int(entry["inference_stats"]["success"]["count"]) for entry in stats["model_stats"])


def ready_versions(server: LocalTriton, model: str = "qc") -> set[str]:
    request = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        index = json.loads(response.read())
    return {e["version"] for e in index if e["name"] == model and e.get("state") == "READY"}


def infer_message(model: str = "qc", version: str = "") -> bytes:
    import numpy as np
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "FP32"
    tensor.shape.extend([1, 4])
    request.raw_input_contents.append(np.array([[1, 2, 3, 4]], dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


async def drive_grpc(address: str, requests: int, *, concurrency: int = 16, message: bytes | None = None,
                     metadata: tuple[tuple[str, str], ...] = (), rate: float = 0.0) -> Counter[int]:
    """Send ``requests`` ModelInfer calls (paced at ``rate`` per second when given); count gRPC
    status codes. Our own lean HTTP/2 client (tritonclient's would cost more CPU than the gateway
    under test on these 2 cores)."""
    client = GrpcUpstream(address)
    body = message or infer_message()
    codes: Counter[int] = Counter()
    counter = iter(range(requests))
    start = asyncio.get_running_loop().time()

    async def worker() -> None:
        for index in counter:
            if rate:
                await paced(start, index, rate)
            code, _details, _ = await client.unary(INFER, body, metadata, 30.0)
            codes[code] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return codes
