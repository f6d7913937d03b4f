"""Like for like: what two Triton model configurations differ in that changes performance, and
whether every server of a fleet serves a model with the same configuration. Pure functions over
Triton's JSON form of a model configuration (``GET /v2/models/{model}/config``).

Triton keeps one configuration per model, so two versions on one server share it; versions
whose configurations differ live on different fleets (``b:3``) or are different models. The
fields that change how a version performs, each put in words (:func:`performance`):

* ``instance_group``: how many instances, of which kind (and on which GPUs);
* ``max_batch_size``, ``dynamic_batching`` (preferred sizes, queue delay, queue policy),
  ``sequence_batching``;
* ``backend`` (with platform and runtime), and its accelerator settings
  (``optimization.execution_accelerators``, CUDA graphs, priority);
* ``parameters`` (a backend's own settings);
* ``response_cache``.

A fleet whose servers report different configurations for one model (an override loaded on
one server, a server restarted with an older repository) serves "version 3" as two different
things: :func:`drift` names the server that differs and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELDS = ("instance_group", "max_batch_size", "dynamic_batching", "sequence_batching", "backend", "accelerators",
          "parameters", "response_cache")
IGNORED = ("version_policy",)  # which versions a server serves is readiness' business, not the configuration's


def _instances(config: Mapping[str, Any]) -> str:
    groups = config.get("instance_group") or []
    if not groups:
        return "Triton's default instances"
    counts: dict[str, int] = {}
    for group in groups:
        kind = str(group.get("kind", "KIND_AUTO"))
        gpus = group.get("gpus") or []
        label = f"{kind} on GPUs {','.join(str(g) for g in gpus)}" if gpus else kind
        counts[label] = counts.get(label, 0) + int(group.get("count", 1)) * max(1, len(gpus))
    return " + ".join(f"{n} instance{'s' if n != 1 else ''} ({label})" for label, n in sorted(counts.items()))


def _dynamic_batching(config: Mapping[str, Any]) -> str:
    batching = config.get("dynamic_batching")
    if batching is None:
        return "off"
    words = [f"preferred {batching.get('preferred_batch_size') or 'any'}",
             f"max queue delay {int(batching.get('max_queue_delay_microseconds', 0))} us"]
    policy = batching.get("default_queue_policy") or {}
    if int(policy.get("default_timeout_microseconds", 0)):
        words.append(f"queue timeout {int(policy['default_timeout_microseconds'])} us "
                     f"({policy.get('timeout_action', 'REJECT')})")
    if int(policy.get("max_queue_size", 0)):
        words.append(f"max queue {int(policy['max_queue_size'])}")
    if int(batching.get("priority_levels", 0)):
        words.append(f"{int(batching['priority_levels'])} priority levels")
    return "on: " + ", ".join(words)


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _accelerators(config: Mapping[str, Any]) -> str:
    optimization = config.get("optimization") or {}
    chosen = {key: optimization[key] for key in ("execution_accelerators", "cuda", "priority")
              if optimization.get(key) not in (None, {}, [], "PRIORITY_DEFAULT")}
    return _compact(chosen) if chosen else "none"


def performance(config: Mapping[str, Any]) -> dict[str, str]:
    """The fields that change how a model performs (module docstring), each in words."""
    backend = config.get("backend") or config.get("platform") or "unknown"
    runtime = config.get("runtime")
    return {
        "instance_group": _instances(config),
        "max_batch_size": str(int(config.get("max_batch_size", 0))),
        "dynamic_batching": _dynamic_batching(config),
        "sequence_batching": "on" if config.get("sequence_batching") is not None else "off",
        "backend": f"{backend} (runtime {runtime})" if runtime else str(backend),
        "accelerators": _accelerators(config),
        "parameters": _compact(config["parameters"]) if config.get("parameters") else "none",
        "response_cache": "on" if (config.get("response_cache") or {}).get("enable") else "off",
    }


@dataclass(frozen=True)
class ConfigDifference:
    """One performance field that differs between the stable's and the canary's configuration."""

    field: str
    stable: str
    canary: str

    def words(self, versus: str = "stable") -> str:
        if self.field == "instance_group":
            return f"canary runs {self.canary}, {versus} {self.stable}"
        return f"{self.field}: canary {self.canary}, {versus} {self.stable}"

    def document(self) -> dict[str, str]:
        return {"field": self.field, "stable": self.stable, "canary": self.canary, "words": self.words()}


def differences(stable: Mapping[str, Any], canary: Mapping[str, Any]) -> list[ConfigDifference]:
    """The performance fields in which the canary's configuration differs from the stable's."""
    mine, theirs = performance(canary), performance(stable)
    return [ConfigDifference(name, theirs[name], mine[name]) for name in FIELDS if mine[name] != theirs[name]]


@dataclass(frozen=True)
class Drift:
    """A server of a fleet that serves a model with another configuration than its peers."""

    server: str  # the one that differs
    field: str
    value: str
    peers: tuple[str, ...]  # the servers it differs from
    expected: str  # their value

    def words(self, model: str) -> str:
        return (f"server {self.server} reports {self.field} {self.value} for '{model}' where "
                f"{', '.join(self.peers)} report{'s' if len(self.peers) == 1 else ''} {self.expected}")

    def document(self, model: str) -> dict[str, Any]:
        return {"server": self.server, "field": self.field, "value": self.value, "peers": list(self.peers),
                "expected": self.expected, "words": self.words(model)}


def _signature(config: Mapping[str, Any]) -> str:
    return _compact({key: value for key, value in config.items() if key not in IGNORED})


def drift(configs: Mapping[str, Mapping[str, Any]], reference: Mapping[str, Any] | None = None) -> list[Drift]:
    """Each server whose configuration of a model differs from the fleet's: the largest group of
    servers that agree, or on a tie the group whose performance fields match ``reference``
    (``config.pbtxt`` as the gateway reads it), else the group of the first server by name.
    One entry per differing server, for the first field in which it differs."""
    groups: dict[str, list[str]] = {}
    for server in sorted(configs):
        groups.setdefault(_signature(configs[server]), []).append(server)
    if len(groups) <= 1:
        return []
    ranked = sorted(groups.values(), key=lambda servers: (-len(servers), servers[0]))
    agreed = ranked[0]
    if len(ranked[1]) == len(agreed) and reference is not None:
        wanted = performance(reference)
        matching = [servers for servers in ranked if len(servers) == len(agreed)
                    and performance(configs[servers[0]]) == wanted]
        if len(matching) == 1:
            agreed = matching[0]
    expected = configs[agreed[0]]
    found = []
    for server in sorted(configs):
        if server in agreed:
            continue
        field, value, usual = _first_difference(configs[server], expected)
        found.append(Drift(server, field, value, tuple(agreed), usual))
    return found


def _first_difference(config: Mapping[str, Any], expected: Mapping[str, Any]) -> tuple[str, str, str]:
    """The first field (a performance field in words if one differs, else any top-level field)."""
    mine, theirs = performance(config), performance(expected)
    for name in FIELDS:
        if mine[name] != theirs[name]:
            return name, mine[name], theirs[name]
    for key in sorted(set(config) | set(expected)):
        if key not in IGNORED and config.get(key) != expected.get(key):
            return key, _compact(config.get(key))[:200], _compact(expected.get(key))[:200]
    return "configuration", "differs", "the same"  # unreachable: the signatures differ
