"""Tools for the abuse suite: a raw HTTP/2 attacker, a bystander client, and the four checks.

Every attack test runs inside ``watch()``, which asserts what issue 12 asks of each attack:
the gateway's RSS stays within a stated bound (the gateway runs in this process, in a thread,
so this process's VmRSS is the gateway's plus the test's), another client is served within
1 s throughout (``/healthz`` over HTTP and a ModelInfer over gRPC, on their own connections),
and Triton's request count rises by no more than the streams the attacker completed (plus
the bystander's own inferences).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import hpack
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.server_connection import GrpcServerConnection
from tests.support import INFER_BODY, GatewayThread

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x5, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB
INFER_PATH = b"/inference.GRPCInferenceService/ModelInfer"
MB = 1 << 20


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


Header = tuple[bytes, bytes]


def request_headers(path: bytes = INFER_PATH, extra: list[Header] | None = None) -> list[Header]:
    return [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"gateway"),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"), *(extra or [])]


def infer_message() -> bytes:
    """A valid ModelInferRequest for the sample model ``qc``, gRPC-framed."""
    message = service_pb2.ModelInferRequest(model_name="qc")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    message.raw_input_contents.append(np.ones(4, dtype=np.float32).tobytes())
    raw: bytes = message.SerializeToString()
    return b"\x00" + len(raw).to_bytes(4, "big") + raw


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def code(self) -> int:
        """The error code of a RST_STREAM or GOAWAY."""
        return int.from_bytes(self.payload[:4] if self.kind == RST_STREAM else self.payload[4:8], "big")


class Attacker:
    """A raw HTTP/2 client over a plain socket: it sends what it likes and reads what comes back.
    Every one still open when its test ends is closed by the package's ``close_attackers`` fixture,
    so a failed assertion does not leak a socket into the next test's warnings."""

    live: set[Attacker] = set()

    def __init__(self, port: int, preface: bool = True, timeout: float = 5.0, source: str | None = None) -> None:
        """``source``: another loopback address to connect from (another client, to the gateway)."""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=None if source is None else (source, 0))
        Attacker.live.add(self)
        self.encoder = hpack.Encoder()
        self.received = bytearray()
        self.closed = False
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes) -> bool:
        """False once the gateway has closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def block(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        return bytes(self.encoder.encode(headers))

    def headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool = False) -> bytes:
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, self.block(headers))

    def frames(self, until: float = 3.0, stop: int | None = GOAWAY,
               done: Callable[[list[Frame]], bool] | None = None) -> list[Frame]:
        """Frames read until the connection closes, a frame of type ``stop`` arrives, ``done`` says
        so, or ``until`` s pass."""
        deadline = time.monotonic() + until
        while not self.closed and time.monotonic() < deadline:
            frames = parse(self.received)
            if stop is not None and any(f.kind == stop for f in frames) or done is not None and done(frames):
                break
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.received += chunk
        return parse(self.received)

    def statuses(self, *stream_ids: int, until: float = 3.0) -> dict[int, int | None]:
        """The grpc-status of each stream's answer, read until all are in."""
        frames = self.frames(until, done=lambda frames: all(grpc_status(frames, s) is not None for s in stream_ids))
        return {stream_id: grpc_status(frames, stream_id) for stream_id in stream_ids}

    def goaway(self, until: float = 3.0) -> Frame:
        frames = [f for f in self.frames(until) if f.kind == GOAWAY]
        assert frames, f"no GOAWAY; got {[f.kind for f in parse(self.received)]}"
        return frames[0]

    def resets(self, until: float = 3.0, stop: int | None = GOAWAY) -> dict[int, int]:
        return {f.stream_id: f.code for f in self.frames(until, stop) if f.kind == RST_STREAM}

    def close(self) -> None:
        self.sock.close()
        Attacker.live.discard(self)



def server_side(gateway: GatewayThread, attacker: Attacker) -> GrpcServerConnection | None:
    """The gateway's side of the attacker's gRPC connection, while the gateway counts it open."""
    port = attacker.sock.getsockname()[1]

    async def find() -> GrpcServerConnection | None:
        connections: set[GrpcServerConnection] = gateway.app.grpc_server.front.connections
        return next((c for c in connections
                     if c.transport is not None and c.transport.get_extra_info("peername")[1] == port), None)

    found: GrpcServerConnection | None = gateway.call(find())
    return found


def open_connections(gateway: GatewayThread) -> int:
    """The gRPC client connections the gateway counts open (against grpc_max_connections)."""
    async def count() -> int:
        return len(gateway.app.grpc_server.front.connections)

    counted: int = gateway.call(count())
    return counted

def parse(data: bytes | bytearray) -> list[Frame]:
    """Whole frames from the server (the first is its SETTINGS)."""
    frames, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos:pos + 3], "big")
        if len(data) - pos - 9 < length:
            break
        frames.append(Frame(data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                            bytes(data[pos + 9:pos + 9 + length])))
        pos += 9 + length
    return frames


