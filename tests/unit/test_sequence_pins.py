"""The pin table: notes what changed (for the background save to the store), takes pins back,
pins only a sequence's start, shares pins between replicas through the store; and the
``auto`` affinity that follows Triton's configs."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.routing import Reason, choose_in_sequence, compile_policy
from gateway.sequences import SequencePins
from gateway.store.records import spec_from_document, stored_spec
from gateway.workers.pins import VERSION_TABLE, PinService


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


# -- pins shared between replicas, made only by a sequence's start ------------------------------


class SharedPins:
    """The store's side of the pin table, for one test: what every replica reads and writes."""

    def __init__(self) -> None:
        self.pins: dict[tuple[str, object], str] = {}
        self.reads = 0
        self.down = False

    async def find(self, model: str, sequence_id: object) -> tuple[bool, str | None]:
        self.reads += 1
        return (False, None) if self.down else (True, self.pins.get((model, sequence_id)))

    async def publish(self, model: str, sequence_id: object, version: str | None) -> None:
        if self.down:
            return
        if version is None:
            self.pins.pop((model, sequence_id), None)
        else:
            self.pins[(model, sequence_id)] = version


def replica(shared: SharedPins, clock: Clock) -> SequencePins:
    pins = SequencePins(idle_s=60, clock=clock)
    pins.directory = shared
    return pins


def test_only_a_start_makes_a_pin() -> None:
    policy = compile_policy("seq", PolicySpec.model_validate({"weights": {"1": 50, "2": 50}}), sequence_batched=True)
    pins = SequencePins()
    for draw in (0, 9999):
        assert choose_in_sequence(policy, {}, draw, pins, 5, start=False, end=False) is None, "not pinned: ask on"
    assert len(pins) == 0
    started = choose_in_sequence(policy, {}, 9999, pins, 5, start=True, end=False)
    assert started is not None and pins.lookup("seq", 5) == started.version
    again = choose_in_sequence(policy, {}, 0, pins, 5, start=False, end=True)
    assert again is not None and again.reason == Reason.SEQUENCE and again.version == started.version
    assert len(pins) == 0, "the end lets the pin go"
    assert choose_in_sequence(policy, {}, 0, pins, 6, start=True, end=True) is not None and len(pins) == 0


def test_a_pin_made_on_one_replica_is_found_by_another_and_a_stale_one_is_checked() -> None:
    clock, shared = Clock(), SharedPins()
    a, b = replica(shared, clock), replica(shared, clock)
    a.pin("seq", 7, "1")
    asyncio.run(a.share("seq", 7))
    assert b.recent("seq", 7) is None, "b has never seen it"
    assert asyncio.run(b.resolve("seq", 7, end=False)) == "1" and b.recent("seq", 7) == "1"
    reads = shared.reads
    assert b.recent("seq", 7) == "1" and shared.reads == reads, "a busy sequence is routed with no store read"
    # the sequence ends on b, and its id starts again on b on version 2; a's old pin must not win
    assert asyncio.run(b.resolve("seq", 7, end=True)) == "1"
    asyncio.run(b.share("seq", 7))  # the end's release, written through
    assert shared.pins == {}
    b.pin("seq", 7, "2")
    asyncio.run(b.share("seq", 7))
    clock.now += 2  # past revalidate_s: a asks the store before trusting its own pin
    assert a.recent("seq", 7) is None
    assert asyncio.run(a.resolve("seq", 7, end=False)) == "2"


def test_with_the_store_down_a_replica_routes_by_its_own_pin() -> None:
    clock, shared = Clock(), SharedPins()
    a = replica(shared, clock)
    a.pin("seq", 8, "2")
    shared.down = True
    clock.now += 5
    assert asyncio.run(a.resolve("seq", 8, end=False)) == "2", "the local pin, when the store cannot be asked"
    assert asyncio.run(a.resolve("seq", 9, end=False)) is None


