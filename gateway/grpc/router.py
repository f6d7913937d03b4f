"""The gRPC side of the request pipeline, shared by both gRPC servers.

Both servers (``grpc.front``, our own HTTP/2 server, and ``grpc.grpcio_front``, grpcio's) hand
this the raw request message and the client's metadata; only the routing fields are read
(``grpc.wire``), the tensors are never decoded. A ``ModelInfer`` becomes a :class:`GrpcInfer`,
the pipeline's exchange for gRPC; outcomes are classified by status code (``grpc.status``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence

from gateway.errors import BadRequest
from gateway.grpc.status import FAULTS, StatusCode, classify, status_name
from gateway.grpc.upstream import GrpcUpstream
from gateway.grpc.upstream import Metadata as Forwarded
from gateway.grpc.wire import RouteFields, WireError, route_fields, with_version
from gateway.pipeline import SEQUENCED, Pipeline, Target, checked_model
from gateway.proxy.shadow import GrpcMirror
from gateway.routing import VERSION_UNAVAILABLE_MARKERS, Decision, Policy, Reason
from gateway.sequences import checked_sequence_id
from gateway.telemetry.recorder import QUEUE_FULL, STEERED_ROUTES, Outcome

_QUEUE_FULL = QUEUE_FULL.encode()

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
_VERSION_GONE = frozenset([StatusCode.NOT_FOUND, StatusCode.UNAVAILABLE])
_PINNED = Reason.PINNED

Metadata = Sequence[tuple[str | bytes, str | bytes]]


class GrpcInfer:
    """One unary ``ModelInfer`` and its reply (see ``pipeline.Exchange``). The server answers the
    client itself once the pipeline is done, so ``deliver`` has nothing to do."""

    __slots__ = ("upstream", "fleets", "method", "raw", "versioned", "metadata", "timeout", "code", "details",
                 "response", "status")

    def __init__(self, upstream: GrpcUpstream, method: str, raw: bytes, versioned: bool, metadata: Forwarded,
                 timeout: float | None, fleets: Mapping[str, GrpcUpstream] | None = None) -> None:
        self.upstream = upstream
        self.fleets = fleets  # named fleets, for targets such as "green:3"
        self.method = method
        self.raw = raw
        self.versioned = versioned  # the client named the version itself
        self.metadata = metadata
        self.timeout = timeout
        self.code = StatusCode.UNKNOWN.value
        self.details = ""
        self.response = b""
        self.status = "UNKNOWN"

    async def send(self, target: Target) -> None:
        message = self.raw if self.versioned or target.version is None else with_version(self.raw, target.version)
        upstream = self.upstream
        if target.fleet is not None:
            named = self.fleets.get(target.fleet) if self.fleets is not None else None
            if named is None:
                self.code, self.details, self.response = (StatusCode.UNAVAILABLE.value,
                                                          f"gateway: fleet '{target.fleet}' is not configured", b"")
                self.status = status_name(self.code)
                return
            upstream = named
        self.code, self.details, self.response = await upstream.unary(self.method, message, self.metadata,
                                                                      self.timeout)
        self.status = status_name(self.code)

    def unavailable(self) -> bool:
        return self.code in _VERSION_GONE

    async def version_gone(self) -> bool:
        return any(marker in self.details for marker in VERSION_UNAVAILABLE_MARKERS)

    async def deliver(self, decision: Decision) -> None:
        return None

    def outcome(self) -> Outcome:
        return classify(self.code, self.details)

    def fault(self) -> str | None:
        return self.status if self.code in FAULTS and QUEUE_FULL not in self.details else None

    def mirrorable(self) -> bool:
        return self.code == StatusCode.OK

    def mirror(self, model: str, decision: Decision, shadow: Target) -> GrpcMirror:
        assert shadow.version is not None
        return GrpcMirror(model, shadow.version, self.upstream, self.method, with_version(self.raw, shadow.version),
                          self.metadata, self.response)


class GrpcRouter:
    """What both gRPC servers share: routing a message, running a ModelInfer through the pipeline,
    recording stream replies, and the error details clients see."""

    def __init__(self, pipeline: Pipeline, upstream: GrpcUpstream,
                 fleets: Mapping[str, GrpcUpstream] | None = None) -> None:
        self.pipeline = pipeline
        self.book = pipeline.book
        self.upstream = upstream  # the default fleet
        self.fleets = dict(fleets or {})  # named fleets (ModelInfer only: a stream stays on the default fleet)

    def route(self, raw: bytes, headers: Iterable[tuple[bytes, bytes]]) -> tuple[RouteFields, Policy | None, Decision]:
        """Raises ``WireError`` for bytes that are not a ModelInferRequest, or whose model name,
        version or sequence id Triton could not hold (checked before they reach any table)."""
        fields = route_fields(raw)
        try:
            policy = self.book.get(checked_model(fields.model_name))
            if fields.model_version:
                return fields, policy, self.pipeline.pinned(fields.model_version)
            if fields.sequence_id is not None and policy is not None and policy.sequence_affinity \
                    and checked_sequence_id(fields.sequence_id) is not None:
                return fields, policy, SEQUENCED  # the caller awaits settle()
            return fields, policy, self.pipeline.route(policy, headers)
        except BadRequest as exc:
            raise WireError(exc.message) from None

    async def settle(self, fields: RouteFields, policy: Policy | None, headers: Iterable[tuple[bytes, bytes]]) \
            -> Decision:
        """The decision for a message ``route`` answered SEQUENCED: its sequence's pin."""
        assert policy is not None and fields.sequence_id is not None
        return await self.pipeline.route_sequence(policy, headers, fields.sequence_id, fields.sequence_start,
                                                  fields.sequence_end)

    def routed_message(self, raw: bytes, decision: Decision) -> bytes:
        """A streamed request, addressed to the decision's target."""
        version = self.pipeline.target(decision).version
        return raw if version is None or decision.reason is _PINNED else with_version(raw, version)

    def new_infer(self, method: str, raw: bytes, fields: RouteFields, forwarded: Forwarded,
                  timeout: float | None) -> GrpcInfer:
        return GrpcInfer(self.upstream, method, raw, bool(fields.model_version), forwarded, timeout, self.fleets)

    async def infer(self, exchange: GrpcInfer, model: str, policy: Policy | None, decision: Decision,
                    client: str = "") -> Decision:
        """Forward one routed ModelInfer through the pipeline; the decision that answered.
        ``client``: the peer's address (or a trusted proxy's x-forwarded-for), for the judge's shares."""
        started = time.perf_counter()
        try:
            return await self.pipeline.forward(exchange, model, policy, decision, started, "grpc", client)
        except asyncio.CancelledError:  # the client went away: the upstream stream was reset with us
            self.pipeline.record(model, decision, Outcome.CANCELLED, "CANCELLED", "grpc", started, client=client)
            raise

    def announced(self, decision: Decision, response: bytes = b"") -> tuple[tuple[str, str], ...]:
        """The routing metadata of an answer: for Triton's default version, the one its reply names."""
        return self.pipeline.announce(decision.version or _answered_version(response), decision.reason)

    def details(self, code: int, details: str | None) -> str:
        """What the client is told: Triton's details as Triton sent them; the gateway's own say
        so themselves (``gateway: ...``) and name no address."""
        return details or ""

    def record_stream_reply(self, model: str | None, decision: Decision | None, response: bytes,
                            started: float, replied: float = 0.0, client: str = "") -> float:
        """One ModelStreamInferResponse: a failed request inside a stream comes back as a message
        with error_message (field 1) set, and the stream stays open. A successful one is also
        timed (``record_stream``): from ``started``, the stream's last request, when it is the
        first reply since (``replied`` 0.0), else from ``replied``. Returns the new ``replied``."""
        failed = response[:1] == b"\x0a" and len(response) > 1 and response[1] != 0
        if failed and _QUEUE_FULL in response[:256]:  # Triton's full queue: overload, not the version's fault
            self.record(model, decision, StatusCode.RESOURCE_EXHAUSTED, started, client=client)
            return replied
        self.record(model, decision, StatusCode.INTERNAL if failed else StatusCode.OK, started, client=client)
        if failed or model is None or decision is None:
            return replied
        return self.pipeline.recorder.stream_response(model, decision.version or "", started, replied,
                                                      decision.reason not in STEERED_ROUTES)

    def record(self, model: str | None, decision: Decision | None, code: int, started: float,
               details: str = "", client: str = "") -> None:
        if model is None or decision is None:
            return
        outcome = classify(code, details)
        name = status_name(code)
        self.pipeline.record(model, decision, outcome, name, "grpc", started,
                             name if outcome is Outcome.UPSTREAM_ERROR else None, client)


def _answered_version(response: bytes) -> str | None:
    """``model_version`` (field 2) of a ModelInferResponse, read like a request's routing fields."""
    if not response:
        return None
    try:
        return route_fields(response, with_sequence=False).model_version or None
    except WireError:
        return None
