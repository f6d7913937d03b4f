"""One request pipeline for both protocols: route -> in-flight -> forward (with the
version-unavailable fallback) -> shadow gate -> record.

The HTTP front (``proxy/http.py``) and the gRPC fronts (``grpc/front.py`` and
``grpc/grpcio_front.py``, through ``grpc/router.py``) only translate their wire format: a
request becomes an :class:`Exchange` that can send itself to a :class:`Target`, tell whether
Triton's answer means "that version cannot answer now", hand the answer to its client and
make a shadow copy. What happens, and in which order, is written here once, so a behaviour
that one protocol has the other has too.

A :class:`Target` is where one request goes: a version on a fleet. Targets are built once per
version and reused, like the decisions of a compiled policy: the hot path allocates no new
routing objects per request. What is the request's own travels with its exchange: the fields
its front read once (model, version sent, sequence fields), which the fleet chooses a server
by, and the server it chose (``Exchange.server``), which the access log names.

Layering: the pipeline knows exchanges and the ports it is given (policy book, recorder,
sequence pins, shadow queue), never a front's module. The shadow queue is the port
:class:`Shadow` (implemented by ``proxy.shadow.ShadowMirror``); what an exchange mirrors is a
:class:`ShadowCopy` the queue sends and compares. The fronts import the pipeline, not the other
way round (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from gateway.client_address import ClientAddresses
from gateway.errors import BadRequest
from gateway.policy import DOT_SEGMENTS, parse_target
from gateway.policy_book import PolicyBook
from gateway.routing import (
    MAY_SHADOW,
    Decision,
    Policy,
    Reason,
    WeylDraw,
    choose,
    choose_in_sequence,
    choose_unpinned,
    fallback_for,
    inflight_key,
)
from gateway.sequences import SequencePins, checked_sequence_id
from gateway.telemetry.recorder import UNKNOWN_MODEL, Outcome, Recorder

DEFAULT = Decision(None, Reason.DEFAULT)  # no policy, not pinned: Triton picks its default version
# Marker for a front: this request belongs to a sequence on a model with affinity; decide with
# ``await Pipeline.route_sequence`` (the pin may have to be read from, or written to, the store).
SEQUENCED = Decision(None, Reason.SEQUENCE)
ROUTE_HEADER = "x-gateway-route"
VERSION_HEADER = "x-gateway-model-version"
# Answers that mean Triton does not know the model or version (HTTP, gRPC): recorded under one
# label whatever name the client sent, so client-chosen names cannot grow the series.
_NOT_FOUND = frozenset([404, "NOT_FOUND"])
_MAX_TARGETS = 4096  # pinned versions come from clients: the cache of targets stays bounded
# Client-chosen names are checked before they reach a table, a cache, a metric label, a header or
# a log line. Triton's versions are positive int64s (at most 19 digits); a model is a directory of
# the model repository, so its name is a file name (NAME_MAX: 255 bytes) without control characters.
MAX_VERSION_DIGITS = 19
MAX_MODEL_NAME_BYTES = 255
# A pinned version that failed and that no policy names: one label, whatever clients send.
UNSERVED_VERSION = "_unserved"
_CONTROL_CHARACTERS = frozenset(chr(code) for code in [*range(32), 127])
_NO_KEYS: dict[bytes, bytes] = {}  # the routing keys of a request that has none (read, never written)
_STATUS_LABELS: dict[int | str, str] = {}  # an answer's status as the recorder's label: str(200) made once


def checked_version(version: str) -> str:
    """A version a client pinned, as Triton reads it ("007" is 7), or BadRequest."""
    if 0 < len(version) <= MAX_VERSION_DIGITS and version.isascii() and version.isdigit():
        return str(int(version))
    shown = version[:40].encode("unicode_escape").decode("ascii")
    raise BadRequest(f"model version '{shown}' is not a version: at most {MAX_VERSION_DIGITS} digits")


def checked_model(model: str) -> str:
    """A model name a client sent, or BadRequest when no model repository can hold it."""
    if len(model.encode("utf-8", "surrogatepass")) > MAX_MODEL_NAME_BYTES:
        raise BadRequest(f"model name of {len(model.encode('utf-8', 'surrogatepass'))} bytes: "
                         f"at most {MAX_MODEL_NAME_BYTES} are taken")
    if not _CONTROL_CHARACTERS.isdisjoint(model):
        raise BadRequest("a model name has no control characters")
    if model in DOT_SEGMENTS:  # the repository itself or its parent: a directory, never a model
        raise BadRequest(f"'{model}' is not a model name: '.' and '..' name directories")
    return model


def passed_through_names(model: str, version: str | None) -> tuple[str, str | None]:
    """The model and version a call passed through as sent names (metadata, ready, stats: no
    route), for a fleet to send it where they are; one rule for both ports. What Triton could
    not hold names nothing ("", None: any server answers it, as Triton does), so it reaches no
    cache of the fleet's; a version is read as Triton reads it ("007" is 7)."""
    try:
        model = checked_model(model)
    except BadRequest:
        model = ""
    if version is not None:
        try:
            version = checked_version(version)
        except BadRequest:
            version = None
    return model, version


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request goes: a version (None: Triton's default) of a model (None: the one the
    client called; another name: a renamed target, whose answers the front gives the called
    name) on a fleet (None: the default fleet); ``key`` is the policy's spelling of it. The
    server of the fleet is chosen per request by the fleet's balancer when the
    request is sent (``gateway.fleet``), where admission, retry and sequence pins live too. It
    chooses by what the exchange carries, read once by its front (the model, the version sent,
    the sequence fields): a Target is shared by every request to its version, so those stay
    with the exchange, and the fleet never reads the request again."""

    version: str | None
    fleet: str | None = None
    model: str | None = None
    key: str = ""


class ShadowCopy(Protocol):
    """A request copied for the shadow version, made by its exchange (``mirror``), with the
    primary's answer to compare against; the shadow queue sends and compares it."""

    @property
    def model(self) -> str: ...
    @property
    def version(self) -> str | None: ...


