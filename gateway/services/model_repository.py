"""A model's ``config.pbtxt`` as it is now in the model repository, read by the gateway itself.

Why the gateway reads the repository: Triton selects the versions of a model only through a
``config`` override of the *whole* configuration (the override is parsed into an empty
``ModelConfig``: ``InitializeModelInfo`` and ``JsonToModelConfig`` in triton-inference-server/
core, ``src/model_repository_manager/model_repository_manager.cc`` and ``src/model_config_utils.cc``),
its API has no call that reads ``config.pbtxt`` without loading it, and ``GET .../config``
answers the configuration Triton loaded, which after one override stays the override (a load
without override is then a no-op until a file of the model is newer than that override:
core commit b487627). Reading the file is the only way to know what a load without override
would serve (its ``version_policy`` over the version folders) and to send, when a version set
must be selected, ``config.pbtxt`` as it is now rather than what Triton last loaded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.pbtxt"


class RepositoryUnreadable(Exception):
    """The model's config.pbtxt could not be read or parsed; the message says why."""


@dataclass(frozen=True)
class RepositoryModel:
    path: Path  # the config.pbtxt read
    config: dict[str, Any]  # Triton's JSON form of it (proto field names), version_policy as written
    versions: frozenset[str]  # what Triton serves after a load without override


def served_versions(policy: dict[str, Any], folders: set[int]) -> frozenset[str]:
    """The versions a ``version_policy`` selects among the numeric version folders (Triton's
    default is ``latest { num_versions: 1 }``)."""
    if "all" in policy:
        chosen = folders
    elif "specific" in policy:
        chosen = {int(v) for v in policy["specific"].get("versions", [])} & folders
    else:
        count = int(policy.get("latest", {}).get("num_versions", 1))
        chosen = set(sorted(folders)[-count:]) if count > 0 else set()
    return frozenset(str(v) for v in chosen)


def _version_folders(model_dir: Path) -> set[int]:
    return {int(entry.name) for entry in model_dir.iterdir()
            if entry.is_dir() and entry.name.isdigit() and not entry.name.startswith("0")}


def read_model(root: Path, model: str) -> RepositoryModel:
    """``root/model/config.pbtxt`` parsed with Triton's own ``ModelConfig`` proto (shipped by
    tritonclient); RepositoryUnreadable if it is missing, unreadable or not a valid config."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    if model in (".", "..") or "/" in model:
        raise RepositoryUnreadable(f"'{model}' is not a model folder name")
    model_dir = root / model
    path = model_dir / CONFIG_FILE
    try:
        text = path.read_text()
        folders = _version_folders(model_dir)
    except OSError as exc:
        raise RepositoryUnreadable(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise RepositoryUnreadable(f"{path} is not a model configuration this gateway can read: {exc}") from exc
    config = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    return RepositoryModel(path, config, served_versions(config.get("version_policy", {}), folders))


async def read_model_async(root: Path, model: str) -> RepositoryModel:
    """:func:`read_model` off the event loop (the repository may be a network volume)."""
    return await asyncio.to_thread(read_model, root, model)
