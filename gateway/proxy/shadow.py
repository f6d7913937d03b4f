"""Shadow traffic: mirror a share of a model's requests to a version that serves nobody yet.

The client's response never waits on the shadow: a mirrored request is offered to a
bounded queue after the primary response was handed to the server, and dropped (and
counted) when the queue is full. One worker sends shadows to Triton and compares each
answer with the primary's: same output names, shapes and datatypes, numbers within a
tolerance. Per (model, shadow version) it keeps agreement, errors and latency, which the
rollout status and ``/metrics`` show, so an SRE can judge a version before it takes real
traffic.

This is the pipeline's shadow port (``pipeline.Shadow``): the pipeline offers the copies its
exchanges make (``pipeline.ShadowCopy``: a :class:`Mirror` from the HTTP front, a
:class:`GrpcMirror` from the gRPC one) and knows nothing of this module.

A copy goes to the shadow's own fleet (a policy's ``"shadow": {"version": "green:3"}``: version
3 on fleet green), on both protocols; its statistics are kept under the name the policy gives
it (``green:3``), which is what the rollout's shadow gate reads.

A copy of a request in a sequence is sent without its sequence fields to the fleet, on both
protocols: the fleet's pin of a sequence is the primary's (the server that holds its state),
and a copy must never make or move it. A gRPC copy carried them once, and on a fleet of
several servers the copy of a start re-pinned the sequence to the server picked for the copy,
so its next request failed there ("must specify the START flag"). A copy goes wherever the
balancer picks for the shadow version; the shadow version's own sequence state is therefore
not kept on one server, and with a percent below 100 a copy of a continuation seldom follows a
copy of its start: for a sequence model the shadow's error count says little.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from gateway.background import Background
from gateway.byte_budget import ByteBudget
from gateway.errors import GatewayError, PayloadTooLarge, UpstreamUnavailable
from gateway.grpc.status import FAULTS, StatusCode
from gateway.grpc.upstream import GrpcUpstream, Metadata
from gateway.pipeline import ShadowCopy
from gateway.proxy.limits import MIB, inflate
from gateway.telemetry.recorder import LATENCY_BOUNDS, Recorder, ShadowStats
from gateway.upstream import Body, HttpUpstream

REL_TOLERANCE = 1e-3
SHADOW_TIMEOUT_S = 30.0
SHADOW_MAX_BODY = 64 * MIB  # the most a compared response is inflated to
Outputs = dict[str, tuple[str, tuple[int, ...], Any]]  # name -> (datatype, shape, data)
ABS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Mirror:
    model: str
    version: str | None  # None: Triton's default version of a renamed target's model
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: Body  # the request's, as it was held (a large one: the bytearray it was read into)
    primary_status: int
    primary_body: bytes
    primary_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # its framing: encoding, IHCL
    fleet: str | None = None  # the shadow's fleet ("green:3"); None: the default fleet
    key: str = ""  # the shadow as its policy names it ("green:3", "qc_2026_12@2")
    answering: str | None = None  # a renamed shadow's model (the request's path names it already)

    @property
    def label(self) -> str:
        """The shadow as its policy names it (``green:3``): its statistics' key, as the rollout reads them."""
        return self.key or (f"{self.version}" if self.fleet is None else f"{self.fleet}:{self.version}")


@dataclass(frozen=True)
class GrpcMirror:
    """A routed gRPC ``ModelInfer``: the request already names the shadow version. ``upstream``:
    the shadow's fleet (None: a fleet this gateway does not have, counted as an error)."""

    model: str
    version: str | None
    upstream: GrpcUpstream | None
    path: str
    message: bytes
    metadata: Metadata
    primary: bytes  # the primary's ModelInferResponse
    fleet: str | None = None
    key: str = ""
    answering: str | None = None  # a renamed shadow's model (the message names it already)

    @property
    def label(self) -> str:
        return self.key or (f"{self.version}" if self.fleet is None else f"{self.fleet}:{self.version}")


def held_bytes(mirror: Mirror | GrpcMirror) -> int:
    """What a queued mirror keeps in memory: the request and the primary's answer."""
    if isinstance(mirror, GrpcMirror):
        return len(mirror.message) + len(mirror.primary)
    return len(mirror.body) + len(mirror.primary_body)


