"""An audit event's before and after as a difference: the fields that changed, by path.

The audit trail keeps whole documents (a policy before and after a write); a reader wants the
one weight that moved, the rule that went. :func:`changes` walks both documents and names each
leaf that was added, removed or changed (``weights.3``, ``rules[1]``), leaving out the record's
own bookkeeping (revision, time of the write), which changes with every write.
"""

from __future__ import annotations

import json
from typing import Any

BOOKKEEPING = frozenset({"revision", "updated_at", "model"})
MISSING = object()


def changes(before: Any, after: Any) -> list[dict[str, Any]]:
    """``[{"path", "change": added|removed|changed, "before", "after", "words"}]`` in document order."""
    found: list[dict[str, Any]] = []
    _walk("", _bare(before), _bare(after), found)
    return found


def _bare(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {key: value for key, value in doc.items() if key not in BOOKKEEPING}
    return MISSING if doc is None else doc


def _walk(path: str, before: Any, after: Any, found: list[dict[str, Any]], whole: bool = False) -> None:
    """``whole``: a list item, added or removed as one (a rule is one thing, not four fields)."""
    if before == after:
        return
    if isinstance(before, dict) and isinstance(after, dict):
        for key in [*before, *(k for k in after if k not in before)]:
            _walk(f"{path}.{key}" if path else str(key), before.get(key, MISSING), after.get(key, MISSING), found)
        return
    if isinstance(before, list) and isinstance(after, list):
        for index in range(max(len(before), len(after))):
            _walk(f"{path}[{index}]", before[index] if index < len(before) else MISSING,
                  after[index] if index < len(after) else MISSING, found, whole=True)
        return
    if not whole and (before is MISSING and isinstance(after, dict) or after is MISSING and isinstance(before, dict)):
        side: Any = after if isinstance(after, dict) else before  # a section that came or went: each of its fields
        for key, value in side.items():
            _walk(f"{path}.{key}" if path else str(key), MISSING if before is MISSING else value,
                  value if before is MISSING else MISSING, found)
        return
    change = "added" if before is MISSING else "removed" if after is MISSING else "changed"
    entry = {"path": path or "document", "change": change, "before": None if before is MISSING else before,
             "after": None if after is MISSING else after}
    entry["words"] = _words(entry)
    found.append(entry)


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(", ", ": "))
    return text if len(text) <= 200 else text[:197] + "..."


def _words(entry: dict[str, Any]) -> str:
    if entry["change"] == "added":
        return f"{entry['path']}: added {_shown(entry['after'])}"
    if entry["change"] == "removed":
        return f"{entry['path']}: removed (was {_shown(entry['before'])})"
    return f"{entry['path']}: {_shown(entry['before'])} -> {_shown(entry['after'])}"
