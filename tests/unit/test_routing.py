from __future__ import annotations

from collections import Counter
from decimal import Decimal

import mmh3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.policy import PolicySpec
from gateway.routing import BUCKETS, Policy, Reason, WeylDraw, bucket, choose, compile_policy, layout


def policy(weights: dict[str, float], **extra: object) -> Policy:
    return compile_policy("qc", PolicySpec.model_validate({"weights": weights, **extra}), revision=1)


def anonymous_split(weights: dict[str, float], n: int, seed: int = 7) -> Counter[str]:
    compiled = policy(weights)
    draw = WeylDraw(seed)
    return Counter(choose(compiled, {}, draw()).version for _ in range(n))  # type: ignore[misc]


def test_bucket_is_the_designed_formula() -> None:
    assert bucket("qc", "alice") == mmh3.hash("qc:alice", signed=False) % 10000
    assert bucket("qc", b"alice") == bucket("qc", "alice")
    assert bucket("qc", "alice") != bucket("other", "alice") or bucket("qc", "bob") != bucket("other", "bob")


def test_layout_puts_the_newest_version_first_and_drops_zero_weights() -> None:
    assert layout({"2": 8000, "3": 2000, "1": 0}) == ((2000, "3"), (10000, "2"))


def test_anonymous_split_80_20_is_exact_within_a_request_or_two() -> None:
    counts = anonymous_split({"2": 80, "3": 20}, 10_000)
    assert abs(counts["2"] - 8000) <= 2 and abs(counts["3"] - 2000) <= 2


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40])
def test_half_percent_canary_gets_half_percent(seed: int) -> None:
    counts = anonymous_split({"2": 99.5, "3": 0.5}, 10_000, seed)
    assert 30 <= counts["3"] <= 70
    assert abs(counts["3"] - 50) <= 2


def test_hundredth_of_a_percent_is_honoured() -> None:
    counts = anonymous_split({"2": 99.99, "3": 0.01}, 100_000)
    assert 8 <= counts["3"] <= 12


def test_rules_win_over_sticky_and_weights() -> None:
    compiled = policy({"2": 100}, rules=[{"header": "X-Canary", "equals": "always", "version": "3"}])
    decision = choose(compiled, {b"x-canary": b"always", b"x-user-id": b"u1"}, 0)
    assert (decision.version, decision.reason) == ("3", Reason.RULE)
    other = choose(compiled, {b"x-canary": b"never"}, 0)
    assert (other.version, other.reason) == ("2", Reason.WEIGHTED)


def test_sticky_user_always_lands_on_the_same_version() -> None:
    compiled = policy({"2": 50, "3": 50})
    for user in (b"alice", b"bob", b"carol"):
        first = choose(compiled, {b"x-user-id": user}, 0)
        assert first.reason == Reason.STICKY
        assert all(choose(compiled, {b"x-user-id": user}, d).version == first.version
                   for d in range(0, BUCKETS, 997))


def test_sticky_header_name_comes_from_the_policy() -> None:
    compiled = policy({"2": 50, "3": 50}, sticky_header="X-Tenant")
    assert choose(compiled, {b"x-tenant": b"acme"}, 0).reason == Reason.STICKY
    assert choose(compiled, {b"x-user-id": b"acme"}, 0).reason == Reason.WEIGHTED


def test_raising_the_canary_never_moves_a_user_back_to_stable() -> None:
    keys = [f"user-{i}".encode() for i in range(20_000)]
    before = policy({"2": 95, "3": 5})
    after = policy({"2": 80, "3": 20})
    moved_back = moved_in = 0
    on_canary_after = 0
    for key in keys:
        old = choose(before, {b"x-user-id": key}, 0).version
        new = choose(after, {b"x-user-id": key}, 0).version
        moved_back += old == "3" and new == "2"
        moved_in += old == "2" and new == "3"
        on_canary_after += new == "3"
    assert moved_back == 0
    assert moved_in > 0
    assert abs(on_canary_after / len(keys) - 0.20) < 0.02


