"""The configuration reference, generated from the Settings model (docs/configuration.md embeds it)."""

from __future__ import annotations

import json

from pydantic_core import PydanticUndefined

from gateway.settings import Settings

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


def _default(field: object) -> str:
    default = getattr(field, "default", PydanticUndefined)
    factory = getattr(field, "default_factory", None)
    if default is PydanticUndefined:
        default = factory() if factory else None
    if default is None:
        return "unset"
    return f"`{json.dumps(default) if isinstance(default, (dict, list, bool)) else default}`"


def markdown() -> str:
    rows = ["| variable | YAML key | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        rows.append(f"| `GATEWAY_{name.upper()}` | `{name}` | {_default(field)} | {field.description or ''} |")
    return "\n".join(rows)


def embedded(readme: str) -> str:
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
