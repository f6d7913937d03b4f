from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gateway.local_triton import LocalTriton


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read GATEWAY_* variables: no test may see another's or the developer's."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)


class Faults:
    """Writes the sample models' fault file; the running Triton re-reads it within ~100 ms."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.clear()

    def set(self, model: str, version: str, **spec: Any) -> None:
        data = json.loads(self.path.read_text())
        data.setdefault(model, {})[version] = spec
        self._write(data)

    def clear(self) -> None:
        self._write({})

    def _write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
        time.sleep(0.25)  # the models check the file at most every 100 ms


@pytest.fixture(scope="session")
def faults_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "faults.json"
    path.write_text("{}")
    return path


@pytest.fixture(scope="session")
def triton(faults_path: Path) -> Iterator[LocalTriton]:
    """One real tritonserver for the whole session, on free ports."""
    server = LocalTriton.on_free_ports(faults_file=faults_path)
    with server:
        yield server


@pytest.fixture
def faults(triton: LocalTriton, faults_path: Path) -> Iterator[Faults]:
    helper = Faults(faults_path)
    yield helper
    helper.clear()