class ShadowMirror:
    """``budget``: the gateway's one budget of bytes held for requests (``proxy.limits``). A
    mirror is charged from the offer until its worker is done with it, and dropped (counted)
    when it does not fit, so the queue's copies never hold more than the requests may."""

    def __init__(self, upstream: HttpUpstream, recorder: Recorder, max_queue: int = 1000, workers: int = 2,
                 budget: ByteBudget | None = None, fleets: Mapping[str, HttpUpstream] | None = None) -> None:
        self.upstream = upstream  # the default fleet
        self.fleets = dict(fleets or {})  # named fleets, for HTTP shadows such as "green:3"
        self.recorder = recorder
        self.stats = recorder.shadow  # read-only: the counters live in the recorder, like every metric
        self.budget = budget if budget is not None else ByteBudget(256 * MIB)
        self._queue: asyncio.Queue[Mirror | GrpcMirror] = asyncio.Queue(max_queue)
        self._workers = workers
        self._background = Background()

    def full(self, model: str, version: str) -> bool:
        """True (and the drop counted) when a mirror would not fit: callers build nothing."""
        if self._queue.full():
            self._stats(model, version).dropped += 1
            return True
        return False

    def offer(self, mirror: ShadowCopy) -> None:
        """Never blocks: a full queue, or a budget without room for the copy, drops the mirror and counts it."""
        assert isinstance(mirror, (Mirror, GrpcMirror)), "the fronts' exchanges make these two kinds only"
        size = held_bytes(mirror)
        if self._queue.full() or not self.budget.try_take(size):
            self._stats(mirror.model, mirror.label).dropped += 1
            return
        self._queue.put_nowait(mirror)  # not full: checked above, and nothing ran in between

    def _stats(self, model: str, version: str) -> ShadowStats:
        return self.recorder.shadow_stats(model, version)

    def start(self) -> None:
        for _ in range(self._workers):
            self._background.spawn(self._work())

    async def stop(self) -> None:
        await self._background.cancel_all()
        while not self._queue.empty():  # never sent: their bytes go back to the budget
            self.budget.release(held_bytes(self._queue.get_nowait()))

    async def _work(self) -> None:
        while True:
            mirror = await self._queue.get()
            try:
                await self._send(mirror)
            finally:
                self.budget.release(held_bytes(mirror))

    async def _send(self, mirror: Mirror | GrpcMirror) -> None:
        if isinstance(mirror, GrpcMirror):
            await self._send_grpc(mirror)
            return
        stats = self._stats(mirror.model, mirror.label)
        upstream = self.upstream if mirror.fleet is None else self.fleets.get(mirror.fleet)
        started = time.perf_counter()
        try:
            if upstream is None:
                raise UpstreamUnavailable(f"fleet '{mirror.fleet}' is not configured on this gateway")
            response = await upstream.request(mirror.method, mirror.target, mirror.headers, mirror.body,
                                              model=mirror.answering or mirror.model, version=mirror.version)
            body = await response.read()
        except GatewayError:
            stats.requests += 1
            stats.errors += 1
            return
        latency = time.perf_counter() - started
        stats.requests += 1
        stats.latency_sum += latency
        stats.histogram[_bucket(latency)] += 1
        if response.status >= 500:
            stats.errors += 1
            return
        if response.status == 200 and mirror.primary_status == 200:
            inflating = _inflated_bound(mirror.primary_headers) + _inflated_bound(response.headers)
            if not self.budget.try_take(inflating):
                return  # no room to inflate them now: not compared
            try:
                stats.compared += 1
                primary, shadow = await _decoded(mirror.primary_body, mirror.primary_headers), await _decoded(
                    body, response.headers)
                if primary is not None and shadow is not None:  # each with its own framing (IHCL, encoding)
                    stats.agreed += agree(primary, shadow, _ihcl(mirror.primary_headers), _ihcl(response.headers))
            finally:
                self.budget.release(inflating)


    async def _send_grpc(self, mirror: GrpcMirror) -> None:
        stats = self._stats(mirror.model, mirror.label)
        if mirror.upstream is None:  # a fleet this gateway does not have: never sent to another
            stats.requests += 1
            stats.errors += 1
            return
        started = time.perf_counter()
        code, _, answer = await mirror.upstream.unary(mirror.path, mirror.message, mirror.metadata, SHADOW_TIMEOUT_S,
                                                      model=mirror.answering or mirror.model, version=mirror.version)
        latency = time.perf_counter() - started
        stats.requests += 1
        stats.latency_sum += latency
        stats.histogram[_bucket(latency)] += 1
        if code in FAULTS:
            stats.errors += 1
        elif code == StatusCode.OK:
            stats.compared += 1
            stats.agreed += agree_grpc(mirror.primary, answer)


