"""Triton's statistics as interval deltas, per (server, model, version): services/engine_stats.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import UpstreamUnavailable
from gateway.fleet.reads import ServerReads
from gateway.services.engine_stats import EngineCounters, EngineReading, EngineStats, interval


def stat(version: str, *, success: int = 0, fail: int = 0, queue_ns: int = 0, infer_ns: int = 0,
         inferences: int | None = None, executions: int | None = None, hits: int = 0, misses: int = 0,
         name: str = "qc") -> dict[str, Any]:
    """One model_stats entry shaped as Triton 2.51 answers it (queue counts successes, hits
    included; compute counts only requests that ran in the backend)."""
    computed = success - hits

    def pair(count: int, ns: int = 0) -> dict[str, int]:
        return {"count": count, "ns": ns}

    return {"name": name, "version": version, "last_inference": 0,
            "inference_count": computed if inferences is None else inferences,
            "execution_count": computed if executions is None else executions,
            "inference_stats": {"success": pair(success, 1), "fail": pair(fail, 2), "queue": pair(success, queue_ns),
                                "compute_input": pair(computed, 1000 * computed),
                                "compute_infer": pair(computed, infer_ns), "compute_output": pair(computed, 0),
                                "cache_hit": pair(hits, 10 * hits), "cache_miss": pair(misses, 20 * misses)},
            "response_stats": {}, "batch_stats": [], "memory_usage": []}


def test_counters_read_every_field_of_triton_shape() -> None:
    counters = EngineCounters.of(stat("3", success=10, fail=2, queue_ns=5000, infer_ns=70_000, inferences=10,
                                      executions=4, hits=3, misses=7))
    assert counters == EngineCounters(success=10, fail=2, queue_count=10, queue_ns=5000, compute_count=7,
                                      compute_input_ns=7000, compute_infer_ns=70_000, compute_output_ns=0,
                                      inference_count=10, execution_count=4, cache_hits=3, cache_hit_ns=30,
                                      cache_misses=7, cache_miss_ns=140)


@pytest.mark.parametrize("broken", [
    {"inference_stats": None},
    {"inference_stats": {"queue": 3}},
    {"inference_stats": {"queue": {"count": -1, "ns": 0}}},
    {"inference_stats": {"queue": {"count": 1.5, "ns": 0}}},
    {"inference_stats": {"queue": {"count": True, "ns": 0}}},
])
def test_counters_refuse_what_is_not_triton_shaped(broken: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EngineCounters.of({**stat("3", success=1), **broken})


def test_counters_given_as_strings_are_read() -> None:
    """64-bit counters may come as JSON strings."""
    entry = stat("3", success=1)
    entry["inference_count"] = "12345678901234"
    assert EngineCounters.of(entry).inference_count == 12345678901234


def test_since_is_the_difference_and_a_reload_counts_from_the_reload() -> None:
    early = EngineCounters.of(stat("3", success=10, queue_ns=100, infer_ns=1000))
    later = EngineCounters.of(stat("3", success=15, queue_ns=180, infer_ns=1600))
    delta = later.since(early)
    assert (delta.success, delta.queue_ns, delta.compute_infer_ns, delta.compute_count) == (5, 80, 600, 5)
    reloaded = EngineCounters.of(stat("3", success=4, queue_ns=40, infer_ns=400))
    assert reloaded.since(early) == reloaded  # counters went down: Triton loaded the version again


def reading(counts: dict[tuple[str, str], int], servers: tuple[str, ...] = ("a", "b"),
            unreadable: dict[str, str] | None = None, target: str = "3") -> EngineReading:
    counters = {(server, "qc", version): EngineCounters.of(stat(version, success=n, queue_ns=10 * n))
                for (server, version), n in counts.items()}
    return EngineReading(counters, {target: servers}, unreadable or {})


def test_interval_sums_the_servers_read_at_both_ends() -> None:
    before = reading({("a", "3"): 10, ("b", "3"): 100})
    after = reading({("a", "3"): 15, ("b", "3"): 130})
    found = interval(before, after, "qc", "3")
    assert found.counters is not None and found.counters.success == 35
    assert (found.servers, found.missing) == (("a", "b"), ())


def test_interval_leaves_out_a_server_not_read_at_both_ends_and_says_why() -> None:
    before = reading({("a", "3"): 10}, unreadable={"b": "no answer within 2s"})
    after = reading({("a", "3"): 15, ("b", "3"): 5000})  # b's whole history is not this interval's
    found = interval(before, after, "qc", "3")
    assert found.counters is not None and found.counters.success == 5
    assert found.missing == ("b: no answer within 2s",)
    later = reading({("a", "3"): 20}, unreadable={"b": "connection refused"})
    assert interval(after, later, "qc", "3").missing == ("b: connection refused",)


def test_interval_without_any_server_has_no_counters() -> None:
    after = reading({}, unreadable={"a": "refused", "b": "refused"})
    found = interval(None, after, "qc", "3")
    assert found.counters is None and found.missing == ("a: refused", "b: refused")
    assert interval(None, reading({("a", "3"): 1, ("b", "3"): 1}), "qc", "3").missing == (
        "a: no earlier reading", "b: no earlier reading")


def test_interval_of_a_fleet_target_reads_its_version() -> None:
    before = reading({("x", "3"): 1}, servers=("x",), target="b:3")
    after = reading({("x", "3"): 9}, servers=("x",), target="b:3")
    found = interval(before, after, "qc", "b:3")
    assert found.counters is not None and found.counters.success == 8


def test_reading_survives_its_document_and_a_bad_one_is_none() -> None:
    original = reading({("a", "3"): 10, ("b", "3"): 3}, unreadable={"c": "refused"})
    assert EngineReading.from_document(original.document()) == original
    assert EngineReading.from_document(None) is None
    assert EngineReading.from_document({"counters": {"a|qc": [1]}}) is None


class FakeServer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.reads = ServerReads()


class FakeControl:
    """Answers /stats per server as given: a body, or an exception to raise."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str]] = []

    def servers_of(self, target: str) -> list[Any]:
        return [FakeServer(name) for name in self.answers]

    async def call_on(self, server: Any, method: bytes, path: str, body: Any = None,
                      timeout_s: float | None = None) -> tuple[int, Any]:
        self.calls.append((server.name, path))
        answer = self.answers[server.name]
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        return int(status), body


