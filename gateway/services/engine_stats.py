"""Triton's own view of a version: its statistics extension, per (server, model, version).

Triton keeps, per model version and since that version was loaded, cumulative counters: the
requests that succeeded (cache hits included) and failed, the time they spent in the scheduler's
queue and in the backend's three compute phases (input, infer, output), inference and execution
counts (their ratio is the batch size the version ran at), and response-cache hits and misses.
``GET /v2/models/{model}/stats`` answers every version of one model in one call, so reading a
rollout's versions costs one call per server of each fleet they are on, whatever the size of the
repository. (Triton's metrics port also has failure reasons, but as one page for every model on
the server, which grows with the repository; it is not read. The gateway classes each failed
answer by Triton's own words instead: ``telemetry.recorder.Outcome.REJECTED``.)

Each read goes through the server's shared reads (``gateway.fleet.reads``: single flight, so
every reader of the same model's statistics at once, a rollout's tick or a target's composing
models, shares one call). A reading is keyed by (server, model, version), so any target kind (a
version on a named fleet, another model, an ensemble's composing models) is read the same way. A server that cannot be
read is named in the reading with the reason, never an exception: the judge then says so and
judges from the gateway's own view. The rollout judge works on intervals: :func:`interval`
subtracts two readings (pure), :class:`EngineStats` makes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.parse
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import GatewayError
from gateway.fleet.members import Server
from gateway.policy import parse_target

StatsKey = tuple[str, str, str]  # (server, model, version)
# The statistics extension's inference_stats entries we read, with the counter fields they feed.
_DURATIONS = {"queue": ("queue_count", "queue_ns"), "compute_input": ("", "compute_input_ns"),
              "compute_infer": ("compute_count", "compute_infer_ns"), "compute_output": ("", "compute_output_ns"),
              "cache_hit": ("cache_hits", "cache_hit_ns"), "cache_miss": ("cache_misses", "cache_miss_ns"),
              "success": ("success", ""), "fail": ("fail", "")}


@dataclass(frozen=True)
class EngineCounters:
    """One version's cumulative counters on one server (or their difference over an interval,
    or a sum over servers). Durations in nanoseconds, as Triton counts them."""

    success: int = 0  # requests answered without error, cache hits included
    fail: int = 0  # requests Triton failed: queue timeouts, an execute that raised (not a model's error response)
    queue_count: int = 0  # requests timed in the queue (successes, cache hits included)
    queue_ns: int = 0
    compute_count: int = 0  # requests that ran in the backend (cache hits do not)
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    inference_count: int = 0  # inferences run (a batch of n counts n; cache hits not)
    execution_count: int = 0  # executions of the model (a dynamic batch counts once)
    cache_hits: int = 0
    cache_hit_ns: int = 0
    cache_misses: int = 0
    cache_miss_ns: int = 0

    @classmethod
    def of(cls, stat: Mapping[str, Any]) -> EngineCounters:
        """From one ``model_stats`` entry; ValueError when it is not shaped as Triton's."""
        values: dict[str, int] = {"inference_count": _count(stat.get("inference_count", 0)),
                                  "execution_count": _count(stat.get("execution_count", 0))}
        stats = stat.get("inference_stats")
        if not isinstance(stats, Mapping):
            raise ValueError("no inference_stats")
        for name, (count_field, ns_field) in _DURATIONS.items():
            entry = stats.get(name, {})
            if not isinstance(entry, Mapping):
                raise ValueError(f"inference_stats.{name} is not an object")
            if count_field:
                values[count_field] = _count(entry.get("count", 0))
            if ns_field:
                values[ns_field] = _count(entry.get("ns", 0))
        return cls(**values)

    def since(self, earlier: EngineCounters) -> EngineCounters:
        """What happened between ``earlier`` and this reading. A counter that went down means the
        version was loaded again in between (Triton starts its counters over): then these
        counters are all since that load, which lies inside the interval."""
        before, after = dataclasses.astuple(earlier), dataclasses.astuple(self)
        if any(b > a for b, a in zip(before, after, strict=True)):
            return self
        return EngineCounters(*(a - b for b, a in zip(before, after, strict=True)))

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                       strict=True)))


def _count(value: object) -> int:
    """A counter as Triton writes it (a JSON number, or a string for 64-bit values)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"counter {value!r} is not an integer")
    number = int(value)
    if number < 0:
        raise ValueError(f"counter {number} is negative")
    return number


@dataclass(frozen=True)
class EngineReading:
    """One look at the statistics of some versions: the counters per (server, model, version),
    the servers each target was read on, and the servers that could not be read (with why)."""

    counters: Mapping[StatsKey, EngineCounters] = field(default_factory=dict)
    servers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # target key -> servers asked
    unreadable: Mapping[str, str] = field(default_factory=dict)  # server -> why it could not be read

    def document(self) -> dict[str, Any]:
        """As JSON types (the rollout record keeps the last reading, so any replica can take the next interval)."""
        return {"counters": {"|".join(key): list(dataclasses.astuple(value)) for key, value in self.counters.items()},
                "servers": {target: list(names) for target, names in self.servers.items()},
                "unreadable": dict(self.unreadable)}

    @classmethod
    def from_document(cls, doc: Mapping[str, Any] | None) -> EngineReading | None:
        if not doc:
            return None
        try:
            counters = {_key(key): EngineCounters(*(int(v) for v in values))
                        for key, values in doc.get("counters", {}).items()}
            servers = {str(target): tuple(str(s) for s in names) for target, names in doc.get("servers", {}).items()}
            return cls(counters, servers, {str(k): str(v) for k, v in doc.get("unreadable", {}).items()})
        except (TypeError, ValueError):
            return None  # a record this version cannot read: the next interval starts from the next reading


def _key(text: str) -> StatsKey:
    server, model, version = text.split("|")
    return server, model, version


def target_of(model: str, key: str) -> tuple[str, str | None]:
    """The model and version a target key of ``model``'s policy names: ``"3"`` and ``"green:3"``
    version 3 of ``model``, ``"qc_2026_12@2"`` version 2 of that model, ``"qc_2026_12"`` Triton's
    default version of it (None: every version of it is summed, the default taking its traffic)."""
    target = parse_target(key)
    return target.model or model, target.version


@dataclass(frozen=True)
class TargetInterval:
    """One target's counters over an interval, summed over the servers read at both ends."""

    counters: EngineCounters | None  # None: no server of the target was read at both ends
    servers: tuple[str, ...]  # the servers the sum covers
    missing: tuple[str, ...]  # servers of the target left out, each with why ("server: reason")


