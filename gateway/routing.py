"""The routing decision: which version serves one request. Pure: no I/O, no clock, no state.

A :class:`PolicySpec` is the document SREs write (YAML config or admin API); it is
validated once and compiled into a :class:`Policy`, the immutable, precomputed form the
data path reads. :func:`choose` maps (policy, request keys) to a :class:`Decision`.

Sticky hashing (the agreed design): ``mmh3(f"{model}:{key}") % 10000`` picks a bucket;
versions own contiguous bucket ranges laid out newest version first, so raising the newest
(canary) version's weight only moves users *into* it, never back out. Anonymous requests
use the same layout with a caller-supplied draw in [0, 10000).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import mmh3

from gateway.policy import PolicySpec, TargetName, heaviest, parse_target, target_order

BUCKETS = 10_000  # basis points: 0.01 % resolution


class Reason:
    """Why a version was chosen; the same strings appear in headers, logs and metrics."""

    PINNED = "pinned"
    RULE = "rule"
    SEQUENCE = "sequence"
    STICKY = "sticky"
    WEIGHTED = "weighted"
    DEFAULT = "default"
    FALLBACK = "fallback"  # the chosen version was unavailable on Triton; another one answered


@dataclass(frozen=True, slots=True)
class Decision:
    version: str | None  # None: forward unversioned, Triton picks its default
    reason: str


@dataclass(frozen=True, slots=True)
class Policy:
    """Compiled policy: everything the hot path needs, precomputed."""

    model: str
    spec: PolicySpec
    revision: int
    # (exclusive upper bucket, sticky decision, weighted decision), newest version first;
    # decisions are built once here so choose() allocates nothing.
    ranges: tuple[tuple[int, Decision, Decision], ...]
    sticky_header: bytes | None
    rules: tuple[tuple[bytes, bytes, Decision], ...]
    header_names: frozenset[bytes]  # every header choose() may look at
    hash_prefix: bytes
    # version -> where its requests go when Triton says it is unavailable: the
    # highest-weight other version (the stable one, during a canary).
    fallbacks: dict[str, Decision]
    shadow_version: str | None = None
    shadow_bp: int = 0  # mirror when the request's draw is below this
    sequence_affinity: bool = False
    # The stable (heaviest) target when it is another model's name: the model's metadata, config
    # and readiness calls answer for it (None: they pass as the client sent them).
    renamed_stable: TargetName | None = None
    # the versions of the split (spec.weights' keys): read per request (inflight_key), a set of
    # its own is a slot's load where the spec's is a pydantic model's attribute, a full look-up
    split_versions: frozenset[str] = frozenset()


def layout(weights_bp: Mapping[str, int]) -> tuple[tuple[int, str], ...]:
    """Bucket ranges, newest version first, zero weights left out."""
    upper, out = 0, []
    for version in sorted(weights_bp, key=target_order, reverse=True):
        if weights_bp[version] > 0:
            upper += weights_bp[version]
            out.append((upper, version))
    return tuple(out)


def compile_policy(model: str, spec: PolicySpec, revision: int = 0, default_sticky_header: str = "x-user-id",
                   sequence_batched: bool = False) -> Policy:
    """``sequence_batched``: Triton's config of the model has a sequence batcher (what
    ``sequence_affinity: auto`` follows)."""
    sticky = (spec.sticky_header or default_sticky_header).lower().encode("latin-1")
    ranges = tuple(
        (upper, Decision(version, Reason.STICKY), Decision(version, Reason.WEIGHTED))
        for upper, version in layout(spec.basis_points())
    )
    rules = tuple(
        (rule.header.lower().encode("latin-1"), rule.equals.encode(), Decision(rule.version, Reason.RULE))
        for rule in spec.rules
    )
    # Every version the policy names gets a fallback, zero weights included: a request routed
    # just before a rollback may come back "unavailable" after the new policy took its weight.
    weighted = {v: w for v, w in spec.basis_points().items() if w > 0}
    fallbacks = {}
    stable = parse_target(heaviest(spec.weights))
    for version in {*spec.weights, *(rule.version for rule in spec.rules)}:
        others = {v: w for v, w in weighted.items() if v != version}
        if others:
            fallbacks[version] = Decision(heaviest(others), Reason.FALLBACK)
    return Policy(
        model=model,
        spec=spec,
        revision=revision,
        ranges=ranges,
        sticky_header=sticky,
        rules=rules,
        header_names=frozenset([sticky, *(name for name, _, _ in rules)]),
        hash_prefix=f"{model}:".encode(),
        split_versions=frozenset(spec.weights),
        fallbacks=fallbacks,
        shadow_version=spec.shadow.version if spec.shadow else None,
        shadow_bp=int(spec.shadow.percent * 100) if spec.shadow else 0,
        sequence_affinity=sequence_batched if spec.sequence_affinity == "auto" else bool(spec.sequence_affinity),
        renamed_stable=stable if stable.renames(model) else None,
    )


# Triton's words (HTTP bodies and gRPC messages alike) for "that version cannot answer now".
VERSION_UNAVAILABLE_MARKERS = ("is not at ready state", "is not found", "has no available versions")
# Decisions the policy made freely may be re-sent to the fallback; rule, pin and sequence may not.
MAY_FALL_BACK = frozenset([Reason.WEIGHTED, Reason.STICKY])
# Requests the policy routed (not pinned by the client, not a fallback) may be mirrored to the shadow.
MAY_SHADOW = frozenset([Reason.WEIGHTED, Reason.STICKY, Reason.SEQUENCE, Reason.RULE])


def fallback_for(policy: Policy | None, decision: Decision | None) -> Decision | None:
    if policy is None or decision is None or decision.version is None or decision.reason not in MAY_FALL_BACK:
        return None
    return policy.fallbacks.get(decision.version)


def inflight_key(model: str | None, policy: Policy | None, decision: Decision | None) -> tuple[str, str] | None:
    """Only versions a policy names: the gauge's labels stay bounded whatever clients send."""
    if model is None or policy is None or decision is None or decision.version is None:
        return None
    return (model, decision.version) if decision.version in policy.split_versions else None