class Shadow(Protocol):
    """Where the pipeline offers copies: a bounded queue that never blocks (``proxy.shadow.ShadowMirror``)."""

    def full(self, model: str, version: str) -> bool:
        """True (and the drop counted) when a copy would not fit: the exchange then builds none."""

    def offer(self, mirror: ShadowCopy) -> None:
        """Queue the copy, or drop it (counted) when the queue or the byte budget has no room."""


class Exchange(Protocol):
    """One request as its front sees it. The pipeline decides; the exchange speaks the wire."""

    server: str
    """The fleet's server the request went to, the last one tried (noted by the fleet when it
    chooses, on every send); "" before it is sent."""

    @property
    def status(self) -> int | str:
        """The answer's status as metrics label it: an HTTP status, a gRPC status name."""

    async def send(self, target: Target) -> None:
        """Forward the request to ``target`` and keep the answer (raises GatewayError)."""

    def unavailable(self) -> bool:
        """Cheap first look: could the answer mean the version is gone (HTTP 404/503, gRPC NOT_FOUND/UNAVAILABLE)?"""

    async def version_gone(self) -> bool:
        """Triton's words say the version cannot answer now, and the request can be sent again."""

    async def deliver(self, decision: Decision) -> None:
        """Hand the answer to the client, announcing ``decision`` (the one that answered)."""

    def outcome(self) -> Outcome: ...

    def fault(self) -> str | None:
        """The kind of upstream error to count for the version, or None."""

    def mirrorable(self) -> bool:
        """A complete success the shadow's answer can be compared with."""

    def mirror(self, model: str, decision: Decision, shadow: Target) -> ShadowCopy:
        """The same request, addressed to ``shadow``, with this answer to compare against."""


@lru_cache(maxsize=1024)
def route_metadata(version: str | None, reason: str) -> tuple[tuple[str, str], ...]:
    """What every answer says about routing, on both protocols: the route, and the version
    that answered when it is known (``version``: the decision's, else the one Triton named)."""
    if version:
        return (VERSION_HEADER, version), (ROUTE_HEADER, reason)
    return ((ROUTE_HEADER, reason),)


