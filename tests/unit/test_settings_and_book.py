from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.settings import Settings, SettingsError

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "gateway.yaml"


def test_example_config_loads() -> None:
    settings = Settings.load(EXAMPLE)
    assert settings.policies["qc"].basis_points() == {"2": 8000, "3": 2000}
    assert settings.policies["qc"].rules[0].version == "3"


def test_environment_beats_the_file_and_flags_beat_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "g.yaml"
    config.write_text("port: 9000\nrequest_timeout_s: 5\n")
    monkeypatch.setenv("GATEWAY_PORT", "9100")
    settings = Settings.load(config)
    assert (settings.port, settings.request_timeout_s) == (9100, 5)
    assert Settings.load(config, port=9200).port == 9200


def test_defaults() -> None:
    settings = Settings.load()
    assert (settings.port, settings.triton_url, settings.sticky_header) == (8080, "http://127.0.0.1:8000", "x-user-id")


@pytest.mark.parametrize(("text", "message"), [
    ("port: 0\n", "port"),
    ("triton_url: ftp://x\n", "triton_url"),
    ("policies: {qc: {weights: {'2': 70, '3': 20}}}\n", "policies.qc.weights"),
    ("bogus: 1\n", "bogus"),
    ("- a\n- b\n", "mapping"),
    ("port: [\n", "not valid YAML"),
    ("grpc_max_connections: 0\n", "grpc_max_connections"),
])
def test_bad_settings_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=message):
        Settings.load(config)


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="No such file"):
        Settings.load(tmp_path / "absent.yaml")


def test_bad_environment_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_POOL_SIZE", "lots")
    with pytest.raises(SettingsError, match="pool_size"):
        Settings.load()


def test_policy_book_swaps_whole_snapshots() -> None:
    book = PolicyBook()
    seen: list[tuple[str, object]] = []
    book.on_change(lambda model, policy: seen.append((model, policy and policy.revision)))
    first = book.snapshot()
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), revision=1)
    assert first == {} and book.get("qc").revision == 1  # type: ignore[union-attr]
    old = book.snapshot()
    book.put("qc", PolicySpec.model_validate({"weights": {"3": 100}}), revision=2)
    assert old["qc"].revision == 1, "a reader holding the old snapshot keeps a consistent view"
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), revision=1)
    assert book.get("qc").revision == 2, "an older revision never replaces a newer one"  # type: ignore[union-attr]
    book.remove("qc")
    assert book.get("qc") is None
    assert seen == [("qc", 1), ("qc", 2), ("qc", None)]


def test_upstream_forwards_end_to_end_headers_and_replaces_hop_by_hop() -> None:
    from gateway.upstream import HttpUpstream

    upstream = HttpUpstream("http://127.0.0.1:8000")
    head = upstream._head(b"POST", b"/v2/models/qc/infer", [
        (b"traceparent", b"00-abc-def-01"), (b"inference-header-content-length", b"10"),
        (b"content-encoding", b"gzip"), (b"connection", b"close"), (b"host", b"client"),
        (b"transfer-encoding", b"chunked")], b"x" * 12, None)
    text = head.decode()
    assert text.startswith("POST /v2/models/qc/infer HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n")
    for kept in ("traceparent: 00-abc-def-01", "inference-header-content-length: 10", "content-encoding: gzip",
                 "content-length: 12"):
        assert kept in text
    assert "connection" not in text and "client" not in text and "chunked" not in text


def test_sigterm_gives_the_http_port_drain_timeout_s_past_uvicorns_default_10_s() -> None:
    """The long side of the drain bound (tests/integration/test_shutdown.py shows the short one
    end to end), without a minute-long request: uvicorn is given drain_timeout_s, not a fixed 10 s;
    a fraction of a second rounds up, never down."""
    from gateway.app import Gateway
    from gateway.server import uvicorn_config

    for drain, seconds in ((60.0, 60), (2.5, 3)):
        settings = Settings(drain_timeout_s=drain, store_url="memory://")
        assert uvicorn_config(settings, Gateway(settings)).timeout_graceful_shutdown == seconds
