from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.fleet.config import DnsSpec, FleetSpec, ServerSpec
from gateway.settings import Settings, SettingsError

ISSUE_EXAMPLE = """
fleets:
  default:
    servers:
      - {http: "http://10.0.0.1:8000", grpc: "10.0.0.1:8001"}
      - {http: "http://10.0.0.2:8000", grpc: "10.0.0.2:8001"}
  green:
    dns: {name: triton-green.ns.svc.cluster.local, http_port: 8000, grpc_port: 8001}
"""


def test_the_issue_example_reads_as_two_fleets(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(ISSUE_EXAMPLE)
    fleets = Settings.load(config).fleet_specs()
    assert set(fleets) == {"default", "green"}
    assert fleets["default"].servers == [ServerSpec(http="http://10.0.0.1:8000", grpc="10.0.0.1:8001"),
                                         ServerSpec(http="http://10.0.0.2:8000", grpc="10.0.0.2:8001")]
    assert fleets["green"].dns == DnsSpec(name="triton-green.ns.svc.cluster.local", http_port=8000, grpc_port=8001)
    assert [s.name for s in fleets["default"].servers or []] == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_without_fleets_the_triton_urls_form_the_default_fleet() -> None:
    settings = Settings.load(None, triton_url="http://127.0.0.1:9000/", triton_grpc_url="127.0.0.1:9001")
    assert settings.fleet_specs() == {"default": FleetSpec(servers=[ServerSpec(http="http://127.0.0.1:9000",
                                                                                 grpc="127.0.0.1:9001")])}


def test_fleets_without_default_keep_the_triton_urls_as_default() -> None:
    settings = Settings.load(None, fleets={"green": {"servers": [{"http": "http://g:8000", "grpc": "g:8001"}]}})
    assert set(settings.fleet_specs()) == {"default", "green"}
    assert settings.fleet_specs()["default"].servers == [ServerSpec(http=settings.triton_url,
                                                                    grpc=settings.triton_grpc_url)]


@pytest.mark.parametrize(("fleets", "field"), [
    ({"Blue": {"servers": [{"http": "http://a:1", "grpc": "a:2"}]}}, "fleets.Blue"),
    ({"g": {}}, "fleets.g: Value error, a fleet needs exactly one of"),
    ({"g": {"servers": [{"http": "http://a:1", "grpc": "a:2"}], "dns": {"name": "x"}}}, "fleets.g: Value error"),
    ({"g": {"servers": []}}, "fleets.g.servers"),
    ({"g": {"servers": [{"http": "ftp://a:1", "grpc": "a:2"}]}}, "fleets.g.servers.0.http"),
    ({"g": {"servers": [{"http": "http://a:1/v2", "grpc": "a:2"}]}}, "fleets.g.servers.0.http"),
    ({"g": {"servers": [{"http": "http://a:1", "grpc": "a"}]}}, "fleets.g.servers.0.grpc"),
    ({"g": {"servers": [{"http": "http://a:1", "grpc": "a:2"}, {"http": "http://a:1", "grpc": "b:2"}]}},
     "repeat the same HTTP endpoint"),
    ({"g": {"dns": {"name": "x", "http_port": 70000}}}, "fleets.g.dns.http_port"),
    ({"g": {"dns": {"name": "x", "grcp_port": 1}}}, "fleets.g.dns.grcp_port"),
])
def test_invalid_fleets_name_the_field(fleets: dict[str, object], field: str) -> None:
    with pytest.raises(SettingsError, match="invalid setting") as caught:
        Settings.load(None, fleets=fleets)
    assert field in str(caught.value)


def test_an_invalid_fleet_stops_serve_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("fleets:\n  default:\n    servers:\n      - {http: 'http://a:1', grpc: 'no-port'}\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(config)], capture_output=True,
                            text=True, timeout=60, env=clean)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "fleets.default.servers.0.grpc" in result.stderr


def test_fleets_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_FLEETS", '{"default": {"dns": {"name": "triton.ns.svc", "http_port": 8000}}}')
    assert Settings.load().fleet_specs()["default"].dns == DnsSpec(name="triton.ns.svc")
