"""The gRPC side of the request pipeline, shared by both gRPC servers.

Both servers (``grpc.front``, our own HTTP/2 server, and ``grpc.grpcio_front``, grpcio's) hand
this the raw request message and the client's metadata; only the routing fields are read
(``grpc.wire``), the tensors are never decoded. A ``ModelInfer`` becomes a :class:`GrpcInfer`,
the pipeline's exchange for gRPC; outcomes are classified by status code (``grpc.status``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from gateway.errors import BadRequest
from gateway.grpc.client_connection import StreamListener
from gateway.grpc.client_streams import ClientStreams
from gateway.grpc.renamed import GrpcRename, grpc_rename, with_model
from gateway.grpc.status import StatusCode, classify, status_name
from gateway.grpc.upstream import GrpcUpstream, Reply, UpstreamStream
from gateway.grpc.upstream import Metadata as Forwarded
from gateway.grpc.wire import (
    Message,
    Raw,
    RouteFields,
    StreamReply,
    WireError,
    addressed,
    message_model_version,
    route_fields,
    stream_reply,
    with_version,
)
from gateway.pipeline import SEQUENCED, Pipeline, Target, checked_model, passed_through_names
from gateway.proxy.shadow import GrpcMirror
from gateway.routing import VERSION_UNAVAILABLE_MARKERS, Decision, Policy, Reason
from gateway.sequences import SequenceFields, checked_sequence_id
from gateway.telemetry.recorder import STEERED_ROUTES, Outcome, queue_refused

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
# Reads that answer for a policy's stable target when it is another model's name (Policy.renamed_stable).
_METADATA, _CONFIG = SERVICE + "ModelMetadata", SERVICE + "ModelConfig"
_STABLE_READS = frozenset([_METADATA, _CONFIG, SERVICE + "ModelReady"])
_VERSION_GONE = frozenset([StatusCode.NOT_FOUND, StatusCode.UNAVAILABLE])
_HEADER_LAG_S = 0.05  # how late a loaded gateway may read a call's headers (client_deadline_ran_out)
_PINNED = Reason.PINNED

Metadata = Sequence[tuple[str | bytes, str | bytes]]


class GrpcInfer:
    """One unary ``ModelInfer`` and its reply (see ``pipeline.Exchange``). The server answers the
    client itself once the pipeline is done, so ``deliver`` has nothing to do."""

    __slots__ = ("upstream", "fleets", "method", "raw", "model", "version", "sequence", "metadata", "timeout", "code",
                 "details", "response", "status", "sent_at", "server", "renamed")

    def __init__(self, upstream: GrpcUpstream, method: str, raw: Raw, fields: RouteFields, metadata: Forwarded,
                 timeout: float | None, fleets: Mapping[str, GrpcUpstream] | None = None,
                 client: str | None = None) -> None:
        self.upstream = upstream
        self.fleets = fleets  # named fleets, for targets such as "green:3"
        self.method = method
        self.raw = raw
        # What the router read of the message, read once: a fleet picks the server by them
        # (the sequence pins it, for ``client``: its quota) without reading the message again.
        self.model = fields.model_name
        self.version = fields.model_version  # the client named the version itself ("": the route decides)
        self.sequence = None if fields.sequence_id is None else SequenceFields(
            fields.sequence_id, fields.sequence_start, fields.sequence_end, client)
        self.metadata = metadata
        self.timeout = timeout  # what is left of the client's grpc-timeout (None: it set none)
        self.sent_at = time.perf_counter()
        self.code = StatusCode.UNKNOWN.value
        self.details = ""
        self.response = b""
        self.status = "UNKNOWN"
        self.server = ""  # the fleet's server it went to, noted by the fleet (pipeline.Exchange.server)
        self.renamed: GrpcRename | None = None  # another model answers: the client sees the name it called

    async def send(self, target: Target) -> None:
        version = self.version or target.version
        model, renamed = self.model, None
        if target.model is not None and target.model != model:  # a renamed target (grpc.renamed)
            renamed, model = grpc_rename(target.model, model), target.model
            message = addressed(self.raw, None if self.version else version, model)
        else:
            message = addressed(self.raw, None if self.version else version)
        self.renamed = renamed
        upstream = self.upstream
        if target.fleet is not None:
            named = self.fleets.get(target.fleet) if self.fleets is not None else None
            if named is None:
                self.code, self.details, self.response = (StatusCode.UNAVAILABLE.value,
                                                          f"gateway: fleet '{target.fleet}' is not configured", b"")
                self.status = status_name(self.code)
                return
            upstream = named
        self.code, self.details, self.response = await upstream.unary(
            self.method, message, self.metadata, self.timeout, model=model, version=version,
            sequence=self.sequence, for_exchange=self)
        self.status = status_name(self.code)
        if renamed is not None:
            if self.code:
                self.details = renamed.details(self.details)
            else:
                self.response = renamed.reply(self.response)

    def unavailable(self) -> bool:
        return self.code in _VERSION_GONE

    async def version_gone(self) -> bool:
        return any(marker in self.details for marker in VERSION_UNAVAILABLE_MARKERS)

    async def deliver(self, decision: Decision) -> None:
        return None

    def outcome(self) -> Outcome:
        if self.code and self.past_client_deadline(self.code):
            return Outcome.CLIENT_DEADLINE
        return classify(self.code, self.details)

    def past_client_deadline(self, code: int = StatusCode.CANCELLED) -> bool:
        """The call ended (``code``) because the deadline the client set ran out."""
        return client_deadline_ran_out(code, self.timeout, time.perf_counter() - self.sent_at)

    def fault(self) -> str | None:
        return self.status if self.outcome() is Outcome.UPSTREAM_ERROR else None

    def mirrorable(self) -> bool:
        return self.code == StatusCode.OK

    def mirror(self, model: str, decision: Decision, shadow: Target) -> GrpcMirror:
        upstream = self.upstream if shadow.fleet is None else (self.fleets or {}).get(shadow.fleet)
        answering = shadow.model if shadow.model is not None and shadow.model != model else None
        if answering is not None:  # a renamed shadow: the outputs are compared, not names
            message = with_model(self.raw, answering, shadow.version)
        else:
            message = bytes(self.raw) if shadow.version is None else with_version(self.raw, shadow.version)
        return GrpcMirror(model, shadow.version, upstream, self.method, message, self.metadata, self.response,
                          shadow.fleet, shadow.key, answering)


class GrpcRouter:
    """What both gRPC servers share: routing a message, running a ModelInfer through the pipeline,
    recording stream replies, and the error details clients see."""

    def __init__(self, pipeline: Pipeline, upstream: GrpcUpstream,
                 fleets: Mapping[str, GrpcUpstream] | None = None, streams_per_client: int = 1024) -> None:
        self.pipeline = pipeline
        self.book = pipeline.book
        self.upstream = upstream  # the default fleet
        self.fleets = dict(fleets or {})  # named fleets (ModelInfer only: a stream stays on the default fleet)
        self.streams = ClientStreams(streams_per_client)

    async def open_stream(self, client: str, path: str, listener: StreamListener, metadata: Forwarded,
                          timeout: float | None) -> UpstreamStream:
        """A ModelStreamInfer stream upstream for ``client``, counted against the client until
        Triton ends it, whether the client stays or leaves (``grpc.client_streams``: TooManyStreams,
        a GatewayError, when the client is at its bound)."""
        ticket = self.streams.take(client)  # before the wait for a connection: a burst counts whole
        try:
            stream = await self.upstream.open(path, listener, metadata, timeout)
        except BaseException:
            ticket.release()
            raise
        # the call was created without a pause since: it has not ended; _finish gives the ticket back
        stream.call.slot = ticket
        return stream

    def route(self, raw: Raw, headers: Iterable[tuple[bytes, bytes]]) -> tuple[RouteFields, Policy | None, Decision]:
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

    async def settle(self, fields: RouteFields, policy: Policy | None, headers: Iterable[tuple[bytes, bytes]],
                     client: str | None = None) -> Decision:
        """The decision for a message ``route`` answered SEQUENCED: its sequence's pin; a start's
        pin is held against ``client``'s quota (the call's client, as for the judge)."""
        assert policy is not None and fields.sequence_id is not None
        return await self.pipeline.route_sequence(policy, headers, fields.sequence_id, fields.sequence_start,
                                                  fields.sequence_end, client if fields.sequence_start else None)

    def stream_send(self, ledger: StreamLedger, raw: Raw, model: str, decision: Decision) -> Message:
        """A streamed request of ``model``, noted in the stream's ledger and addressed to the
        decision's target (a renamed one's replies are given the called name: record_stream_reply)."""
        target = self.pipeline.target(decision)
        if decision.reason is _PINNED:
            ledger.sent(model, decision)
            return raw
        if target.model is not None and target.model != model:
            ledger.sent(model, decision, target.model, grpc_rename(target.model, model))
            return addressed(raw, target.version, target.model)
        ledger.sent(model, decision)
        return addressed(raw, target.version)

    def new_infer(self, method: str, raw: Raw, fields: RouteFields, forwarded: Forwarded,
                  timeout: float | None, client: str | None = None) -> GrpcInfer:
        """``client``: the call's client (peer, or a trusted proxy's x-forwarded-for), whose quota a
        fleet's pin of its sequence counts against."""
        return GrpcInfer(self.upstream, method, raw, fields, forwarded, timeout, self.fleets, client)

    async def pass_through(self, path: str, message: Raw, metadata: Forwarded, timeout: float | None) -> Reply:
        """A call the gateway does not route (metadata, health, model control the gate admitted):
        sent as it is to the default fleet, which picks a server by the model and version the
        message names (read here, once, and only when the fleet has a choice to make). A model's
        unversioned metadata, config or readiness answers for its policy's stable target when
        that is another model's name (:meth:`_stable_read`)."""
        if path in _STABLE_READS and self.book.renamed_stables:  # else the message is not read here
            answered = await self._stable_read(path, message, metadata, timeout)
            if answered is not None:
                return answered
        upstream = self.upstream
        if not upstream.chooses_server:
            return await upstream.unary(path, message, metadata, timeout)
        model, version = passed_through_names(*_decoded(*message_model_version(message)))  # bounded as HTTP's
        return await upstream.unary(path, message, metadata, timeout, model=model, version=version)

    async def _stable_read(self, path: str, message: Raw, metadata: Forwarded, timeout: float | None) -> Reply | None:
        """ModelMetadata / ModelConfig / ModelReady of a model whose policy's stable target is another
        model (``qc`` -> ``qc_2026_12@2``): asked of that target, answered with the called name. None:
        the call passes as it is (no such policy, or the client named a version)."""
        name, version = _decoded(*message_model_version(message))
        policy = self.book.get(name) if version is None and name else None
        stable = policy.renamed_stable if policy is not None else None
        if stable is None or stable.model is None:
            return None
        upstream = self.upstream if stable.fleet is None else self.fleets.get(stable.fleet)
        if upstream is None:
            return StatusCode.UNAVAILABLE.value, f"gateway: fleet '{stable.fleet}' is not configured", b""
        renamed = grpc_rename(stable.model, name)
        code, details, answer = await upstream.unary(path, with_model(message, stable.model, stable.version), metadata,
                                                     timeout, model=stable.model, version=stable.version)
        if code:
            return code, renamed.details(details), answer
        if path == _CONFIG:
            return code, details, renamed.config_reply(answer)
        return code, details, renamed.reply(answer) if path == _METADATA else answer

    async def infer(self, exchange: GrpcInfer, model: str, policy: Policy | None, decision: Decision,
                    client: str = "") -> Decision:
        """Forward one routed ModelInfer through the pipeline; the decision that answered.
        ``client``: the peer's address (or a trusted proxy's x-forwarded-for), for the judge's shares."""
        started = time.perf_counter()
        try:
            return await self.pipeline.forward(exchange, model, policy, decision, started, "grpc", client)
        except asyncio.CancelledError:  # the client went away, or its deadline ran out: the upstream stream was reset
            if exchange.past_client_deadline():  # a latency of at least the client's deadline (censored)
                self.pipeline.record(model, decision, Outcome.CLIENT_DEADLINE, "DEADLINE_EXCEEDED", "grpc", started,
                                     client=client, server=exchange.server)
            else:
                self.pipeline.record(model, decision, Outcome.CANCELLED, "CANCELLED", "grpc", started, client=client,
                                     server=exchange.server)
            raise

    def announced(self, decision: Decision, response: bytes = b"") -> tuple[tuple[str, str], ...]:
        """The routing metadata of an answer: for Triton's default version, the one its reply names."""
        return self.pipeline.announce(decision.version or _answered_version(response), decision.reason)

    def details(self, code: int, details: str | None) -> str:
        """What the client is told: Triton's details as Triton sent them; the gateway's own say
        so themselves (``gateway: ...``) and name no address."""
        return details or ""

    def record_stream_reply(self, ledger: StreamLedger, response: bytes) -> bytes:
        """One ModelStreamInferResponse, charged to the request it answers (``ledger``), as the
        client gets it (a renamed target's reply with the called name). A failed
        request inside a stream comes back as a message with error_message (field 1) set, and
        the stream stays open; its words say whose fault it was (Triton's full or timed-out queue: the
        version's capacity, REJECTED;
        a request Triton could not accept: the client's; anything else: the version's). A
        successful one is also timed (``record_stream``): from when its request was sent for
        its first reply, else from its previous reply."""
        try:
            reply = stream_reply(response)
        except WireError:  # not a reply we can read: charged as the version's answer, as Triton sent it
            reply = StreamReply(b"unreadable reply" if response[:1] == b"\x0a" else b"", b"", True)
        request = ledger.answered(reply.model.decode(errors="replace"), reply.final or bool(reply.error))
        if request is None:
            return response
        model, decision = request.model, request.decision
        if reply.error:
            code = StatusCode.UNAVAILABLE if queue_refused(reply.error) else StatusCode.INTERNAL
            self.record(model, decision, code, request.sent, reply.error.decode(errors="replace"), ledger.client)
        else:
            self.record(model, decision, StatusCode.OK, request.sent, client=ledger.client)
            request.replied = self.pipeline.recorder.stream_response(model, decision.version or "", request.sent,
                                                                     request.replied,
                                                                     decision.reason not in STEERED_ROUTES)
        if reply.error and not reply.model:
            # A failed request's reply names no model, so which request it answers is a guess (the
            # oldest): its words are given every renamed target's called name the stream has pending.
            for rename in {r.rename for r in (request, *ledger.pending) if r.rename is not None}:
                response = rename.stream_reply(response)
            return response
        return response if request.rename is None else request.rename.stream_reply(response)

    def record_stream_end(self, ledger: StreamLedger, code: int, past_client_deadline: bool) -> None:
        """The stream failed with ``code``. After the deadline the client set (Triton's
        DEADLINE_EXCEEDED, the client's reset at its deadline, Triton's reset at its own copy of
        it): every request still unanswered ran out of it, a latency of at least that deadline
        each. Before it, the failure is charged once, to the oldest unanswered request (else
        the last one sent)."""
        if past_client_deadline:
            for request in ledger.unanswered():
                self.pipeline.record(request.model, request.decision, Outcome.CLIENT_DEADLINE, "DEADLINE_EXCEEDED",
                                     "grpc", request.sent, client=ledger.client)
            return
        oldest = ledger.oldest()
        if oldest is not None:
            self.record(oldest.model, oldest.decision, code, oldest.sent, client=ledger.client)

    def record(self, model: str | None, decision: Decision | None, code: int, started: float,
               details: str = "", client: str = "") -> None:
        if model is None or decision is None:
            return
        outcome = classify(code, details)
        name = status_name(code)
        self.pipeline.record(model, decision, outcome, name, "grpc", started,
                             name if outcome is Outcome.UPSTREAM_ERROR else None, client)