class Pipeline:
    """Shared by both fronts: one policy book, one draw sequence, one recorder."""

    def __init__(self, book: PolicyBook, recorder: Recorder, pins: SequencePins | None = None,
                 shadow: Shadow | None = None, access_log: Callable[..., None] | None = None,
                 expose_version_headers: bool = True, clients: ClientAddresses | None = None) -> None:
        self.book = book
        self.recorder = recorder
        self.pins = pins if pins is not None else SequencePins()  # not `or`: an empty pin table is falsy
        self.shadow = shadow
        self.access_log = access_log
        self.expose_version_headers = expose_version_headers
        self.clients = clients or ClientAddresses()  # who a request's client is (trusted_proxies)
        self._draw = WeylDraw()  # routing: each process starts at its own random offset
        # The shadow gate's own sequence: a draw taken from the routing sequence for some requests
        # only (not the shadow's own answers) would shift every later routing draw and skew the split.
        self._shadow_draw = WeylDraw()
        self._targets: dict[str | None, Target] = {}

    def announce(self, version: str | None, reason: str) -> tuple[tuple[str, str], ...]:
        """The routing metadata an answer carries: :func:`route_metadata`, or nothing when
        ``expose_version_headers`` is off (a client that sees which version answered can aim at it)."""
        return route_metadata(version, reason) if self.expose_version_headers else ()

    # -- route ---------------------------------------------------------------------------------
    def route(self, policy: Policy | None, headers: Iterable[tuple[bytes, bytes]]) -> Decision:
        """The decision for one request outside any sequence (lower-case header names, as on the wire)."""
        if policy is None:
            return DEFAULT
        names = policy.header_names
        found = _NO_KEYS  # most requests carry none of the names: no dict (nor comprehension) of their own
        for name, value in headers:
            if name in names:
                if found is _NO_KEYS:
                    found = {}
                found[name] = value
        return choose(policy, found, self._draw.next())

    async def route_sequence(self, policy: Policy, headers: Iterable[tuple[bytes, bytes]], sequence_id: object,
                             start: bool, end: bool, client: str | None = None) -> Decision:
        """The decision for a request of a sequence on a model with affinity: its pin (from
        this replica's table, or the store's when this one has none or an old one); a start is
        routed as usual and its pin written through to the store before it is forwarded (an
        end's release too). ``client``: whose pin a start makes (its quota in the pin table)."""
        names = policy.header_names
        found = {name: value for name, value in headers if name in names}
        checked = checked_sequence_id(sequence_id)  # BadRequest before the id reaches the pin table
        draw = self._draw.next()
        if checked is None:
            return choose(policy, found, draw)
        decision = choose_in_sequence(policy, found, draw, self.pins, checked, start, end, client)
        if decision is None:
            version = await self.pins.resolve(policy.model, checked, end)
            decision = choose_unpinned(policy, found, draw) if version is None else Decision(version, Reason.SEQUENCE)
        elif decision.reason == Reason.RULE:
            return decision
        if start != end:  # a start pins, an end unpins: on every replica from the sequence's next request on
            await self.pins.share(policy.model, checked)
        return decision

    @staticmethod
    def pinned(version: str) -> Decision:
        """The decision for a request whose client named the version (BadRequest if it is not one)."""
        return Decision(checked_version(version), Reason.PINNED)

    def target(self, decision: Decision) -> Target:
        """The one place a decision becomes where the request goes."""
        return self._target(decision.version)

    def _target(self, version: str | None) -> Target:
        target = self._targets.get(version)
        if target is None:
            if version is None:
                target = Target(None)
            elif version.isdigit():  # a version of the called model: a policy's, or one a client pinned ("0" too)
                target = Target(version, key=version)
            else:  # "green:3": version 3 on fleet green; "qc_2026_12@2": version 2 of model qc_2026_12
                name = parse_target(version)
                target = Target(name.version, name.fleet, name.model, version)
            if len(self._targets) < _MAX_TARGETS:
                self._targets[version] = target
        return target

    def _named(self, model: str, version: str) -> bool:
        """A policy of the model names the version (in its split or as its shadow)."""
        policy = self.book.get(model)
        if policy is None:
            return False
        spec = policy.spec
        return version in spec.weights or version == policy.shadow_version or any(
            rule.version == version for rule in spec.rules)

    # -- forward, shadow, record ---------------------------------------------------------------
    async def forward(self, exchange: Exchange, model: str, policy: Policy | None, decision: Decision,
                      started: float, protocol: str, client: str = "") -> Decision:
        """Send, fall back if the version is gone, deliver, mirror, record; the decision that answered.
        ``client``: the client's address (:meth:`record`).

        The in-flight count covers delivery too: the drain before an unload waits for a
        streaming answer to finish. Exceptions propagate to the front, which answers its client
        and records them with :meth:`record`."""
        recorder = self.recorder
        inflight = inflight_key(model, policy, decision)
        if inflight is not None:
            recorder.add_inflight(inflight)
        try:
            await exchange.send(self._target(decision.version))
            if exchange.unavailable():
                fallback = fallback_for(policy, decision)
                if fallback is not None and await exchange.version_gone():
                    recorder.upstream_error(model, decision.version or "", "VersionUnavailable")
                    decision = fallback
                    await exchange.send(self._target(fallback.version))
            await exchange.deliver(decision)
        finally:
            if inflight is not None:
                recorder.remove_inflight(inflight)
        if policy is not None and policy.shadow_version is not None:
            self._shadow_gate(exchange, model, policy, decision)
        self.record(model, decision, exchange.outcome(), exchange.status, protocol, started, exchange.fault(), client,
                    exchange.server)
        return decision

    def _shadow_gate(self, exchange: Exchange, model: str, policy: Policy, decision: Decision) -> None:
        """Mirror a share of the requests the policy routed, never blocking, never more than the queue holds.
        Not the shadow's own answers (a rollout of the shadow sends it traffic): it would agree with itself."""
        shadow, version = self.shadow, policy.shadow_version
        if shadow is None or version is None or decision.reason not in MAY_SHADOW or not exchange.mirrorable() \
                or decision.version == version:
            return
        if self._shadow_draw.next() >= policy.shadow_bp or shadow.full(model, version):
            return
        shadow.offer(exchange.mirror(model, decision, self._target(version)))

    def record(self, model: str, decision: Decision, outcome: Outcome, status: int | str, protocol: str,
               started: float, fault: str | None = None, client: str = "", server: str = "") -> None:
        """One sample. One rule for a model Triton does not know, on both protocols: a not-found
        answer, or a failed request for a model without a policy (routed by Triton or pinned by the
        client), is recorded as ``_unknown``; a failed pinned version no policy names as ``_unserved``.
        ``client`` (the peer's address, or the one a trusted proxy forwarded) is the unit the
        rollout judge counts shares by; ``server`` (the fleet's server that answered) goes to the access log."""
        failed = outcome is not Outcome.SUCCESS
        if status in _NOT_FOUND or failed and (decision is DEFAULT or decision.reason == Reason.PINNED
                                                 and self.book.get(model) is None):
            model, version, reason = UNKNOWN_MODEL, "", Reason.DEFAULT
        else:
            version, reason = decision.version or "", decision.reason
            if reason == Reason.PINNED and failed and not self._named(model, version):
                version = UNSERVED_VERSION  # a version only the client named, and it failed: Triton may not have it
        latency = time.perf_counter() - started
        if fault is not None:
            self.recorder.upstream_error(model, version, fault)
        code = _STATUS_LABELS.get(status)
        if code is None:
            code = str(status)
            if len(_STATUS_LABELS) < 1024:  # HTTP's statuses and gRPC's names: a few
                _STATUS_LABELS[status] = code
        self.recorder.record(model, version, outcome, latency, reason, protocol, code, client)
        if self.access_log is not None:
            self.access_log(model, version, reason, protocol, status, latency, server)
