"""What the controller puts back after Triton lost it: the gateway's own loads and unloads only."""

from __future__ import annotations

from gateway.services.triton_control import restore_target, with_change


def test_the_last_word_on_a_version_wins() -> None:
    changes = with_change([], loaded=["4"])
    assert changes == ["4"]
    changes = with_change(changes, unloaded=["1"])
    assert changes == ["-1", "4"]
    assert with_change(changes, loaded=["1"]) == ["1", "4"], "loaded again through the gateway"
    assert with_change(["2", "3", "10"], unloaded=["3"]) == ["2", "-3", "10"], "an old record (the whole set)"


def test_only_what_the_gateway_changed_is_put_back() -> None:
    assert restore_target({"1", "2", "3"}, ["-1"]) == {"2", "3"}, "Triton restarted: the gateway's unload again"
    assert restore_target({"2"}, ["-1"]) is None, "3 unloaded on Triton's port: left alone"
    assert restore_target({"2", "3", "5"}, ["-1"]) is None, "5 loaded on Triton's port: left alone"
    assert restore_target({"1", "2"}, ["4", "-1"]) == {"2", "4"}, "the gateway's load of 4 again"
    assert restore_target({"1"}, ["-1"]) is None, "never nothing at all"
    assert restore_target({"1", "2"}, []) is None
