"""The pin table notes what changed, for the background save to the store, and takes pins back."""

from __future__ import annotations

from gateway.sequences import SequencePins


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_changes_list_pins_touched_since_the_last_look_and_ended_ones_as_none() -> None:
    clock = Clock()
    pins = SequencePins(max_entries=2, idle_s=10, clock=clock)
    pins.pin("qc", 1, "3")
    pins.pin("qc", 2, "2")
    clock.now += 4
    assert pins.lookup("qc", 1) == "3"
    assert pins.take_changes() == {("qc", 1): ("3", 0.0), ("qc", 2): ("2", 4.0)}
    assert pins.take_changes() == {}, "nothing touched since"
    pins.release("qc", 1)
    pins.pin("qc", 3, "3")
    pins.pin("qc", 4, "3")  # over max_entries: the least recently used (2) is evicted
    assert pins.take_changes() == {("qc", 1): None, ("qc", 2): None, ("qc", 3): ("3", 0.0), ("qc", 4): ("3", 0.0)}
    pins.retry([("qc", 3)])
    assert list(pins.take_changes()) == [("qc", 3)]


def test_restored_pins_keep_their_idle_time_and_idle_ones_are_dropped() -> None:
    clock = Clock()
    pins = SequencePins(idle_s=10, clock=clock)
    pins.restore({("qc", 1): ("3", 2.0), ("qc", "s"): ("2", 9.0), ("qc", 9): ("3", 11.0)})
    assert pins.open_on("qc", "3") == 1 and pins.open_on("qc", "2") == 1, "9 had been idle too long"
    clock.now += 1.5
    assert pins.lookup("qc", "s") is None, "9 + 1.5 s idle: expired"
    assert pins.lookup("qc", 1) == "3"
    assert pins.take_changes() == {("qc", 1): ("3", 0.0)}, "restoring is not a change; using a pin is"
