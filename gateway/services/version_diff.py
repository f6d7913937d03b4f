"""What differs between a version and the stable one: Triton's configuration, field by field, and
the files of both version folders where the gateway reads the model repository.

Triton keeps one configuration per model, so two versions of one model on one fleet share it (the
answer says so rather than showing an empty table); versions on other fleets (``green:3``) or of
other models (``qc_2026_12@2``) are read from their own fleet's servers. The files are compared by
SHA-256, each file's digest kept while its size and modification time stay the same, so the
console's page (read every 2 s) hashes a model's files once, not on every look.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import GatewayError
from gateway.policy import TargetName, parse_target
from gateway.rollout.config_diff import differences
from gateway.services.triton_control import TritonControl
from gateway.store.changes import changes

MAX_FILES = 10_000  # a version folder larger than this is not compared (said so), never walked for ever
CONFIG_FILE = "config.pbtxt"
NOT_COMPARED = ("name", "version_policy")  # the model's own name, which versions it serves: not the version's


@dataclass(frozen=True)
class Side:
    """One side of the comparison: the target key, the model and version it names."""

    key: str
    model: str
    version: str
    fleet: str | None

    @classmethod
    def of(cls, model: str, key: str) -> Side:
        target: TargetName = parse_target(key)
        return cls(key, target.model or model, target.version or "", target.fleet)

    @property
    def shown(self) -> str:
        where = f" on fleet {self.fleet}" if self.fleet else ""
        return f"version {self.version} of {self.model}{where}"


class FileDigests:
    """SHA-256 per file, kept while (size, mtime) stay the same; the oldest entries go past ``size``."""

    def __init__(self, size: int = 50_000) -> None:
        self.size = size
        self._kept: OrderedDict[str, tuple[int, int, str]] = OrderedDict()

    def digest(self, path: Path) -> str:
        stat = path.stat()
        key = str(path)
        kept = self._kept.get(key)
        if kept is not None and kept[:2] == (stat.st_size, stat.st_mtime_ns):
            self._kept.move_to_end(key)
            return kept[2]
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        self._kept[key] = (stat.st_size, stat.st_mtime_ns, digest.hexdigest())
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return digest.hexdigest()

    def folder(self, folder: Path) -> dict[str, str]:
        """Relative path -> digest of every file under ``folder`` (``__pycache__`` left out)."""
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder")
        found: dict[str, str] = {}
        for base, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if len(found) >= MAX_FILES:
                    raise OSError(f"{folder} holds more than {MAX_FILES} files: not compared")
                path = Path(base) / name
                found[str(path.relative_to(folder))] = self.digest(path)
        return found


class VersionDifferences:
    def __init__(self, triton: TritonControl, repository: Path | None, timeout_s: float = 5.0) -> None:
        self.triton = triton
        self.repository = repository
        self.timeout_s = timeout_s
        self.digests = FileDigests()

    def has_folder(self, model: str, version: str = "") -> bool:
        """Whether the model repository (when the gateway reads it) has the model's, or the
        version's, folder: a version Triton does not list may still be there, not loaded."""
        root = self.repository
        if root is None or model in (".", "..") or "/" in model or "/" in version or version in (".", ".."):
            return False
        return (root / model / version).is_dir()

    async def compare(self, model: str, version: str, against: str) -> dict[str, Any]:
        mine, theirs = Side.of(model, version), Side.of(model, against)
        config, files = await asyncio.gather(self._configs(mine, theirs), asyncio.to_thread(self._files, mine, theirs))
        return {"config": config, "files": files}

    async def _config(self, side: Side) -> dict[str, Any]:
        servers = self.triton.servers_of(side.key)
        if not servers:
            raise GatewayError(f"the fleet of {side.shown} has no servers")
        path = f"/v2/models/{urllib.parse.quote(side.model, safe='')}/config"
        status, body = await self.triton.call_on(servers[0], b"GET", path, timeout_s=self.timeout_s)
        if status != 200 or not isinstance(body, dict):
            why = body.get("error") if isinstance(body, dict) else body
            raise GatewayError(f"Triton server {servers[0].name} answered {path} with {status}: {why}")
        return body

    async def _configs(self, mine: Side, theirs: Side) -> dict[str, Any]:
        if (mine.model, mine.fleet) == (theirs.model, theirs.fleet):
            return {"same": True, "fields": [], "all": [],
                    "note": f"the same configuration: Triton keeps one per model, and versions {mine.version} and "
                            f"{theirs.version} of {mine.model} share it (a version with another configuration is a "
                            "model of its own, or on a fleet of its own)"}
        try:
            canary, stable = await asyncio.gather(self._config(mine), self._config(theirs))
        except (GatewayError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, GatewayError) else "no answer in time"
            return {"same": None, "fields": [], "all": [], "note": f"not compared: {why}"}
        fields = [difference.document() for difference in differences(stable, canary)]
        every = changes({k: v for k, v in stable.items() if k not in NOT_COMPARED},
                        {k: v for k, v in canary.items() if k not in NOT_COMPARED})
        note = (f"{len(fields)} field(s) that change how it performs differ from {theirs.shown}" if fields else
                f"no field that changes how it performs differs from {theirs.shown}")
        return {"same": not every, "fields": fields, "all": every, "note": note}

    def _files(self, mine: Side, theirs: Side) -> dict[str, Any]:
        if self.repository is None:
            return {"readable": False, "why": "the gateway does not read the model repository (model_repository is "
                                              "not set): only Triton's configuration is compared"}
        if mine.fleet or theirs.fleet:
            return {"readable": False, "why": "model_repository is the default fleet's: the files of a version on "
                                              "a named fleet are not read"}
        root = self.repository
        try:
            new = self.digests.folder(root / mine.model / mine.version)
            old = self.digests.folder(root / theirs.model / theirs.version)
            if mine.model != theirs.model:  # each model's own config.pbtxt (one model's versions share theirs)
                new[f"../{CONFIG_FILE}"] = self.digests.digest(root / mine.model / CONFIG_FILE)
                old[f"../{CONFIG_FILE}"] = self.digests.digest(root / theirs.model / CONFIG_FILE)
        except OSError as exc:
            return {"readable": False, "why": f"not compared: {exc.strerror or exc}" + (
                f" ({exc.filename})" if getattr(exc, "filename", None) else "")}
        differing = []
        for path in sorted(set(new) | set(old)):
            if path not in old:
                differing.append({"path": path, "change": f"only in {mine.shown}"})
            elif path not in new:
                differing.append({"path": path, "change": f"only in {theirs.shown}"})
            elif new[path] != old[path]:
                differing.append({"path": path, "change": "changed"})
        same = len(set(new) & set(old)) - sum(1 for d in differing if d["change"] == "changed")
        summary = (f"{len(differing)} file(s) differ from {theirs.shown}, {same} the same" if differing else
                   f"every file is the same as in {theirs.shown} ({same} file(s))")
        return {"readable": True, "differing": differing, "same": same, "summary": summary,
                "folders": [str(root / mine.model / mine.version), str(root / theirs.model / theirs.version)]}


def stable_of(version: str, policy: dict[str, Any] | None, rollout: dict[str, Any] | None,
              ready: list[str]) -> tuple[str | None, str]:
    """What a version is compared with by default, and why: the stable of the model's rollout, else
    the version its policy weighs most, else Triton's newest READY version; never itself."""
    running = rollout is not None and rollout.get("state") in ("progressing", "paused", "rolling_back")
    if running and rollout is not None and rollout.get("stable") and rollout["stable"] != version:
        return str(rollout["stable"]), f"the stable version of the model's {rollout['state']} rollout"
    weights = {v: w for v, w in ((policy or {}).get("weights") or {}).items() if w and v != version}
    if weights:
        heaviest = max(weights, key=lambda v: weights[v])
        return heaviest, "the version the policy sends most traffic to"
    others = sorted((v for v in ready if v != version and v.isdigit()), key=int)
    if others:
        return others[-1], ("Triton's newest READY version (the model has no policy)" if policy is None else
                            "Triton's newest READY version (the policy sends no traffic to another version)")
    return None, "nothing to compare with: no other version is READY, and no policy or rollout names one"
