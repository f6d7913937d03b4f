"""What a gateway load or unload sends Triton, and whether a new config.pbtxt is honoured
(issue 24 item 6: "a reload never sends a config override unless an admin asked for one").

Triton selects versions only through a whole-configuration override, so the gateway used to
send Triton's loaded configuration with a new ``version_policy``: an operator's edit of
``config.pbtxt`` (here ``max_batch_size`` and a ``parameters`` entry, made while Triton runs, as
when a new version folder is deployed with it) was silently dropped. With ``model_repository``
set the gateway reads ``config.pbtxt`` itself: no override when its ``version_policy`` serves
the wanted versions, else the file as it is now with the wanted versions. Without it, the
answer says that the loaded configuration was sent and changes are not applied. Real Triton,
each test on its own copy of the sample ``qc`` model (version 4, the broken one, left out).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools.local_triton import SAMPLE_REPOSITORY, LocalTriton
from tests.fleet_support import fleet_settings, ready_versions
from tests.support import TOKEN, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    shutil.copytree(SAMPLE_REPOSITORY / "qc", root / "qc")
    shutil.rmtree(root / "qc" / "4")
    return root


@pytest.fixture
def own_triton(repository: Path) -> Iterator[LocalTriton]:
    with LocalTriton.on_free_ports(repository=repository, models=("qc",)) as triton:
        yield triton


def deploy_version_5(repository: Path, max_batch_size: int, policy: str | None = None) -> None:
    """What an operator does while Triton runs: a new version folder and an edited config.pbtxt."""
    if not (repository / "qc" / "5").exists():
        shutil.copytree(repository / "qc" / "3", repository / "qc" / "5")
    path = repository / "qc" / "config.pbtxt"
    lines = [line for line in path.read_text().splitlines()
             if not line.startswith(("max_batch_size", "parameters")) and not (policy and "version_policy" in line)]
    lines += [f"max_batch_size: {max_batch_size}", f'parameters {{ key: "release" value {{ string_value: '
              f'"mbs{max_batch_size}" }} }}', *([policy] if policy else [])]
    path.write_text("\n".join(lines) + "\n")


def triton_config(triton: LocalTriton) -> dict[str, Any]:
    with urllib.request.urlopen(f"{triton.http_url}/v2/models/qc/config", timeout=10) as response:
        return dict(json.loads(response.read()))


def admin(base: str, path: str, body: Any = None) -> tuple[int, Any]:
    """An admin POST with room for Triton to load four Python-backend versions on a busy machine."""
    request = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {TOKEN}",
                                                             "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_with_model_repository_a_new_config_pbtxt_is_honoured_and_no_override_sent_when_none_is_needed(
        own_triton: LocalTriton, repository: Path) -> None:
    settings = gateway_settings(own_triton.http_url, admin_token=TOKEN, controller_enabled=False,
                                model_repository=repository)
    with GatewayThread(settings) as gw:
        deploy_version_5(repository, max_batch_size=4)  # config.pbtxt still lists 1, 2, 3
        status, body = admin(gw.url, "/admin/models/qc/versions/5/load")
        assert status == 200, body
        pbtxt = repository / "qc" / "config.pbtxt"
        assert body["config_sent"].startswith(f"config override: {pbtxt} as it is now"), body
        config = triton_config(own_triton)
        assert ready_versions(own_triton) == {"1", "2", "3", "5"}
        assert config["max_batch_size"] == 4, "the edited config.pbtxt is what Triton loaded (the old code sent 8)"
        assert config["parameters"]["release"]["string_value"] == "mbs4"

        # Unload 5: config.pbtxt's own list (1, 2, 3) is the wanted set, so no override is sent; Triton
        # keeps the override it loaded (no file is newer), so the gateway then sends config.pbtxt.
        status, body = admin(gw.url, "/admin/models/qc/versions/5/unload")
        assert status == 200, body
        assert body["config_sent"].startswith("no config override"), body
        assert "kept the configuration of an earlier override" in body["config_sent"], body
        assert ready_versions(own_triton) == {"1", "2", "3"}
        assert triton_config(own_triton)["max_batch_size"] == 4

        # The operator now lets config.pbtxt serve every folder: loading 5 needs no override at all,
        # and Triton reads the file itself (its version_policy stays "all", not a list the gateway wrote).
        deploy_version_5(repository, max_batch_size=2, policy="version_policy: { all { } }")
        status, body = admin(gw.url, "/admin/models/qc/versions/5/load")
        assert status == 200, body
        assert body["config_sent"] == (f"no config override: {repository / 'qc' / 'config.pbtxt'}'s version_policy "
                                       "serves exactly [1, 2, 3, 5]"), body
        config = triton_config(own_triton)
        assert ready_versions(own_triton) == {"1", "2", "3", "5"}
        assert config["version_policy"] == {"all": {}}, config["version_policy"]
        assert config["max_batch_size"] == 2
        assert config["parameters"]["release"]["string_value"] == "mbs2"


def test_without_model_repository_the_answer_says_the_loaded_config_was_sent_and_an_admins_config_goes_as_given(
        own_triton: LocalTriton, repository: Path) -> None:
    settings = gateway_settings(own_triton.http_url, admin_token=TOKEN, controller_enabled=False)
    with GatewayThread(settings) as gw:
        deploy_version_5(repository, max_batch_size=4)
        status, body = admin(gw.url, "/admin/models/qc/versions/5/load")
        assert status == 200, body
        assert body["config_sent"] == (
            "config override: Triton's loaded configuration of 'qc' with version_policy specific [1, 2, 3, 5]; "
            "changes to config.pbtxt since Triton last read it are not applied (model_repository is not set)"), body
        assert triton_config(own_triton)["max_batch_size"] == 8, "the documented limit: the edit is not applied"

        given = {**triton_config(own_triton), "max_batch_size": 2, "version_policy": {"all": {}}}
        status, body = admin(gw.url, "/admin/models/qc/versions/5/load", {"config": given})
        assert status == 200, body
        assert body["config_sent"] == "config override: the admin's configuration, as given", body
        config = triton_config(own_triton)
        assert config["version_policy"] == {"all": {}}, "as given (the old code replaced it with a version list)"
        assert config["max_batch_size"] == 2
        assert ready_versions(own_triton) == {"1", "2", "3", "5"}

        given = {key: value for key, value in given.items() if key != "version_policy"} | {"max_batch_size": 3}
        status, body = admin(gw.url, "/admin/models/qc/versions/5/load", {"config": given})
        assert status == 200, body
        assert body["config_sent"] == ("config override: the admin's configuration with version_policy specific "
                                       "[1, 2, 3, 5] (it named none)"), body
        assert triton_config(own_triton)["max_batch_size"] == 3
        assert ready_versions(own_triton) == {"1", "2", "3", "5"}


def test_a_fleet_sharing_one_repository_serves_the_new_config_on_every_server(repository: Path) -> None:
    """Two Tritons on one repository (as pods on one volume): each gets config.pbtxt as it is now,
    and each one that keeps an earlier override after the load without one is named."""
    with LocalTriton.on_free_ports(repository=repository, models=("qc",)) as first, \
            LocalTriton.on_free_ports(repository=repository, models=("qc",)) as second:
        settings = fleet_settings(first, second, controller_enabled=False, model_repository=repository)
        with GatewayThread(settings) as gw:
            deploy_version_5(repository, max_batch_size=4)
            status, body = admin(gw.url, "/admin/models/qc/versions/5/load")
            assert status == 200, body
            for server in (first, second):
                assert ready_versions(server) == {"1", "2", "3", "5"}
                assert triton_config(server)["max_batch_size"] == 4

            status, body = admin(gw.url, "/admin/models/qc/versions/5/unload")
            assert status == 200, body
            assert body["config_sent"].startswith("no config override"), body
            assert body["config_sent"].count("kept the configuration of an earlier override") == 2, body
            for server in (first, second):
                assert ready_versions(server) == {"1", "2", "3"}
                assert triton_config(server)["max_batch_size"] == 4
