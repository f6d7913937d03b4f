"""Issue 33 (friction 6): an audit entry's before and after shown as what changed."""

from __future__ import annotations

from gateway.store.changes import changes


def words(before: object, after: object) -> list[str]:
    return [entry["words"] for entry in changes(before, after)]


def test_a_weights_change_is_the_weights_that_moved_without_the_bookkeeping() -> None:
    before = {"model": "qc", "weights": {"2": 70, "3": 30}, "rules": [], "revision": 4, "updated_at": 1.0}
    after = {"model": "qc", "weights": {"2": 100}, "rules": [], "revision": 5, "updated_at": 2.0}
    assert words(before, after) == ["weights.2: 70 -> 100", "weights.3: removed (was 30)"]
    assert changes(before, after)[1] == {"path": "weights.3", "change": "removed", "before": 30, "after": None,
                                         "words": "weights.3: removed (was 30)"}


def test_a_dropped_header_rule_is_named_whole() -> None:
    rule = {"header": "x-canary", "equals": "always", "version": "3"}
    before = {"weights": {"2": 100}, "rules": [rule], "sticky_header": None}
    after = {"weights": {"2": 100}, "rules": [], "sticky_header": "x-user"}
    assert words(before, after) == [
        'rules[0]: removed (was {"equals": "always", "header": "x-canary", "version": "3"})',
        'sticky_header: null -> "x-user"']


def test_a_created_and_a_deleted_policy_list_their_fields() -> None:
    policy = {"model": "qc", "weights": {"2": 90, "3": 10}, "revision": 1}
    assert words(None, policy) == ["weights.2: added 90", "weights.3: added 10"]
    assert words(policy, None) == ["weights.2: removed (was 90)", "weights.3: removed (was 10)"]
    assert changes(None, None) == [] and changes(policy, policy) == []
