"""Deployment files: the docs' config reference, compose, Dockerfile, Kubernetes manifests, dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.devtools.config_reference import embedded, markdown
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_generated_from_the_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("# triton-gateway\n\n```sh\nmake demo")
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert embedded(page) == markdown(), "run `gateway config-reference` and paste it into docs/configuration.md"


def test_dockerfile_is_slim_non_root_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "python:3.11-slim" in text and "USER gateway" in text and "HEALTHCHECK" in text and "/healthz" in text


def test_compose_wires_every_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"triton", "triton-2", "redis", "gateway", "prometheus", "grafana"}
    assert "--model-control-mode=explicit" in services["triton"]["command"]
    assert services["triton-2"]["command"] == services["triton"]["command"]
    env = services["gateway"]["environment"]
    assert env["GATEWAY_STORE_URL"].startswith("redis://redis") and env["GATEWAY_TRITON_URL"] == "http://triton:8000"
    from gateway.settings import Settings

    fleet = Settings.load(None, fleets=json.loads(env["GATEWAY_FLEETS"])).fleet_specs()["default"]
    assert [(s.http, s.grpc) for s in fleet.servers or []] == [("http://triton:8000", "triton:8001"),
                                                              ("http://triton-2:8000", "triton-2:8001")]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


REQUIRED = {"Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1", "Secret": "v1",
            "PodDisruptionBudget": "policy/v1", "HorizontalPodAutoscaler": "autoscaling/v2"}


def test_k8s_manifests_are_well_formed() -> None:
    docs = k8s_documents()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        assert doc["apiVersion"] == REQUIRED[doc["kind"]], doc["kind"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert set(by_kind) == set(REQUIRED)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    for deployment in deployments.values():
        spec = deployment["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        for container in spec["template"]["spec"]["containers"]:
            assert container["image"] and container["resources"]["requests"]
    gateway = deployments["triton-gateway"]["spec"]
    assert gateway["replicas"] == 3
    container = gateway["template"]["spec"]["containers"][0]
    grpc_port = next(port["containerPort"] for port in container["ports"] if port["name"] == "grpc")
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port}, "grpc.health.v1 on the gateway's gRPC port"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    secrets = {s["metadata"]["name"] for s in by_kind["Secret"]}
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] in secrets
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()]
    for service in by_kind["Service"]:
        assert any(service["spec"]["selector"].items() <= labels.items() for labels in pod_labels), service
    hpa = by_kind["HorizontalPodAutoscaler"][0]["spec"]
    assert hpa["scaleTargetRef"]["name"] in deployments and hpa["minReplicas"] >= 3
    assert by_kind["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"] == {"app": "triton-gateway"}
    config = yaml.safe_load(by_kind["ConfigMap"][0]["data"]["gateway.yaml"])
    from gateway.settings import Settings

    settings = Settings.load(None, **config)
    assert settings.store_url.startswith("redis://"), "the ConfigMap is a valid settings file"
    assert deployments["triton"]["spec"]["replicas"] == 2
    headless = next(s for s in by_kind["Service"] if s["metadata"]["name"] == "triton-pods")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == {"app": "triton"}
    dns = settings.fleet_specs()["default"].dns
    assert dns is not None and dns.name.startswith("triton-pods.") and (dns.http_port, dns.grpc_port) == (8000, 8001)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "gateway.json").read_text())
    return loaded


def test_dashboard_schema() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["type"] in {"timeseries", "stat"} and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"])


def panel_metric_names() -> set[str]:
    names = set()
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\b((?:gateway|nv|process)_[a-z_]+)\b", target["expr"]))
    return names


@pytest.mark.parametrize("name", sorted(panel_metric_names()))
def test_dashboard_names_only_series_that_exist(name: str, exported_metric_names: set[str]) -> None:
    assert name in exported_metric_names


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_the_gateway_memory_limit_follows_from_its_budget() -> None:
    """The process at rest, plus every byte of the request budget twice (held while copied), plus
    room for answers: the shipped limit must hold what the shipped settings let clients make it hold."""
    docs = k8s_documents()
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "triton-gateway")
    declared = yaml.safe_load(config["data"]["gateway.yaml"])
    budget = declared.get("max_buffered_body_bytes", Settings.model_fields["max_buffered_body_bytes"].default)
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "triton-gateway")
    limit = _mebibytes(deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
    at_rest, room_for_answers = 160, 256
    assert limit >= at_rest + 2 * budget / (1 << 20) + room_for_answers


def test_the_grace_period_covers_the_pre_stop_sleep_and_the_longest_drain() -> None:
    """The kubelet SIGKILLs at terminationGracePeriodSeconds, counted from before the preStop
    sleep: the sleep plus the longest a gateway takes from SIGTERM to exit (its drain_timeout_s,
    as the ConfigMap sets it or by default, and what follows the drain) must fit, or the
    requests still draining are cut."""
    from gateway.workers.supervisor import longest_stop_s

    docs = k8s_documents()
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "triton-gateway")
    declared = yaml.safe_load(config["data"]["gateway.yaml"])
    drain = declared.get("drain_timeout_s", Settings.model_fields["drain_timeout_s"].default)
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "triton-gateway")
    pod = deployment["spec"]["template"]["spec"]
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    pre_stop = float(command[1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + longest_stop_s(drain), (
        pod["terminationGracePeriodSeconds"], pre_stop, drain)
