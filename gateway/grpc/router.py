"""The gRPC data path without its server: route a ModelInfer, forward it, fall back, record.

Both gRPC servers (``grpc.front``, our own HTTP/2 server, and ``grpc.grpcio_front``, grpcio's) hand this
the raw request message and the client's metadata; only the routing fields are read
(``grpc.wire``), the tensors are never decoded. Outcomes are classified by gRPC status code:
UNAVAILABLE, INTERNAL, UNKNOWN, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED count against the
version, client-caused codes do not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.grpc.upstream import OK, UNAVAILABLE, UPSTREAM_FAULTS, GrpcUpstream
from gateway.grpc.upstream import Metadata as Forwarded
from gateway.grpc.wire import RouteFields, route_fields, with_version
from gateway.policy_book import PolicyBook
from gateway.proxy.shadow import GrpcMirror, ShadowMirror
from gateway.routing import (
    MAY_SHADOW,
    VERSION_UNAVAILABLE_MARKERS,
    Decision,
    Policy,
    Reason,
    WeylDraw,
    choose_in_sequence,
    fallback_for,
    inflight_key,
)
from gateway.sequences import SequencePins
from gateway.telemetry.recorder import QUEUE_FULL, UNKNOWN_MODEL, Outcome, Recorder

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
CANCELLED, NOT_FOUND, RESOURCE_EXHAUSTED, INTERNAL = 1, 5, 8, 13
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
                "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
_VERSION_GONE = frozenset([NOT_FOUND, UNAVAILABLE])
_PINNED = Reason.PINNED

Metadata = Sequence[tuple[str | bytes, str | bytes]]


def classify(code: int, details: str = "") -> Outcome:
    """gRPC answers HTTP 200 even on failure: the status code says whose fault it was (and for
    UNAVAILABLE, the message: Triton's full queue is overload, not a broken version)."""
    if code == OK:
        return Outcome.SUCCESS
    if code == CANCELLED:
        return Outcome.CANCELLED
    if code == RESOURCE_EXHAUSTED or (code == UNAVAILABLE and QUEUE_FULL in details):
        return Outcome.OVERLOAD
    return Outcome.UPSTREAM_ERROR if code in UPSTREAM_FAULTS else Outcome.CLIENT_ERROR


def status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"


def decision_metadata(decision: Decision | None) -> tuple[tuple[str, str], ...]:
    """What the client is told about routing (none for a version it pinned itself)."""
    if decision is None or decision.reason is _PINNED:
        return ()
    return (("x-gateway-model-version", decision.version or ""), ("x-gateway-route", decision.reason))


@dataclass(slots=True)
class Routed:
    fields: RouteFields
    policy: Policy | None
    decision: Decision | None
    message: bytes  # the request with model_version set to the decision's


@dataclass(slots=True)
class InferResult:
    model: str
    decision: Decision | None
    code: int
    details: str
    response: bytes


class GrpcRouter:
    def __init__(self, book: PolicyBook, recorder: Recorder, pins: SequencePins, upstream: GrpcUpstream,
                 access_log: Callable[..., None] | None = None, shadow: ShadowMirror | None = None) -> None:
        self.book = book
        self.recorder = recorder
        self.pins = pins
        self.upstream = upstream
        self.access_log = access_log
        self.shadow = shadow
        self._draw = WeylDraw(seed=time.monotonic_ns() + 1)

    def route(self, raw: bytes, metadata: Metadata) -> Routed:
        """Raises ``WireError`` for bytes that are not a ModelInferRequest."""
        fields = route_fields(raw)
        policy = self.book.get(fields.model_name)
        if fields.model_version:
            return Routed(fields, policy, Decision(fields.model_version, _PINNED), raw)
        if policy is None:
            return Routed(fields, None, None, raw)
        names = policy.header_names
        headers = {}
        for key, value in metadata:
            name = key if isinstance(key, bytes) else key.encode()
            if name in names:
                headers[name] = value if isinstance(value, bytes) else value.encode()
        decision = choose_in_sequence(policy, headers, self._draw(), self.pins, fields.sequence_id,
                                      fields.sequence_start, fields.sequence_end)
        return Routed(fields, policy, decision, with_version(raw, decision.version))  # type: ignore[arg-type]

    async def infer(self, method: str, routed: Routed, raw: bytes, forwarded: Forwarded,
                    timeout: float | None) -> InferResult:
        """Forward one routed ModelInfer; re-send it to the fallback if its version is gone."""
        started = time.perf_counter()
        model, policy, decision = routed.fields.model_name, routed.policy, routed.decision
        inflight = inflight_key(model, policy, decision)
        counts = self.recorder.inflight
        if inflight is not None:  # the drain before an unload waits for these
            counts[inflight] = counts.get(inflight, 0) + 1
        try:
            code, details, response = await self.upstream.unary(method, routed.message, forwarded, timeout)
            if code in _VERSION_GONE and decision is not None and decision.version is not None \
                    and any(marker in details for marker in VERSION_UNAVAILABLE_MARKERS):
                fallback = fallback_for(policy, decision)
                if fallback is not None and fallback.version is not None:  # unloaded under us: re-send it
                    self.recorder.upstream_error(model, decision.version, "VersionUnavailable")
                    decision = fallback
                    code, details, response = await self.upstream.unary(
                        method, with_version(raw, fallback.version), forwarded, timeout)
        except asyncio.CancelledError:  # the client went away: the upstream stream was reset with us
            self.record(model, decision, CANCELLED, started)
            raise
        finally:
            if inflight is not None:
                counts[inflight] -= 1
        self.record(model, decision, code, started, details)
        if code == OK and policy is not None and policy.shadow_version is not None and decision is not None:
            self._maybe_shadow(method, model, policy, decision, raw, forwarded, response)
        return InferResult(model, decision, code, details, response)

    def _maybe_shadow(self, method: str, model: str, policy: Policy, decision: Decision, raw: bytes,
                      forwarded: Forwarded, response: bytes) -> None:
        version = policy.shadow_version
        if self.shadow is None or version is None or decision.reason not in MAY_SHADOW:
            return
        if self._draw() >= policy.shadow_bp or self.shadow.full(model, version):
            return
        self.shadow.offer(GrpcMirror(model, version, self.upstream, method, with_version(raw, version),
                                     forwarded, response))

    def details(self, code: int, details: str | None) -> str:
        if code == UNAVAILABLE:
            return f"upstream triton at {self.upstream.address} is unavailable: {details}"
        return details or ""

    def record_stream_reply(self, model: str | None, decision: Decision | None, response: bytes,
                            started: float) -> None:
        """One ModelStreamInferResponse: a failed request inside a stream comes back as a message
        with error_message (field 1) set, and the stream stays open."""
        failed = response[:1] == b"\x0a" and len(response) > 1 and response[1] != 0
        self.record(model, decision, INTERNAL if failed else OK, started)

    def record(self, model: str | None, decision: Decision | None, code: int, started: float,
               details: str = "") -> None:
        if model is None:
            return
        version = decision.version if decision is not None and decision.version else ""
        reason = decision.reason if decision is not None else Reason.DEFAULT
        if code == NOT_FOUND or (decision is None and code != OK and self.book.get(model) is None):
            model, version = UNKNOWN_MODEL, ""
        outcome = classify(code, details)
        name = status_name(code)
        if outcome is Outcome.UPSTREAM_ERROR:
            self.recorder.upstream_error(model, version, name)
        latency = time.perf_counter() - started
        self.recorder.record(model, version, outcome, latency, reason, "grpc", name)
        if self.access_log is not None:
            self.access_log(model, version, reason, "grpc", name, latency)