def client_deadline_ran_out(code: int, timeout: float | None, elapsed: float) -> bool:
    """A call that failed with ``code`` after ``elapsed`` seconds ran out of the deadline its
    client set (``timeout``; None: it set none): Triton's DEADLINE_EXCEEDED (no deadline of
    the gateway's own applies to gRPC: Triton got the client's, the gateway enforces the same
    one), or any other failure (a reset, a cancel) once that deadline has passed, as far as the
    gateway can tell: its clock starts when it reads the call's headers, the client's when it
    sent them, so a reset at the client's deadline reads early here by however late the headers
    were read (measured with 3 CPU burners: up to 3 ms; past 12 ms once in a full run, read from
    the miscount it caused), plus the header's rounding. A reset read within 5% + 50 ms of the
    deadline is taken for it. A real cancel taken so still tells the judge the truth: a deadline
    is kept as a latency of at least the time elapsed, and a cancelled call's latency is at
    least that too."""
    if timeout is None:
        return False
    return code == StatusCode.DEADLINE_EXCEEDED or elapsed >= timeout * 0.95 - _HEADER_LAG_S


class SentRequest:
    """A request of a stream not fully answered yet: ``model`` the client called, ``answering``
    the model whose replies answer it (another one for a renamed target, whose ``rename`` gives
    them the called name)."""

    __slots__ = ("model", "decision", "sent", "replied", "answering", "rename")

    def __init__(self, model: str, decision: Decision, answering: str | None = None,
                 rename: GrpcRename | None = None) -> None:
        self.model = model
        self.decision = decision
        self.sent = time.perf_counter()
        self.replied = 0.0  # when its last reply went out; 0.0: none yet
        self.answering = model if answering is None else answering
        self.rename = rename