def test_auto_affinity_follows_the_models_triton_batches_sequences_for() -> None:
    book = PolicyBook()
    book.put("seq", PolicySpec.model_validate({"weights": {"1": 100}}), 1)
    book.put("forced", PolicySpec.model_validate({"weights": {"1": 100}, "sequence_affinity": True}), 1)
    book.put("off", PolicySpec.model_validate({"weights": {"1": 100}, "sequence_affinity": False}), 1)

    def on() -> dict[str, bool]:
        return {model: policy.sequence_affinity for model, policy in book.snapshot().items()}

    assert on() == {"seq": False, "forced": True, "off": False}, "auto: off until Triton's config is read"
    book.set_sequence_models({"seq", "off", "forced"})
    assert on() == {"seq": True, "forced": True, "off": False}, "true and false force it"
    book.set_sequence_models(set())
    assert on() == {"seq": False, "forced": True, "off": False}


def test_stored_policies_from_before_auto_read_their_false_as_auto() -> None:
    """Older gateways wrote ``false`` (their default) into every policy: read as the new default."""
    old: dict[str, Any] = {"weights": {"1": 100}, "sticky_header": None, "rules": [], "shadow": None,
                           "sequence_affinity": False}
    assert spec_from_document(old, "old").sequence_affinity == "auto"
    assert spec_from_document({**old, "sequence_affinity": True}, "old").sequence_affinity is True
    chosen = PolicySpec.model_validate({"weights": {"1": 100}, "sequence_affinity": False})
    assert spec_from_document(stored_spec(chosen), "new").sequence_affinity is False, "a choice made now stays"
    assert spec_from_document({"weights": {"1": 100}}, "oldest").sequence_affinity == "auto"


# -- one client's starts cannot push out another client's pins (issue 22) -----------------------


def test_a_client_past_its_quota_evicts_only_its_own_least_recently_used_pins() -> None:
    clock = Clock()
    pins = SequencePins(max_entries=200, idle_s=60, clock=clock, max_per_client=20)
    pins.pin("seq", "victim-1", "1", "10.0.0.1")
    pins.pin("seq", "victim-2", "1", "10.0.0.2")
    pins.restore({("seq", "restored"): ("2", 1.0)})  # no owner: the store keeps none
    pins.take_changes()
    for sid in range(1_000):
        clock.now += 0.001
        pins.pin("seq", sid, "2", "10.6.6.6")
        if sid % 10 == 0:  # the attacker keeps its first sequence busy: its least recently used go first
            assert pins.lookup("seq", 0) == "2"
    assert pins.lookup("seq", "victim-1") == "1" and pins.lookup("seq", "victim-2") == "1"
    assert pins.lookup("seq", "restored") == "2", "a pin without an owner is no client's to evict"
    assert pins.held_by("10.6.6.6") == 20 and len(pins) == 23
    kept = {sid for sid in range(1_000) if pins.lookup("seq", sid) is not None}
    assert kept == {0, *range(981, 1_000)}, "its busy first sequence and its 19 newest"
    changes = pins.take_changes()
    assert changes[("seq", 1)] is None and changes[("seq", 980)] is None, "evictions reach the store"
    assert pins.held_by("10.0.0.1") == 1


def test_the_tables_own_bound_still_holds_across_many_clients_and_ends_free_a_clients_quota() -> None:
    clock = Clock()
    pins = SequencePins(max_entries=50, idle_s=60, clock=clock, max_per_client=20)
    for client in range(10):  # 10 clients x 10 pins: each under its quota, 100 over the table
        for sid in range(10):
            clock.now += 0.001
            pins.pin("seq", (client, sid), "1", f"10.0.0.{client}")
    assert len(pins) == 50, "the least recently used of all go past max_entries"
    assert [pins.held_by(f"10.0.0.{client}") for client in range(10)] == [0] * 5 + [10] * 5
    assert pins._owned.keys() == {f"10.0.0.{client}" for client in range(5, 10)}, "no empty owner is kept"
    for sid in range(10):
        pins.release("seq", (9, sid))
    assert pins.held_by("10.0.0.9") == 0 and len(pins) == 40
    clock.now += 61  # idle: gone, and off their owners' quotas
    assert pins.open_on("seq", "1") == 0 and not pins._owned


