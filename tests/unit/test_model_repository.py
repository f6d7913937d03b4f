"""Reading config.pbtxt the way Triton would (gateway/services/model_repository.py): the versions a
load without override serves, and the configuration sent when a version set must be chosen."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.devtools.local_triton import SAMPLE_REPOSITORY
from gateway.services.model_repository import RepositoryUnreadable, read_model, served_versions


@pytest.mark.parametrize(("policy", "served"), [
    ({}, {"5"}),  # Triton's default: latest { num_versions: 1 }
    ({"latest": {"num_versions": 2}}, {"3", "5"}),
    ({"latest": {"num_versions": 9}}, {"1", "3", "5"}),
    ({"all": {}}, {"1", "3", "5"}),
    ({"specific": {"versions": ["1", "5"]}}, {"1", "5"}),  # int64 in Triton's JSON may be strings
    ({"specific": {"versions": [1, 2]}}, {"1"}),  # no folder 2: Triton serves no version 2
])
def test_the_versions_a_version_policy_serves(policy: dict[str, object], served: set[str]) -> None:
    assert served_versions(policy, {1, 3, 5}) == served


def test_the_sample_config_reads_as_triton_would() -> None:
    found = read_model(SAMPLE_REPOSITORY, "qc")
    assert found.path == SAMPLE_REPOSITORY / "qc" / "config.pbtxt"
    assert found.versions == {"1", "2", "3"}
    assert found.config["max_batch_size"] == 8
    assert found.config["input"][0]["name"] == "INPUT0" and found.config["backend"] == "python"


def test_version_folders_are_positive_numbers_only(tmp_path: Path) -> None:
    model = tmp_path / "m"
    for name in ("1", "02", "x", "7"):
        (model / name).mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nversion_policy: { all { } }\n')
    assert read_model(tmp_path, "m").versions == {"1", "7"}


@pytest.mark.parametrize(("model", "content", "reason"), [
    ("absent", None, "cannot read"),
    ("broken", "max_batch_size: eight\n", "is not a model configuration"),
    ("unknown", "no_such_field: 1\n", "is not a model configuration"),
    ("..", None, "not a model folder name"),
])
def test_an_unreadable_config_names_why(tmp_path: Path, model: str, content: str | None, reason: str) -> None:
    if content is not None:
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(content)
    with pytest.raises(RepositoryUnreadable, match=reason):
        read_model(tmp_path / "repo" if model == ".." else tmp_path, model)
