"""Like for like: performance differences between configurations, and drift across a fleet's
servers (rollout/config_diff.py, pure)."""

from __future__ import annotations

import copy
from typing import Any

from gateway.rollout.config_diff import FIELDS, differences, drift, performance

QC: dict[str, Any] = {  # Triton 2.51's JSON of the sample qc model, trimmed to what matters here
    "name": "qc", "platform": "", "backend": "python", "runtime": "", "version_policy": {"specific": {"versions": [3]}},
    "max_batch_size": 8, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True}},
    "instance_group": [{"name": "qc_0", "kind": "KIND_CPU", "count": 1, "gpus": []}],
    "parameters": {}, "model_warmup": [],
}


def changed(**fields: Any) -> dict[str, Any]:
    config = copy.deepcopy(QC)
    config.update(fields)
    return config


def test_performance_puts_each_field_in_words() -> None:
    assert performance(QC) == {"instance_group": "1 instance (KIND_CPU)", "max_batch_size": "8",
                               "dynamic_batching": "off", "sequence_batching": "off", "backend": "python",
                               "accelerators": "none", "parameters": "none", "response_cache": "off"}
    assert set(performance({})) == set(FIELDS)


def test_instance_count_and_kind_differ_in_words() -> None:
    two = changed(instance_group=[{"kind": "KIND_CPU", "count": 2}])
    found = differences(stable=two, canary=QC)
    assert [d.words() for d in found] == ["canary runs 1 instance (KIND_CPU), stable 2 instances (KIND_CPU)"]
    gpu = changed(instance_group=[{"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}])
    assert differences(QC, gpu)[0].canary == "2 instances (KIND_GPU on GPUs 0,1)"


def test_every_performance_field_is_compared() -> None:
    canary = changed(max_batch_size=4, backend="onnxruntime",
                     dynamic_batching={"preferred_batch_size": [4], "max_queue_delay_microseconds": 100,
                                       "default_queue_policy": {"default_timeout_microseconds": 5000,
                                                                "timeout_action": "REJECT", "max_queue_size": 16}},
                     sequence_batching={"max_sequence_idle_microseconds": 1},
                     optimization={"priority": "PRIORITY_DEFAULT", "execution_accelerators": {
                         "gpu_execution_accelerator": [{"name": "tensorrt"}]}},
                     parameters={"threads": {"string_value": "4"}}, response_cache={"enable": True})
    found = {d.field: d for d in differences(QC, canary)}
    assert set(found) == set(FIELDS) - {"instance_group"}
    assert found["dynamic_batching"].canary == ("on: preferred [4], max queue delay 100 us, queue timeout 5000 us "
                                                "(REJECT), max queue 16")
    assert found["response_cache"].words() == "response_cache: canary on, stable off"
    assert "tensorrt" in found["accelerators"].canary
    assert found["backend"].document() == {"field": "backend", "stable": "python", "canary": "onnxruntime",
                                           "words": "backend: canary onnxruntime, stable python"}


def test_version_policy_and_names_alone_are_no_difference() -> None:
    assert differences(QC, changed(version_policy={"all": {}})) == []
    assert drift({"a": QC, "b": changed(version_policy={"all": {}})}) == []


def test_drift_names_the_server_that_differs_from_the_majority() -> None:
    odd = changed(instance_group=[{"name": "qc_0", "kind": "KIND_CPU", "count": 2, "gpus": []}])
    found = drift({"s1:8000": QC, "s2:8000": odd, "s3:8000": QC})
    assert len(found) == 1
    assert found[0].words("qc") == ("server s2:8000 reports instance_group 2 instances (KIND_CPU) for 'qc' where "
                                    "s1:8000, s3:8000 report 1 instance (KIND_CPU)")


def test_drift_on_a_tie_trusts_the_repository_file_then_the_first_server() -> None:
    odd = changed(max_batch_size=4)
    assert [d.server for d in drift({"a": odd, "b": QC}, reference=QC)] == ["a"]
    assert [d.server for d in drift({"a": QC, "b": odd}, reference=odd)] == ["a"]
    assert [d.server for d in drift({"a": QC, "b": odd})] == ["b"]  # no file: the first server's group


def test_drift_in_a_field_outside_the_performance_ones_is_named_too() -> None:
    odd = changed(input=[{"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}])
    found = drift({"a": QC, "b": odd, "c": QC})
    assert (found[0].server, found[0].field) == ("b", "input")
    assert "INPUT1" in found[0].value and found[0].document("qc")["peers"] == ["a", "c"]