def interval(before: EngineReading | None, after: EngineReading, model: str, target: str) -> TargetInterval:
    """``target``'s counters (a target key of ``model``'s policy) between two readings. A server
    is summed only when both readings have it: one seen only now (new in a DNS fleet, or
    unreadable last time) would bring its whole history into the interval."""
    named, version = target_of(model, target)
    summed: EngineCounters | None = None
    covered: list[str] = []
    missing: list[str] = []
    for server in after.servers.get(target, ()):
        now = _version_counters(after, server, named, version)
        then = _version_counters(before, server, named, version) if before is not None else None
        if now is None:
            why = after.unreadable.get(server) or "Triton reports no statistics for this version"
            missing.append(f"{server}: {why}")
            continue
        if then is None:
            why = (before.unreadable.get(server) if before is not None else None) or "no earlier reading"
            missing.append(f"{server}: {why}")
            continue
        delta = now.since(then)
        summed = delta if summed is None else summed + delta
        covered.append(server)
    return TargetInterval(summed, tuple(covered), tuple(missing))


def _version_counters(reading: EngineReading, server: str, model: str, version: str | None) -> EngineCounters | None:
    """One version's counters on one server, or (version None) the sum of the model's versions there."""
    if version is not None:
        return reading.counters.get((server, model, version))
    total = None
    for (where, name, _), value in reading.counters.items():
        if where == server and name == model:
            total = value if total is None else total + value
    return total


class StatsCalls(Protocol):
    """What the reader needs of model control (``services.triton_control.TritonControl``)."""

    def servers_of(self, target: str) -> list[Server]: ...

    async def call_on(self, server: Server, method: bytes, path: str, body: Any = None,
                      timeout_s: float | None = None) -> tuple[int, Any]: ...


async def read_json(control: StatsCalls, server: Server, path: str, timeout_s: float) -> dict[str, Any] | str:
    """``GET path`` on ``server`` through its shared reads (``gateway.fleet.reads``: a read sent
    after this call, or the one under way), within ``timeout_s``: the JSON object Triton answered
    with 200, or why there is none, in words."""
    def fetch() -> Awaitable[tuple[int, Any]]:
        return control.call_on(server, b"GET", path, timeout_s=timeout_s)

    try:
        async with asyncio.timeout(timeout_s):
            status, body = await server.reads.read(path, fetch, 0.0)
    except TimeoutError:
        return f"no answer to {path} within {timeout_s:g}s"
    except GatewayError as exc:
        return f"{path} failed: {exc.message}"
    if status != 200 or not isinstance(body, dict):
        return f"{path} answered {status}: {body.get('error') if isinstance(body, dict) else body}"
    return body


class EngineStats:
    """Reads Triton's statistics of one model's versions on every server of their fleets."""

    def __init__(self, control: StatsCalls, timeout_s: float = 2.0) -> None:
        self.control = control
        self.timeout_s = timeout_s

    async def read(self, model: str, targets: Iterable[str]) -> EngineReading:
        """One reading of ``targets`` (target keys of ``model``'s policy: a version, on a fleet, or
        another model): one call per server and model named, concurrently, each within
        ``timeout_s``. Never raises for a server that cannot be read: it is named in ``unreadable``."""
        servers: dict[str, tuple[str, ...]] = {}
        asked: dict[tuple[str, str], Server] = {}  # (server, model) -> server
        for target in dict.fromkeys(targets):
            try:
                found = self.control.servers_of(target)
                named = target_of(model, target)[0]
            except (GatewayError, ValueError):
                found, named = [], model  # a fleet this gateway does not know: nothing to read
            servers[target] = tuple(server.name for server in found)
            asked.update(((server.name, named), server) for server in found)
        answers = await asyncio.gather(*(self._server(server, named) for (_, named), server in asked.items()))
        counters: dict[StatsKey, EngineCounters] = {}
        unreadable: dict[str, str] = {}
        for (server, named), answer in zip(asked, answers, strict=True):
            if isinstance(answer, str):
                unreadable[server] = answer
            else:
                counters.update(((server, named, version), value) for version, value in answer.items())
        return EngineReading(counters, servers, unreadable)

    async def _server(self, server: Server, model: str) -> dict[str, EngineCounters] | str:
        """Every version's counters of ``model`` on ``server``, or why they could not be read."""
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}/stats"
        body = await read_json(self.control, server, path, self.timeout_s)
        if isinstance(body, str):
            return body
        found: dict[str, EngineCounters] = {}
        try:
            for stat in body.get("model_stats", []):
                if isinstance(stat, Mapping) and stat.get("name") == model and "version" in stat:
                    found[str(stat["version"])] = EngineCounters.of(stat)
        except (TypeError, ValueError) as exc:
            return f"{path} answered statistics this gateway cannot read: {exc}"
        return found
