"""A stub Triton for measuring the gateway alone: a fixed KServe-v2 answer over HTTP and gRPC.

The one permitted fake upstream (it stands in for nothing the tests check): it does no
inference, so a benchmark's CPU and latency are the gateway's. HTTP/1.1 keep-alive on an
asyncio protocol with httptools; gRPC with grpcio's generic handler. It answers what the
gateway asks of a Triton: health, the repository index (model ``qc``, versions 1-3 READY;
``--models N``: ``qc`` and ``m00001`` ... up to N models, each with versions 1-3 READY), each
version's readiness, and inference on any model and version with one fixed response.

What the gateway asked is counted by kind (``GET /stub/counts``: repository index reads,
readiness and config reads, loads, inferences, the rest), so a benchmark can say how many
repository reads a tick costs at a given size.

    python bench/stub_triton.py --http-port 18500 --grpc-port 18501 --models 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

import httptools

VERSIONS = ("1", "2", "3")


def model_names(count: int) -> list[str]:
    """``qc`` (the sample repository's model) first, then ``m00001``...: ``count`` names in all."""
    return ["qc", *(f"m{i:05d}" for i in range(1, count))]


def repository_index(count: int) -> bytes:
    return json.dumps([{"name": name, "version": v, "state": "READY"}
                       for name in model_names(count) for v in VERSIONS]).encode()


INDEX = repository_index(1)
KNOWN: frozenset[bytes] = frozenset((b"qc",))
COUNTS: dict[str, int] = {}


def _infer_answer(version: bytes) -> bytes:
    return json.dumps({"model_name": "qc", "model_version": version.decode() or "2", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4], "data": [2.0, 4.0, 6.0, 8.0]}]}).encode()


ANSWERS = {version: _infer_answer(version) for version in (b"", b"1", b"2", b"3")}


def _response(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: " + \
        str(len(body)).encode() + b"\r\n\r\n" + body


class StubHttp(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        if path.endswith(b"/infer"):
            parts = path.split(b"/")
            version = parts[parts.index(b"versions") + 1] if b"versions" in parts else b""
            body = ANSWERS.get(version) or _infer_answer(version)
            self.transport.write(_response(b"200 OK", body))
            _count("infer")
        elif path == b"/v2/repository/index":
            self.transport.write(_response(b"200 OK", INDEX))
            _count("index")
        elif path.endswith(b"/ready") and path.startswith(b"/v2/models/"):
            self.transport.write(_ready(path))
            _count("ready")
        elif path == b"/stub/counts":
            self.transport.write(_response(b"200 OK", json.dumps(COUNTS).encode()))
        else:
            self.transport.write(_response(b"200 OK", b"{}"))
            _count("config" if path.endswith(b"/config") else "load" if path.endswith(b"/load") else "other")


def _count(kind: str) -> None:
    COUNTS[kind] = COUNTS.get(kind, 0) + 1


def _ready(path: bytes) -> bytes:
    """``/v2/models/{m}[/versions/{v}]/ready``: 200 for a listed model (and version), else 400 as Triton answers."""
    parts = path.split(b"/")
    known = parts[3] in KNOWN and (len(parts) < 7 or parts[4] != b"versions" or parts[5].decode() in VERSIONS)
    if known:
        return _response(b"200 OK", b"")
    return _response(b"400 Bad Request", b'{"error":"model is not ready"}')


def _grpc_server(port: int) -> object:
    import grpc
    from tritonclient.grpc import service_pb2

    def answer(version: str) -> bytes:
        reply = service_pb2.ModelInferResponse(model_name="qc", model_version=version or "2")
        output = reply.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 4])
        del output
        reply.raw_output_contents.append(bytes(16))
        return bytes(reply.SerializeToString())

    def infer(request: bytes, context: object) -> bytes:
        message = service_pb2.ModelInferRequest()
        message.ParseFromString(request)
        return answer(message.model_version)

    def empty(request: bytes, context: object) -> bytes:
        return b""

    def ready(request: bytes, context: object) -> bytes:
        return bytes(service_pb2.ServerReadyResponse(ready=True).SerializeToString())

    methods = {"ModelInfer": infer, "ServerReady": ready, "ServerLive": empty, "ModelReady": ready}

    class Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            method = str(details.method).rsplit("/", 1)[-1]
            handler = methods.get(method, empty)
            return grpc.unary_unary_rpc_method_handler(handler)

    from concurrent.futures import ThreadPoolExecutor

    # no message size bound: the gateway's body sweeps send 8 MB tensors (grpcio refuses past 4 MB)
    server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", -1)])
    server.add_generic_rpc_handlers((Handler(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


async def serve(http_port: int, grpc_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StubHttp, "127.0.0.1", http_port, backlog=1024)
    grpc_server = _grpc_server(grpc_port) if grpc_port else None
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub triton on http://127.0.0.1:{http_port}, gRPC 127.0.0.1:{grpc_port}", flush=True)
    await stop.wait()
    server.close()
    if grpc_server is not None:
        grpc_server.stop(0)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-port", type=int, default=18500)
    parser.add_argument("--grpc-port", type=int, default=0, help="0: no gRPC")
    parser.add_argument("--models", type=int, default=1, help="models in the repository index (qc, m00001, ...)")
    args = parser.parse_args()
    global INDEX, KNOWN
    INDEX = repository_index(args.models)
    KNOWN = frozenset(name.encode() for name in model_names(args.models))
    import uvloop

    uvloop.run(serve(args.http_port, args.grpc_port))


if __name__ == "__main__":
    main()