def _bucket(latency: float) -> int:
    from bisect import bisect_left

    return bisect_left(LATENCY_BOUNDS, latency)


def _inflated_bound(headers: list[tuple[bytes, bytes]]) -> int:
    """The most :func:`_decoded` may inflate this body to (charged while the comparison runs)."""
    for name, value in headers:
        if name.lower() == b"content-encoding" and value.strip().lower() in (b"gzip", b"deflate"):
            return SHADOW_MAX_BODY + 1
    return 0


async def _decoded(body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """A response body without its Content-Encoding (the client may have asked Triton for gzip),
    inflated at most to the body limit, off the event loop: None if it cannot be read within that."""
    for name, value in headers:
        if name.lower() == b"content-encoding":
            try:
                return await asyncio.to_thread(inflate, body, value.strip().lower(), SHADOW_MAX_BODY)
            except (PayloadTooLarge, zlib.error):
                return None
    return body


def _ihcl(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"inference-header-content-length":
            return int(value)
    return None


def _outputs(body: bytes, ihcl: int | None) -> Outputs:
    header = json.loads(body[:ihcl] if ihcl else body)
    out, offset = {}, ihcl or 0
    for output in header.get("outputs", []):
        size = output.get("parameters", {}).get("binary_data_size")
        if size is not None:
            data: Any = body[offset:offset + size]
            offset += size
        else:
            data = output.get("data")
        out[output["name"]] = (output["datatype"], tuple(output["shape"]), data)
    return out


def _grpc_outputs(raw: bytes) -> Outputs:
    from tritonclient.grpc import service_pb2  # off the hot path: only the shadow worker decodes

    response = service_pb2.ModelInferResponse.FromString(raw)
    out = {}
    for index, output in enumerate(response.outputs):
        if index < len(response.raw_output_contents):
            data: Any = response.raw_output_contents[index]
        else:  # typed contents: whichever repeated field is set
            data = [value for _, values in output.contents.ListFields() for value in values]
        out[output.name] = (output.datatype, tuple(output.shape), data)
    return out


def agree(primary: bytes, shadow: bytes, primary_ihcl: int | None = None, shadow_ihcl: int | None = None) -> bool:
    """Same outputs (names, shapes, datatypes) and values within tolerance."""
    try:
        a, b = _outputs(primary, primary_ihcl), _outputs(shadow, shadow_ihcl)
    except (ValueError, KeyError, TypeError):
        return False
    return _same_outputs(a, b)


def agree_grpc(primary: bytes, shadow: bytes) -> bool:
    """``agree`` for two ModelInferResponse messages."""
    try:
        a, b = _grpc_outputs(primary), _grpc_outputs(shadow)
    except (DecodeError, ValueError, TypeError):
        return False
    return _same_outputs(a, b)


def _same_outputs(a: Outputs, b: Outputs) -> bool:
    if a.keys() != b.keys():
        return False
    for name, (dtype, shape, data) in a.items():
        other_dtype, other_shape, other = b[name]
        if (dtype, shape) != (other_dtype, other_shape):
            return False
        if isinstance(data, bytes) or isinstance(other, bytes):
            if not _close_binary(dtype, data, other):
                return False
        elif not _close(data, other):
            return False
    return True


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE)
    return bool(a == b)


def _close_binary(dtype: str, a: Any, b: Any) -> bool:
    if not isinstance(a, bytes) or not isinstance(b, bytes) or len(a) != len(b):
        return False
    import numpy as np

    kinds = {"FP32": "<f4", "FP64": "<f8", "FP16": "<f2", "INT32": "<i4", "INT64": "<i8", "INT8": "i1",
             "UINT8": "u1", "INT16": "<i2"}
    if dtype not in kinds:
        return a == b
    x, y = np.frombuffer(a, dtype=kinds[dtype]), np.frombuffer(b, dtype=kinds[dtype])
    return bool(np.allclose(x, y, rtol=REL_TOLERANCE, atol=ABS_TOLERANCE))