async def test_reader_asks_each_server_once_per_model_and_names_those_it_cannot_read() -> None:
    control = FakeControl({
        "a": (200, {"model_stats": [stat("2", success=4), stat("3", success=7)]}),
        "b": UpstreamUnavailable("gateway: cannot connect"),
        "c": (400, {"error": "requested model 'qc' is not available"}),
        "d": (200, {"model_stats": [{**stat("3"), "inference_stats": {"queue": "x"}}]}),
    })
    found = await EngineStats(control).read("qc", ["3", "2", "3"])
    assert sorted(control.calls) == [(name, "/v2/models/qc/stats") for name in "abcd"]
    assert found.counters[("a", "qc", "3")].success == 7 and found.counters[("a", "qc", "2")].success == 4
    assert set(found.unreadable) == {"b", "c", "d"}
    assert "cannot connect" in found.unreadable["b"] and "400" in found.unreadable["c"]
    assert "cannot read" in found.unreadable["d"]
    assert found.servers == {"3": ("a", "b", "c", "d"), "2": ("a", "b", "c", "d")}


async def test_a_target_naming_another_model_reads_that_models_statistics() -> None:
    """Targets that are other models (issue 35): "qc_2026_12@2" is version 2 of qc_2026_12;
    "qc_2026_12" is Triton's default version of it (every version of it summed)."""
    answers = {"qc": {"model_stats": [stat("3", success=5)]},
               "qc_2026_12": {"model_stats": [stat("1", success=7, name="qc_2026_12"),
                                              stat("2", success=11, name="qc_2026_12")]}}

    class TwoModels(FakeControl):
        async def call_on(self, server: Any, method: bytes, path: str, body: Any = None,
                          timeout_s: float | None = None) -> tuple[int, Any]:
            self.calls.append((server.name, path))
            return 200, answers[path.split("/")[3]]

    control = TwoModels({"a": None})
    found = await EngineStats(control).read("qc", ["3", "qc_2026_12@2", "qc_2026_12"])
    assert sorted(control.calls) == [("a", "/v2/models/qc/stats"), ("a", "/v2/models/qc_2026_12/stats")]
    assert found.counters[("a", "qc_2026_12", "2")].success == 11
    empty = EngineReading({key: EngineCounters() for key in found.counters}, found.servers, {})
    named = interval(empty, found, "qc", "qc_2026_12@2")
    default = interval(empty, found, "qc", "qc_2026_12")
    assert named.counters is not None and named.counters.success == 11
    assert default.counters is not None and default.counters.success == 18
    assert interval(empty, found, "qc", "3").counters == EngineCounters.of(stat("3", success=5))
