"""Reading stored policy documents: lenient where the admin API is strict.

The API refuses a field it does not know (a typo must not pass silently), but a stored
record may have been written by a *newer* replica during a rolling upgrade (as ``shadow``,
``sequence_affinity`` and ``keep_previous`` once were). Refusing it would stop this
replica's sync; so unknown fields are dropped with one warning per field, and only a record
that is still invalid without them is corrupt.

Policies are stored with a ``format`` number. Format 1 (no number) is from before
``sequence_affinity`` could say ``auto``: its ``false`` was the old default, written into
every policy whether anyone chose it or not, so it reads as ``auto`` (the new default, on
only for models Triton batches sequences for); ``true`` stays forced on. From format 2 on,
``false`` is what an SRE wrote and stays off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import CorruptRecord
from gateway.policy import PolicySpec

log = logging.getLogger("gateway.store")
M = TypeVar("M", bound=BaseModel)
_warned: set[str] = set()  # field paths already reported: one warning per field per process


def load_json(raw: str | bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptRecord(f"{what} is not valid JSON: {exc}") from None


STORED_FORMAT = 2


def stored_spec(spec: PolicySpec) -> dict[str, Any]:
    """The document a store keeps for a policy."""
    return {**spec.document(), "format": STORED_FORMAT}


def spec_from_document(doc: Any, what: str) -> PolicySpec:
    """A PolicySpec from a stored document, ignoring fields this version does not know."""
    if isinstance(doc, dict):
        doc = dict(doc)
        if doc.pop("format", 1) == 1 and doc.get("sequence_affinity") is False:
            doc["sequence_affinity"] = "auto"  # the old default, not a choice (see the module's note)
    return lenient_model(PolicySpec, doc, what)


class SpecCache:
    """The spec last read from each model's stored text. A store's periodic full resync reads
    every record; parsing (pydantic validation) was most of its cost, 0.3-0.5 s a pass at 5,000
    models: now only a record whose text changed is parsed again, and a text another model's
    record has too is parsed once (a startup read 5,000 records, most of them a few policies
    alike, and validated each one). Specs are immutable, so the one read earlier is the same
    value. Holds one entry per stored model and per distinct text (:meth:`keep_only`)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str | bytes, PolicySpec]] = {}
        self._by_text: dict[str | bytes, PolicySpec] = {}

    def spec(self, model: str, raw: str | bytes, what: str) -> PolicySpec:
        kept = self._last.get(model)
        if kept is not None and kept[0] == raw:
            return kept[1]
        spec = self._by_text.get(raw)
        if spec is None:
            spec = spec_from_document(load_json(raw, what), what)
            if len(self._by_text) > 2 * len(self._last) + 64:  # texts no record has any more (few full reads)
                self._by_text = {text: kept_spec for text, kept_spec in self._last.values()}
            self._by_text[raw] = spec
        self._last[model] = (raw, spec)
        return spec

    def keep_only(self, models: Iterable[str]) -> None:
        """Forget the models a full read no longer found, and the texts no model has now."""
        self._last = {model: self._last[model] for model in models if model in self._last}
        self._by_text = {raw: spec for raw, spec in self._last.values()}


def lenient_model(model: type[M], doc: Any, what: str) -> M:
    """``model`` (a strict pydantic model) from a stored document, ignoring fields this
    version does not know; CorruptRecord if it is still invalid without them."""
    if not isinstance(doc, dict):
        raise CorruptRecord(f"{what}: not a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        unknown = [err["loc"] for err in exc.errors() if err["type"] == "extra_forbidden"]
        if not unknown or len(unknown) != len(exc.errors()):
            raise CorruptRecord(f"{what} cannot be read: {_describe(exc)}") from None
    for loc in unknown:
        _drop(doc, loc)
        path = model.__name__ + "." + ".".join("*" if isinstance(part, int) else str(part) for part in loc)
        if path not in _warned:
            _warned.add(path)
            log.warning("%s has a field this version does not know, '%s' (written by a newer gateway?): "
                        "ignored", what, path.split(".", 1)[1])
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise CorruptRecord(f"{what} cannot be read: {_describe(exc)}") from None


def record_field(doc: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """One envelope field (revision, updated_at, ...) of a stored record, type-checked."""
    value = doc.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CorruptRecord(f"{what}: field '{name}' is missing or not a {kind.__name__}")
    return value


def _drop(doc: Any, loc: tuple[int | str, ...]) -> None:
    for part in loc[:-1]:
        doc = doc[part]
    del doc[loc[-1]]


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'policy'}: {err['msg']}" for err in exc.errors())