weights_strategy = st.integers(min_value=0, max_value=10_000).map(
    lambda canary: {"2": Decimal(10_000 - canary) / 100, "3": Decimal(canary) / 100})


@settings(max_examples=200, deadline=None)
@given(w1=st.integers(0, 10_000), w2=st.integers(0, 10_000), key=st.binary(min_size=1, max_size=40))
def test_sticky_growth_is_monotone_for_any_pair_of_weights(w1: int, w2: int, key: bytes) -> None:
    low, high = sorted((w1, w2))
    before = policy({"2": (10_000 - low) / 100, "3": low / 100})
    after = policy({"2": (10_000 - high) / 100, "3": high / 100})
    if choose(before, {b"x-user-id": key}, 0).version == "3":
        assert choose(after, {b"x-user-id": key}, 0).version == "3"


@settings(max_examples=200, deadline=None)
@given(weights=weights_strategy, draw=st.integers(0, BUCKETS - 1), key=st.binary(max_size=20))
def test_zero_weight_is_never_chosen_and_full_weight_always(weights: dict[str, Decimal], draw: int,
                                                            key: bytes) -> None:
    compiled = policy({v: float(w) for v, w in weights.items()})
    decision = choose(compiled, {b"x-user-id": key} if key else {}, draw)
    assert weights[decision.version] > 0  # type: ignore[index]
    assert decision == choose(compiled, {b"x-user-id": key} if key else {}, draw)


@pytest.mark.parametrize(("document", "message"), [
    ({"weights": {"2": 80, "3": 30}}, "sum to 100"),
    ({"weights": {"2": 80.001, "3": 19.999}}, "2 decimal places"),
    ({"weights": {"2": -10, "3": 110}}, "greater than or equal to 0"),
    ({"weights": {}}, "at least one version"),
    ({"weights": {"v 2": 100}}, "neither a version nor a model name"),  # "v2" is a model's name: see test_targets
    ({"weights": {"qc@v2": 100}}, "after '@' comes a version number"),
    ({"weights": {"0": 100}}, "a version is 1 to 19 digits"),
    ({"weights": {"2": 100}, "colour": "red"}, "Extra inputs"),
    ({"weights": {"2": 100}, "rules": [{"header": "x-canary", "equals": "a"}]}, "version"),
    ({"weights": {"2": 100}, "sticky_header": "bad header"}, "pattern"),
    ({"weights": {"2": 100}, "rules": [{"header": "x", "equals": "a", "version": "3"},
                                        {"header": "X", "equals": "a", "version": "2"}]}, "repeat"),
])
def test_invalid_policies_are_rejected_with_the_reason(document: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PolicySpec.model_validate(document)


def test_thirds_with_two_decimals_are_accepted() -> None:
    spec = PolicySpec.model_validate({"weights": {"1": 33.33, "2": 33.33, "3": 33.34}})
    assert spec.basis_points() == {"1": 3333, "2": 3333, "3": 3334}
    assert spec.document()["weights"] == {"1": 33.33, "2": 33.33, "3": 33.34}


def test_weyl_draw_stays_in_range() -> None:
    draw = WeylDraw(99)
    values = [draw() for _ in range(50_000)]
    assert min(values) >= 0 and max(values) < BUCKETS
    assert len(set(values)) > 9000


def test_an_unseeded_weyl_draw_starts_at_a_random_offset() -> None:
    """Anonymous traffic must not be aimable: a process's sequence does not start where another's
    (or a known one's) does. Ten fresh sequences, ten different starts (1e10 possible offsets)."""
    starts = {tuple(WeylDraw()() for _ in range(3)) for _ in range(10)}
    assert len(starts) == 10


def test_every_named_version_has_a_fallback_to_the_heaviest_other() -> None:
    compiled = policy({"1": 0, "2": 70, "3": 30}, rules=[{"header": "x", "equals": "y", "version": "4"}])
    assert {v: d.version for v, d in compiled.fallbacks.items()} == {"1": "2", "2": "3", "3": "2", "4": "2"}
    assert all(d.reason == Reason.FALLBACK for d in compiled.fallbacks.values())
    assert policy({"2": 100}).fallbacks == {}