def test_an_id_started_again_by_another_client_moves_to_that_clients_quota() -> None:
    pins = SequencePins(max_per_client=2)
    pins.pin("seq", 1, "1", "a")
    pins.pin("seq", 1, "2", "b")
    assert pins.held_by("a") == 0 and pins.held_by("b") == 1
    pins.pin("seq", 2, "1", "a")
    pins.pin("seq", 3, "1", "a")
    pins.pin("seq", 4, "1", "a")  # a's third: its own oldest (2) goes, b's pin stays
    assert pins.lookup("seq", 2) is None and pins.lookup("seq", 1) == "2" and pins.held_by("a") == 2


def test_a_pin_read_from_the_store_has_no_owner_here() -> None:
    """The replica the sequence started on holds it against its client; here it is bounded by
    the table (and its eviction there deletes it from the store)."""
    clock, shared = Clock(), SharedPins()
    a, b = replica(shared, clock), replica(shared, clock)
    a.pin("seq", 7, "1", "10.0.0.1")
    asyncio.run(a.share("seq", 7))
    assert asyncio.run(b.resolve("seq", 7, end=False)) == "1"
    assert a.held_by("10.0.0.1") == 1 and b.held_by("10.0.0.1") == 0 and len(b) == 1


def test_choose_in_sequence_pins_a_start_for_its_client() -> None:
    policy = compile_policy("seq", PolicySpec.model_validate({"weights": {"1": 50, "2": 50}}), sequence_batched=True)
    pins = SequencePins(max_per_client=1)
    first = choose_in_sequence(policy, {}, 0, pins, 5, start=True, end=False, client="10.0.0.1")
    other = choose_in_sequence(policy, {}, 0, pins, 6, start=True, end=False, client="10.0.0.2")
    assert first is not None and other is not None and first.version == other.version, "the client changes no decision"
    choose_in_sequence(policy, {}, 0, pins, 7, start=True, end=False, client="10.0.0.1")
    assert pins.lookup("seq", 5) is None and pins.lookup("seq", 6) == other.version


def test_a_workers_start_is_held_against_its_client_in_the_nodes_table() -> None:
    """--workers: a worker's pin call carries the client, so the quota is the node's."""
    pins = SequencePins(max_per_client=1)
    service = PinService(lambda table: pins if table == VERSION_TABLE else None)
    for sequence_id in (1, 2):
        asyncio.run(service.answer("pin", VERSION_TABLE, b"seq", sequence_id, "2", "10.0.0.1"))
    asyncio.run(service.answer("pin", VERSION_TABLE, b"seq", 3, "1", "10.0.0.2"))
    assert pins.held_by("10.0.0.1") == 1 and pins.lookup("seq", 1) is None
    assert pins.lookup("seq", 2) == "2" and pins.lookup("seq", 3) == "1"


def test_a_repin_keeps_the_owner_a_pin_has_and_a_new_one_is_its_clients_through_a_worker_too() -> None:
    """A fleet re-pins a continuing sequence whose server left, or whose pin is gone: a pin there
    was stays its starter's (a continuation from elsewhere does not take it over); a new one is
    held to the continuing client's quota. Through the node's table with --workers alike."""
    pins = SequencePins(max_per_client=1)
    service = PinService(lambda table: pins if table == "fleet:default" else None)
    asyncio.run(service.answer("pin", "fleet:default", b"qc", 1, "server-a", "10.0.0.1"))
    asyncio.run(service.answer("repin", "fleet:default", b"qc", 1, "server-b", "10.6.6.6"))
    assert pins.lookup("qc", 1) == "server-b" and pins.held_by("10.0.0.1") == 1 and pins.held_by("10.6.6.6") == 0
    for sequence_id in (2, 3):  # made-up continuations: each is 10.6.6.6's, within its quota of 1
        asyncio.run(service.answer("repin", "fleet:default", b"qc", sequence_id, "server-a", "10.6.6.6"))
    assert pins.held_by("10.6.6.6") == 1 and pins.lookup("qc", 2) is None and pins.lookup("qc", 1) == "server-b"
