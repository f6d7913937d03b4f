"""The variant of an ensemble (gateway/services/ensembles.py, pure parts): generated from the
ensemble's own config with one composing model's pin changed, refused with the reason otherwise;
and which pins the gateway made (restored after a Triton restart)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.errors import Conflict
from gateway.rollout.spec import RolloutSpec
from gateway.services.ensembles import gateway_pins, pin_of, plan

PIPE: dict[str, Any] = {
    "name": "pipe", "platform": "ensemble", "max_batch_size": 8, "version_policy": {"latest": {"num_versions": 1}},
    "ensemble_scheduling": {"step": [
        {"model_name": "pre", "model_version": -1, "input_map": {"RAW": "RAW"}, "output_map": {"INPUT0": "p"}},
        {"model_name": "qc", "model_version": 2, "input_map": {"INPUT0": "p"}, "output_map": {"OUTPUT0": "s"}},
        {"model_name": "post", "model_version": -1, "input_map": {"INPUT0": "p", "OUTPUT0": "s"},
         "output_map": {"RESULT": "RESULT"}}]},
}


def test_the_variant_is_the_ensembles_config_with_one_pin_changed() -> None:
    variant = plan("pipe", PIPE, "qc@3", ["1"])
    assert (variant["name"], variant["model"], variant["stable_version"], variant["canary_version"]) == (
        "pipe__qc_3", "qc", "2", "3")
    expected = copy.deepcopy(PIPE)
    expected["name"] = "pipe__qc_3"
    expected["ensemble_scheduling"]["step"][1]["model_version"] = 3
    assert variant["config"] == expected
    assert PIPE["ensemble_scheduling"]["step"][1]["model_version"] == 2  # the ensemble's own config is untouched
    assert pin_of(variant["config"], "qc") == "3" and pin_of(PIPE, "pre") == "-1" and pin_of(PIPE, "tok") is None


def test_a_model_used_twice_is_pinned_in_both_steps() -> None:
    twice = copy.deepcopy(PIPE)
    twice["ensemble_scheduling"]["step"].append({"model_name": "qc", "model_version": 2})
    config = plan("pipe", twice, "qc@4", ["1"])["config"]
    assert [s["model_version"] for s in config["ensemble_scheduling"]["step"] if s["model_name"] == "qc"] == [4, 4]


@pytest.mark.parametrize(("config", "composing", "words"), [
    ({**PIPE, "platform": "", "backend": "python"}, "qc@3", "is not an ensemble"),
    (PIPE, "tok@1", "no step of ensemble 'pipe' runs 'tok' (its steps run post, pre, qc)"),
    (PIPE, "pre@2", "says model_version -1 (the latest)"),
    (PIPE, "qc@2", "runs qc version 2 already"),
])
def test_what_cannot_be_canaried_inside_is_refused_saying_why(config: dict[str, Any], composing: str,
                                                              words: str) -> None:
    with pytest.raises(Conflict, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan("pipe", config, composing, ["1"])


def test_steps_pinning_the_model_differently_are_refused() -> None:
    mixed = copy.deepcopy(PIPE)
    mixed["ensemble_scheduling"]["step"].append({"model_name": "qc", "model_version": 1})
    with pytest.raises(Conflict, match="pin different versions"):
        plan("pipe", mixed, "qc@3", ["1"])


@pytest.mark.parametrize(("spec", "words"), [
    ({"composing": "qc"}, "model@version"),
    ({"composing": "green:qc@3"}, "model@version"),
    ({"composing": "3"}, "model@version"),
    ({"composing": "qc@3", "baseline": "1"}, "no baseline"),
    ({}, "canary: the target to roll out"),
])
def test_a_composing_spec_is_validated(spec: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        RolloutSpec.model_validate(spec)


def test_the_pins_the_gateway_made_are_carried_from_record_to_record() -> None:
    variant = {**plan("pipe", PIPE, "qc@3", ["1"]), "kept_pins": {"post": "2"}}
    assert gateway_pins(None) == {}
    assert gateway_pins({"state": "progressing", "variant": {**variant, "state": "loaded"}}) == {"post": "2"}
    assert gateway_pins({"state": "promoted", "variant": {**variant, "state": "loaded"}}) == {"post": "2"}
    assert gateway_pins({"state": "promoted", "variant": {**variant, "state": "folded"}}) == {"post": "2", "qc": "3"}
    assert gateway_pins({"state": "rolled_back", "variant": {**variant, "state": "unloaded"}}) == {"post": "2"}
    assert gateway_pins({"state": "promoted", "variant": {}}) == {}
