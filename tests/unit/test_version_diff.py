"""Issue 33 (friction 6): what differs between a version and the stable one: Triton's configuration
field by field, and the version folders' files where the gateway reads the model repository."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gateway.services.version_diff import FileDigests, VersionDifferences, stable_of

CONFIG = {"name": "qc", "backend": "python", "max_batch_size": 8, "version_policy": {"specific": {"versions": [2]}},
          "instance_group": [{"kind": "KIND_CPU", "count": 1}]}


class Server:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeTriton:
    """The two calls the comparison makes: which servers a target's fleet has, and a config read."""

    def __init__(self, configs: dict[str, dict[str, Any]]) -> None:
        self.configs = configs
        self.asked: list[str] = []

    def servers_of(self, key: str) -> list[Server]:
        return [Server("triton-a")]

    async def call_on(self, server: Server, method: bytes, path: str, body: Any = None,
                      timeout_s: float | None = None) -> tuple[int, Any]:
        self.asked.append(path)
        model = path.split("/")[3]
        return (200, self.configs[model]) if model in self.configs else (400, {"error": f"no model {model}"})


def repository(tmp_path: Path) -> Path:
    for model, version, files in (("qc", "2", {"model.py": "v = 2", "labels.txt": "a"}),
                                  ("qc", "3", {"model.py": "v = 3", "labels.txt": "a", "extra.bin": "x"}),
                                  ("qc_2026_12", "2", {"model.py": "v = 2", "labels.txt": "a"})):
        folder = tmp_path / model / version
        folder.mkdir(parents=True)
        (folder / "__pycache__").mkdir()
        (folder / "__pycache__" / "model.pyc").write_text("compiled")
        for name, text in files.items():
            (folder / name).write_text(text)
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"')
    return tmp_path


async def test_two_versions_of_one_model_share_a_config_and_differ_in_their_files(tmp_path: Path) -> None:
    triton = FakeTriton({"qc": CONFIG})
    found = await VersionDifferences(triton, repository(tmp_path)).compare("qc", "3", "2")  # type: ignore[arg-type]
    assert found["config"]["same"] is True and "Triton keeps one per model" in found["config"]["note"]
    assert triton.asked == []  # nothing to ask: one configuration per model
    files = found["files"]
    assert files["readable"] and files["same"] == 1
    assert files["differing"] == [{"path": "extra.bin", "change": "only in version 3 of qc"},
                                  {"path": "model.py", "change": "changed"}]
    assert files["summary"] == "2 file(s) differ from version 2 of qc, 1 the same"


async def test_a_target_of_another_model_is_compared_field_by_field(tmp_path: Path) -> None:
    other = {**CONFIG, "name": "qc_2026_12", "max_batch_size": 16,
             "instance_group": [{"kind": "KIND_CPU", "count": 2}], "dynamic_batching": {}}
    triton = FakeTriton({"qc": CONFIG, "qc_2026_12": other})
    found = await VersionDifferences(triton, repository(tmp_path)).compare(  # type: ignore[arg-type]
        "qc", "qc_2026_12@2", "2")
    config = found["config"]
    assert config["same"] is False
    assert [f["field"] for f in config["fields"]] == ["instance_group", "max_batch_size", "dynamic_batching"]
    assert config["fields"][0]["words"] == ("canary runs 2 instances (KIND_CPU), stable 1 instance (KIND_CPU)")
    assert "name" not in {c["path"] for c in config["all"]}  # the model's own name is not the version's
    assert found["files"]["differing"] == [{"path": "../config.pbtxt", "change": "changed"}]


async def test_nothing_read_says_why(tmp_path: Path) -> None:
    triton = FakeTriton({"qc": CONFIG})
    unread = await VersionDifferences(triton, None).compare("qc", "qc_2026_12@2", "2")  # type: ignore[arg-type]
    assert unread["config"]["note"].startswith("not compared: Triton server triton-a answered")
    assert unread["files"] == {"readable": False, "why": "the gateway does not read the model repository "
                               "(model_repository is not set): only Triton's configuration is compared"}
    missing = await VersionDifferences(triton, repository(tmp_path)).compare("qc", "9", "2")  # type: ignore[arg-type]
    assert not missing["files"]["readable"] and "not compared" in missing["files"]["why"]


def test_a_file_is_hashed_again_only_when_it_changes(tmp_path: Path) -> None:
    digests = FileDigests()
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    first = digests.digest(path)
    os.utime(path, ns=(1, 1))
    path.write_bytes(b"b" * 1000)  # same size, new mtime: hashed again
    assert digests.digest(path) != first
    hashed = digests.digest(path)
    with open(path, "r+b") as handle:  # same size, mtime put back: taken as unchanged (what the cache trusts)
        stat = path.stat()
        handle.write(b"c")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digests.digest(path) == hashed


def test_the_default_comparison_is_the_stable() -> None:
    assert stable_of("3", None, {"stable": "2", "state": "progressing"}, ["2", "3"])[0] == "2"
    promoted = {"stable": "2", "state": "promoted"}  # its stable was the stable before it: 3 is now
    assert stable_of("2", {"weights": {"3": 100}}, promoted, ["2", "3"])[0] == "3"
    assert stable_of("3", {"weights": {"1": 10, "2": 90}}, None, []) == ("2", "the version the policy sends most "
                                                                                 "traffic to")
    assert stable_of("3", None, None, ["1", "3", "2"])[0] == "2"
    assert stable_of("3", {"weights": {"3": 100}}, None, ["3"])[0] is None