def bucket(model: str, key: str | bytes) -> int:
    """The sticky bucket of a user: stable across processes and replicas (unlike hash())."""
    raw = key.encode() if isinstance(key, str) else key
    return int(mmh3.hash(model.encode() + b":" + raw, signed=False)) % BUCKETS


def _in_range(policy: Policy, point: int) -> tuple[int, Decision, Decision]:
    for entry in policy.ranges:
        if point < entry[0]:
            return entry
    return policy.ranges[-1]


def choose(policy: Policy, headers: Mapping[bytes, bytes], draw: int) -> Decision:
    """Pick the version for one unpinned request.

    ``headers`` holds (at least) the request headers named in ``policy.header_names``,
    lower-case; ``draw`` is a number in [0, BUCKETS) for anonymous traffic, e.g. from a
    low-discrepancy sequence so that small weights are honoured exactly.
    Order: header rule, then sticky hash of the user key, then the weighted draw.
    """
    if not headers:  # none of the headers the policy looks at (most requests): no rule, no key, the draw
        return _in_range(policy, draw)[2]
    ruled = _by_rule(policy, headers)
    return ruled if ruled is not None else _by_key(policy, headers, draw)


def _by_rule(policy: Policy, headers: Mapping[bytes, bytes]) -> Decision | None:
    for name, value, decision in policy.rules:
        if headers.get(name) == value:
            return decision
    return None


def _by_key(policy: Policy, headers: Mapping[bytes, bytes], draw: int) -> Decision:
    """Sticky hash of the user key, else the weighted draw."""
    key = headers.get(policy.sticky_header) if policy.sticky_header else None
    if key:
        return _in_range(policy, int(mmh3.hash(policy.hash_prefix + key, signed=False)) % BUCKETS)[1]
    return _in_range(policy, draw)[2]


_WEYL_STEP = 6_180_339_887  # golden ratio conjugate * 10**10
_WEYL_MOD = 10_000_000_000
_WEYL_PER_BUCKET = _WEYL_MOD // BUCKETS


class WeylDraw:
    """Anonymous draws from a Weyl sequence: n * (golden ratio) mod 1, scaled to buckets.

    Consecutive draws are spread evenly over [0, BUCKETS), so over N requests each version's
    share is within a few requests of its weight, where a pseudo-random pick drifts by
    sqrt(N) (a 0.5 % canary would see 0.3-0.7 % only most of the time).

    Without a seed the sequence starts at a random offset (per process): a client that knows
    where it starts could send its requests when the next draw lands on the version it wants.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int | None = None) -> None:
        self._state = (secrets.randbelow(_WEYL_MOD) if seed is None else seed) % _WEYL_MOD

    def next(self) -> int:  # module constants: read through the instance, a class's are full look-ups
        """The next draw. A method: calling the object (``__call__``) takes a slower way in 3.11."""
        self._state = state = (self._state + _WEYL_STEP) % _WEYL_MOD
        return state // _WEYL_PER_BUCKET

    __call__ = next


def choose_in_sequence(policy: Policy, headers: Mapping[bytes, bytes], draw: int, pins: SequencePinsLike,
                       sequence_id: object | None, start: bool, end: bool,
                       client: str | None = None) -> Decision | None:
    """``choose`` with sequence affinity: a live sequence keeps its version (after header
    rules, before sticky and weighted). A pin is made only by the sequence's start (so no
    request can pin a sequence it did not start), held against ``client``'s quota (the
    decision does not depend on it); a sequence that ends lets its pin go.
    None: a continuing sequence this table has no pin for (the caller looks further, e.g. in
    the pins other replicas share, then routes it with :func:`choose_unpinned`)."""
    ruled = _by_rule(policy, headers)
    if ruled is not None:
        return ruled
    if sequence_id is None:
        return _by_key(policy, headers, draw)
    if start:
        decision = _by_key(policy, headers, draw)
        if end:  # a one-request sequence: nothing to keep
            pins.release(policy.model, sequence_id)
        else:
            pins.pin(policy.model, sequence_id, decision.version, client)  # type: ignore[arg-type]
        return decision
    pinned = pins.recent(policy.model, sequence_id)
    if pinned is None:
        return None
    if end:
        pins.release(policy.model, sequence_id)
    return Decision(pinned, Reason.SEQUENCE)


def choose_unpinned(policy: Policy, headers: Mapping[bytes, bytes], draw: int) -> Decision:
    """A continuing sequence no replica has a pin for (it idled out, or began before affinity
    was on): routed like any request, and not pinned (Triton says whether it knows it)."""
    return _by_key(policy, headers, draw)


class SequencePinsLike(Protocol):
    def recent(self, model: str, sequence_id: object) -> str | None: ...
    def pin(self, model: str, sequence_id: object, version: str, client: str | None = None) -> None: ...
    def release(self, model: str, sequence_id: object) -> None: ...
