"""The target vocabulary (gateway/policy.py): a target is a version of the called model, another
model, or a version of another model, on the default fleet or a named one; one spelling each,
validated, ordered for sticky layouts."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.policy import (
    PolicySpec,
    TargetName,
    canonical_target,
    heaviest,
    own_model_twice,
    parse_target,
    target_order,
    without_version,
)
from gateway.policy_book import PolicyBook
from gateway.routing import BUCKETS, bucket, choose, compile_policy, layout


@pytest.mark.parametrize(("key", "read"), [
    ("3", TargetName(None, None, "3")),
    ("green:3", TargetName("green", None, "3")),
    ("default:3", TargetName(None, None, "3")),
    ("qc_2026_12", TargetName(None, "qc_2026_12", None)),
    ("qc_2026_12@2", TargetName(None, "qc_2026_12", "2")),
    ("green:qc_2026_12@2", TargetName("green", "qc_2026_12", "2")),
    ("default:qc_2026_12", TargetName(None, "qc_2026_12", None)),
    ("v2", TargetName(None, "v2", None)),  # a model called v2: the version 2 is "2"
    ("3d-detector.onnx", TargetName(None, "3d-detector.onnx", None)),
    # The spelling the issue sketched reads as it did before model targets: version 2 on a fleet
    # named qc_2026_12 (the fleet check at PUT time says how to name a model's version instead).
    ("qc_2026_12:2", TargetName("qc_2026_12", None, "2")),
])
def test_each_spelling_reads_one_way(key: str, read: TargetName) -> None:
    assert parse_target(key) == read
    assert parse_target(read.key) == read  # the canonical spelling reads back the same


@pytest.mark.parametrize(("key", "message"), [
    ("0", "a version is 1 to 19 digits"),
    ("007", "a version is 1 to 19 digits"),
    ("1" * 20, "a version is 1 to 19 digits"),
    ("qc@", "after '@' comes a version number"),
    ("qc@0", "after '@' comes a version number"),
    ("qc@latest", "after '@' comes a version number"),
    ("Green:3", "is not a fleet name"),
    (":3", "is not a fleet name"),
    ("a:b:3", "neither a version nor a model name"),
    ("..", "neither a version nor a model name"),
    (".", "neither a version nor a model name"),
    ("q c", "neither a version nor a model name"),
    ("qc/2", "neither a version nor a model name"),
    ("qc@2@3", "after '@' comes a version number"),
    ("x" * 129, "neither a version nor a model name"),
    ("", "neither a version nor a model name"),
])
def test_what_is_not_a_target_is_refused_saying_why(key: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(key)


def test_a_policy_keeps_the_canonical_spelling_and_refuses_one_target_twice() -> None:
    spec = PolicySpec.model_validate({"weights": {"default:qc_2026_12@2": 20, "qc": 80}})
    assert list(spec.weights) == ["qc_2026_12@2", "qc"]
    with pytest.raises(ValidationError, match="name one target twice"):
        PolicySpec.model_validate({"weights": {"default:qc_2026_12": 20, "qc_2026_12": 80}})
    with pytest.raises(ValidationError, match="after '@'"):
        PolicySpec.model_validate({"weights": {"qc": 100}, "rules": [{"header": "x", "equals": "1",
                                                                      "version": "qc@x"}]})
    with pytest.raises(ValidationError, match="is not a fleet name"):
        PolicySpec.model_validate({"weights": {"qc": 100}, "shadow": {"version": "Blue:qc", "percent": 5}})


def test_the_models_own_name_at_a_version_is_that_version() -> None:
    both = PolicySpec.model_validate({"weights": {"3": 50, "qc@3": 50}})
    assert own_model_twice("qc", both) == ("weights name one target twice: '3' and 'qc@3' (qc@N is version N of qc "
                                           "itself: write N)")
    assert own_model_twice("other", both) is None  # in another model's policy, qc@3 is a model of its own
    assert own_model_twice("qc", PolicySpec.model_validate({"weights": {"qc": 50, "3": 50}})) is None


def test_order_keeps_versions_as_they_were_and_puts_model_names_after_them_by_name() -> None:
    keys = ["qc_2026_12@2", "qc", "green:3", "3", "qc_2026_11", "12", "qc_2026_12", "green:qc_2026_12@2"]
    assert sorted(keys, key=target_order) == ["3", "green:3", "12", "qc", "qc_2026_11", "qc_2026_12",
                                              "qc_2026_12@2", "green:qc_2026_12@2"]
    assert heaviest({"qc": Decimal(50), "qc_2026_12": Decimal(50)}) == "qc_2026_12"  # a tie: the newer name


def test_sticky_layout_puts_the_newest_name_first() -> None:
    assert layout({"qc": 8000, "qc_2026_12": 2000}) == ((2000, "qc_2026_12"), (10000, "qc"))
    assert layout({"3": 5000, "qc_2026_12": 5000}) == ((5000, "qc_2026_12"), (10000, "3"))


@given(canary=st.integers(0, BUCKETS), more=st.integers(0, BUCKETS), key=st.binary(min_size=1, max_size=40))
def test_raising_a_renamed_canary_only_moves_users_into_it(canary: int, more: int, key: bytes) -> None:
    """Three targets, two of them other models: as the newest name grows (taking from the oldest),
    every user it had keeps it (the older targets' ranges move: as with versions, only the
    newest target's growth is monotone)."""
    middle = 1000
    low, high = sorted((min(canary, BUCKETS - middle), min(canary + more, BUCKETS - middle)))

    def policy(canary_bp: int) -> PolicySpec:
        return PolicySpec.model_validate({"weights": {"qc_2026_12": Decimal(canary_bp) / 100,
                                                      "qc_2026_11": Decimal(middle) / 100,
                                                      "qc": Decimal(BUCKETS - middle - canary_bp) / 100}})

    before = choose(compile_policy("qc", policy(low)), {b"x-user-id": key}, 0).version
    after = choose(compile_policy("qc", policy(high)), {b"x-user-id": key}, 0).version
    if before == "qc_2026_12":
        assert after == "qc_2026_12"


def test_a_users_bucket_is_the_called_models_whatever_the_targets() -> None:
    """Stickiness hashes the name the client called: renaming targets moves nobody."""
    versions = compile_policy("qc", PolicySpec.model_validate({"weights": {"2": 80, "3": 20}}))
    names = compile_policy("qc", PolicySpec.model_validate({"weights": {"qc": 80, "qc_2026_12": 20}}))
    for user in (b"alice", b"bob", b"carol", b"dave", b"erin"):
        first = choose(versions, {b"x-user-id": user}, 0).version
        second = choose(names, {b"x-user-id": user}, 0).version
        assert (first == "3") == (second == "qc_2026_12") == (bucket("qc", user) < 2000)


def test_taking_a_model_target_out_gives_its_weight_to_the_heaviest_other() -> None:
    spec = PolicySpec.model_validate({"weights": {"qc": 70, "qc_2026_12": 30},
                                      "rules": [{"header": "x", "equals": "1", "version": "qc_2026_12"}]})
    left = without_version(spec, "qc_2026_12")
    assert left.document()["weights"] == {"qc": 100} and not left.rules


def test_canonical_target_drops_only_the_default_fleet() -> None:
    assert canonical_target("default:qc@2") == "qc@2"
    assert canonical_target("blue:qc@2") == "blue:qc@2"
    assert parse_target("qc_2026_12@2").renames("qc") and not parse_target("qc@2").renames("qc")
    assert not parse_target("3").renames("qc")


def test_the_book_knows_which_models_answer_metadata_for_another_name() -> None:
    def spec(weights: dict[str, int]) -> PolicySpec:
        return PolicySpec.model_validate({"weights": weights})

    book = PolicyBook()
    book.put("alias", spec({"qc_2026_12@2": 100}), 1)
    book.put("qc", spec({"2": 100}), 1)
    alias = book.get("alias")
    assert book.renamed_stables == {"alias"} and alias is not None
    assert alias.renamed_stable == parse_target("qc_2026_12@2")
    book.put("qc", spec({"qc_2026_12": 60, "2": 40}), 2)
    book.put("alias", spec({"qc": 100}), 2)  # a stable naming the policy's own model renames nothing
    assert book.renamed_stables == {"qc", "alias"}
    book.put("alias", spec({"alias@3": 100}), 3)
    book.remove("qc", 3)
    assert book.renamed_stables == frozenset()
    book.override("qc", spec({"qc_2026_12": 100}))
    assert book.renamed_stables == {"qc"}


def test_auto_sequence_affinity_follows_the_models_the_targets_name() -> None:
    book = PolicyBook()
    book.set_sequence_models({"seq"})
    book.put("counter", PolicySpec.model_validate({"weights": {"seq@1": 50, "seq@2": 50}}), 1)
    book.put("qc", PolicySpec.model_validate({"weights": {"qc": 50, "qc_2026_12": 50}}), 1)

    def affinity(model: str) -> bool:
        policy = book.get(model)
        assert policy is not None
        return policy.sequence_affinity

    assert affinity("counter") and not affinity("qc")
    book.set_sequence_models({"qc_2026_12"})
    assert not affinity("counter") and affinity("qc")