class StreamLedger:
    """The requests of one ModelStreamInfer in the order they were sent, until answered: each
    reply is charged to the decision that routed its own request, never to the stream's last
    one (a pinned message's reply to the pinned decision, a canary-routed message's to the
    canary). Triton answers one model's requests in order (a decoupled model: several replies,
    the last marked final), so a reply answers the oldest request of its model."""

    __slots__ = ("pending", "last", "client")

    def __init__(self, client: str = "") -> None:
        self.pending: deque[SentRequest] = deque()
        self.last: SentRequest | None = None
        self.client = client  # the stream's client (peer, or a trusted proxy's x-forwarded-for), for the judge

    def sent(self, model: str, decision: Decision, answering: str | None = None,
             rename: GrpcRename | None = None) -> None:
        self.last = SentRequest(model, decision, answering, rename)
        self.pending.append(self.last)

    def answered(self, model: str, final: bool) -> SentRequest | None:
        """The request a reply of ``model`` (the model that answered) answers (it leaves the
        ledger on its ``final`` reply)."""
        pending = self.pending
        if not pending:
            return None
        index = next((i for i, request in enumerate(pending) if request.answering == model), 0)
        request = pending[index]
        if final:
            del pending[index]
        return request

    def unanswered(self) -> list[SentRequest]:
        requests = list(self.pending)
        self.pending.clear()
        return requests

    def oldest(self) -> SentRequest | None:
        return self.pending[0] if self.pending else self.last


def _decoded(model: bytes, version: bytes | None) -> tuple[str, str | None]:
    """A message's model name and version bytes as text; bytes that are not UTF-8 name nothing
    (a protobuf string is UTF-8: Triton refuses them itself)."""
    try:
        name = model.decode()
    except UnicodeDecodeError:
        name = ""
    try:
        return name, None if version is None else version.decode()
    except UnicodeDecodeError:
        return name, None


def _answered_version(response: bytes) -> str | None:
    """``model_version`` (field 2) of a ModelInferResponse, read like a request's routing fields."""
    if not response:
        return None
    try:
        return route_fields(response, with_sequence=False).model_version or None
    except WireError:
        return None
