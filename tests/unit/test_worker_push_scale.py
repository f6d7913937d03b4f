"""A policy change reaches the workers as that one model: counted, never timed.

Before issue 36 every change pushed every policy to every worker (5,000 specs pickled per PUT
per worker at 5,000 models), and each worker recompiled its whole book. A worker's first push
(after hello) is still the whole book.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

from gateway.devtools.local_triton import free_port
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.settings import Settings
from gateway.workers.deltas import DeltaRecorder
from gateway.workers.supervisor import Supervisor
from gateway.workers.worker import WorkerGateway

MODELS = 5000


class Captured:
    """A worker's end of the channel, as the supervisor sees it: what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, *message: Any) -> None:
        self.sent.append(message)


async def test_a_put_pushes_its_one_model_and_a_new_worker_gets_the_whole_book() -> None:
    settings = Settings.load(None, host="127.0.0.1", port=free_port(), triton_url="http://127.0.0.1:1", store_url="memory://",
                             grpc_enabled=False, workers=2)
    supervisor = Supervisor(settings)
    try:
        spec = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
        book = supervisor.control.book
        book.rebuild("g", {f"m{index:05d}": (spec, 1) for index in range(MODELS)}, {})
        channel = Captured()
        supervisor.slots[0].channel = channel  # type: ignore[assignment]
        await asyncio.sleep(0)  # the rebuild's push
        channel.sent.clear()
        book.put("m00042", PolicySpec.model_validate({"weights": {"2": 50, "3": 50}}), 2)
        book.remove("m00043", 2)
        await asyncio.sleep(0)
        assert len(channel.sent) == 1
        kind, push, specs, *_ = channel.sent[0]
        assert kind == "policies" and set(specs) == {"m00042", "m00043"} and specs["m00043"] is None
        first = supervisor._policies()  # what a worker gets after its hello
        assert len(first[2]) == MODELS - 1
        worker = WorkerGateway.__new__(WorkerGateway)  # only its policy book and recorder are used here
        worker.book, worker.recorder, worker.channel, worker._first_push = PolicyBook(), DeltaRecorder(), None, \
            asyncio.Event()
        worker._apply(*first[1:])
        worker._apply(*channel.sent[0][1:])
        assert len(worker.book.snapshot()) == MODELS - 1 and worker.book.get("m00043") is None
        changed = worker.book.get("m00042")
        assert changed is not None and changed.spec.weights["3"] == 50
        assert worker.push == push
    finally:
        supervisor._close_listeners(supervisor.slot_listeners or ([supervisor.shared] if supervisor.shared else []))
        shutil.rmtree(supervisor.run_dir, ignore_errors=True)
