"""What each server of a fleet serves as one model: its loaded configuration, and (where the
gateway reads the model repository) a digest of the version's files.

Triton answers ``GET /v2/models/{model}/config`` with the configuration it loaded, which after a
``config`` override (an admin's, or an earlier gateway reload) stays that override until the
model is loaded again: two servers of a fleet can serve "version 3" as two different things.
Reading it costs one call per server of the target's fleet, for the rollout's models only (through
the server's shared reads, ``gateway.fleet.reads``).
The digest covers the version folder's files and ``config.pbtxt`` as they are now, so a
rollout can tell that the files it started with changed under it.
"""

from __future__ import annotations

import asyncio
import hashlib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.errors import GatewayError
from gateway.services.engine_stats import StatsCalls, read_json, target_of

MAX_FILES = 10_000  # a version folder larger than this is not hashed (said so), never walked for ever


@dataclass(frozen=True)
class ServerConfigs:
    """A model's configuration per server of one target's fleet, and the servers that could not say."""

    configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # server -> Triton's JSON config
    unreadable: Mapping[str, str] = field(default_factory=dict)  # server -> why


async def read_configs(control: StatsCalls, model: str, target: str, timeout_s: float) -> ServerConfigs:
    """The loaded configuration of the model ``target`` (a target key of ``model``'s policy) names,
    on every server of its fleet, concurrently."""
    try:
        servers = control.servers_of(target)
        named = target_of(model, target)[0]
    except GatewayError as exc:
        return ServerConfigs({}, {"*": exc.message})
    except ValueError as exc:
        return ServerConfigs({}, {"*": str(exc)})
    path = f"/v2/models/{urllib.parse.quote(named, safe='')}/config"

    answers = await asyncio.gather(*(read_json(control, server, path, timeout_s) for server in servers))
    configs = {server.name: answer for server, answer in zip(servers, answers, strict=True)
               if not isinstance(answer, str)}
    unreadable = {server.name: answer for server, answer in zip(servers, answers, strict=True)
                  if isinstance(answer, str)}
    return ServerConfigs(configs, unreadable)


def version_digest(root: Path, model: str, version: str) -> dict[str, str]:
    """sha256 per file of ``root/model/version/`` and of ``root/model/config.pbtxt`` (relative
    paths as keys); raises OSError when the folder cannot be read."""
    if model in (".", "..") or "/" in model or not version.isdigit():
        raise OSError(f"'{model}/{version}' is not a model version folder")
    model_dir = root / model
    found: dict[str, str] = {}
    files = [model_dir / "config.pbtxt", *sorted(p for p in (model_dir / version).rglob("*")
                                                  if p.is_file() and "__pycache__" not in p.parts)]
    if len(files) > MAX_FILES:
        raise OSError(f"{model_dir / version} holds more than {MAX_FILES} files: not hashed")
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        found[str(path.relative_to(model_dir))] = digest.hexdigest()
    return found


async def version_digest_async(root: Path, model: str, version: str) -> dict[str, str]:
    """:func:`version_digest` off the event loop (the repository may be a network volume)."""
    return await asyncio.to_thread(version_digest, root, model, version)


def changed_files(before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The files added, removed or changed between two digests, by name."""
    return sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name))