def grpc_status(frames: list[Frame], stream_id: int) -> int | None:
    """The grpc-status of the stream's response (a trailers-only or trailing HEADERS), read with a
    fresh HPACK decoder per test connection."""
    decoder = hpack.Decoder()
    status = None
    for f in frames:
        if f.kind == HEADERS:
            for name, value in decoder.decode(f.payload, raw=True):
                if name == b"grpc-status" and f.stream_id == stream_id:
                    status = int(value)
    return status


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def triton_requests(triton: LocalTriton) -> int:
    """Inferences Triton has seen for ``qc`` (all versions), success or failure."""
    return sum(model["inference_stats"]["success"]["count"] + model["inference_stats"]["fail"]["count"]
               for model in _qc_stats(triton))


def _qc_stats(triton: LocalTriton) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{triton.http_url}/v2/models/qc/stats", timeout=5) as response:
        stats: list[dict[str, Any]] = json.loads(response.read())["model_stats"]
    return stats


def drain_qc(triton: LocalTriton) -> int:
    """Returns once Triton has answered every ``qc`` request it was sent before: one request to
    each version it counts, straight to it, answered after those (each version runs one request
    at a time, in order: one instance, no batcher). The number sent. Triton counts a request when
    it has answered it, and one whose client went away (an earlier example's cut, a call left to
    finish there: ``grpc.upstream``) still runs: read while it ran, a count was charged to the
    next test ("Triton saw 3 requests from the attacker, who completed 0"; a count waited for
    until it stopped moving missed a request that slept in an earlier test's fault delay)."""
    versions = [model["version"] for model in _qc_stats(triton)]
    for version in versions:
        request = urllib.request.Request(f"{triton.http_url}/v2/models/qc/versions/{version}/infer",
                                         data=INFER_BODY, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
        except urllib.error.HTTPError:
            pass  # an injected error, or the version going away: answered after the others all the same
    return len(versions)


def settled_triton_requests(triton: LocalTriton, still_s: float = 0.1) -> int:
    """``triton_requests`` once Triton has answered every ``qc`` request sent to it before
    (``drain_qc``: its probes are in the count) and the count stopped moving for ``still_s``."""
    drain_qc(triton)
    return still_triton_requests(triton, still_s)


def still_triton_requests(triton: LocalTriton, still_s: float = 0.1, within_s: float = 5.0) -> int:
    """``triton_requests`` once it has not moved for ``still_s``: after ``drain_qc``, for a
    request Triton's HTTP threads were still reading as the probes went out."""
    count, ends = triton_requests(triton), time.monotonic() + within_s
    while time.monotonic() < ends:
        time.sleep(still_s)
        if (again := triton_requests(triton)) == count:
            return count
        count = again
    raise AssertionError(f"Triton's count of qc requests was still moving after {within_s} s: "
                         "something else sends to qc during the test")


@dataclass
class Bystander:
    """Another client, served all along: /healthz and a gRPC ModelInfer every ~50 ms (a
    ModelMetadata instead with ``metadata_only``: then Triton's inference count is the test's alone)."""

    gateway: GatewayThread
    metadata_only: bool = False
    inferences: int = 0
    served: int = 0
    slowest: float = 0.0
    failures: list[str] = field(default_factory=list)
    peak_rss: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.gateway.settings.grpc_port}")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest.FromString(infer_message()[5:])
        metadata = service_pb2.ModelMetadataRequest(name="qc")
        while not self._stop.is_set():
            for probe in ("healthz", "infer"):
                started = time.monotonic()
                try:
                    if probe == "healthz":
                        with urllib.request.urlopen(f"{self.gateway.url}/healthz", timeout=2) as response:
                            response.read()
                    elif self.metadata_only:
                        stub.ModelMetadata(metadata, timeout=2)
                    else:
                        self.inferences += 1
                        stub.ModelInfer(request, timeout=2)
                    self.served += 1
                except Exception as exc:  # recorded: the test asserts there were none
                    self.failures.append(f"{probe}: {exc!r}"[:300])
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.peak_rss = max(self.peak_rss, rss_mb())
            self._stop.wait(0.05)
        channel.close()


@contextmanager
def watch(gateway: GatewayThread, triton: LocalTriton, rss_bound_mb: float, completed: list[int] | None = None
          ) -> Iterator[Bystander]:
    """The four checks around an attack. ``completed``: a one-element list the test sets to the
    number of request streams the attacker completed (END_STREAM with a whole message)."""
    before_rss, before_requests = rss_mb(), settled_triton_requests(triton)
    bystander = Bystander(gateway, peak_rss=before_rss)
    thread = threading.Thread(target=bystander.run, daemon=True)
    thread.start()
    try:
        yield bystander
    finally:
        time.sleep(0.2)  # at least a few probes while the attack's aftermath settles
        bystander._stop.set()
        thread.join(10)
    probes = drain_qc(triton)  # the attack's requests that reached Triton are all counted now
    after_requests = still_triton_requests(triton) - probes
    grown = max(bystander.peak_rss, rss_mb()) - before_rss
    assert grown <= rss_bound_mb, f"RSS grew by {grown:.0f} MB (bound {rss_bound_mb} MB)"
    assert bystander.served >= 2 and not bystander.failures, bystander.failures[:3]
    assert bystander.slowest <= 1.0, f"the other client waited {bystander.slowest:.2f} s"
    extra = after_requests - before_requests - bystander.inferences
    allowed = completed[0] if completed else 0
    assert extra <= allowed, f"Triton saw {extra} requests from the attacker, who completed {allowed}"


def varint(value: int) -> bytes:
    """A protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
