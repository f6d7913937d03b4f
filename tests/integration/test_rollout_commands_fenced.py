"""Admin commands against the lease holder's tick, two replicas on one real Redis (issue 23).

The interleaving is forced at the store: the lease holder's policy write for its next step is
held until the abort (served by the other replica) has announced its own write, and the
abort's policy write is held until the holder's has been tried. Before the rollout record and
the policy were tied together (store Guards), the holder's write landed, the abort's failed
StaleRevision, the store kept `aborted` with the advanced weights, and the next tick left
them "as set": the canary kept its traffic.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gateway.errors import StaleRevision
from tests.support import TOKEN, BackgroundLoad, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton
TICK = 0.2


def held(method: Callable[..., Any], before: Callable[[], Any] | None = None,
         after: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """``method`` (a store coroutine method) with an async hook before and a sync one after."""

    async def call(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            await before()
        try:
            result = await method(*args, **kwargs)
        except Exception as exc:
            if after is not None:
                after(exc)
            raise
        if after is not None:
            after(result)
        return result

    return call


def book_weights(gateway: GatewayThread) -> dict[str, int]:
    policy = gateway.app.book.get("qc")
    return {v: int(w) for v, w in policy.spec.weights.items() if w} if policy is not None else {}


async def until(event: threading.Event, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the forced interleaving did not happen")


def test_an_abort_served_by_the_other_replica_is_not_lost_to_the_holders_concurrent_advance(
        triton: Any, redis_url: str) -> None:
    def settings() -> Any:
        return gateway_settings(triton.http_url, admin_token=TOKEN, controller_tick_s=TICK, store_url=redis_url,
                                policies={"qc": {"weights": {"2": 100}}})

    with GatewayThread(settings()) as one, GatewayThread(settings()) as two:
        fence = wait_for(lambda: one.app.rollouts.fence or two.app.rollouts.fence, 5, what="a lease holder")
        holder, other = (one, two) if fence is one.app.rollouts.fence else (two, one)
        with BackgroundLoad(holder.url, concurrency=4):
            status, doc = admin_call(holder.url, "POST", "/admin/models/qc/rollout",
                                     {"canary": "3", "steps": [10, 50, 100], "interval_s": 1, "min_requests": 10,
                                      "judge": "thresholds"})
            assert status == 200, doc
            holder_writing, abort_announced, holder_tried = threading.Event(), threading.Event(), threading.Event()
            outcome: list[Any] = []

            async def wait_for_the_abort() -> None:
                holder_writing.set()
                await until(abort_announced)

            def holder_done(result: Any) -> None:
                outcome.append(result)
                holder_tried.set()

            def abort_announced_now(result: Any) -> None:
                if isinstance(result, Exception) or result.document["state"] != "aborted":
                    return
                abort_announced.set()

            async def after_the_holder() -> None:
                if abort_announced.is_set():
                    await until(holder_tried)

            store_h, store_o = holder.app.store, other.app.store
            store_h.put_policy_fenced = held(store_h.put_policy_fenced, wait_for_the_abort,  # type: ignore[method-assign]
                                             holder_done)
            store_o.put_rollout = held(store_o.put_rollout, after=abort_announced_now)  # type: ignore[method-assign]
            store_o.put_policy = held(store_o.put_policy, after_the_holder)  # type: ignore[method-assign]
            assert holder_writing.wait(10), "the holder's next step reached its policy write"
            status, doc = admin_call(other.url, "POST", "/admin/models/qc/rollout/abort")
            assert status == 200, doc
            assert abort_announced.is_set() and holder_tried.is_set(), "the interleaving was forced"
            assert isinstance(outcome[0], StaleRevision), "the holder's write, announced before the abort, was refused"
            stored = wait_for(lambda: (d := admin_call(holder.url, "GET", "/admin/models/qc/rollout")[1])["applied"]
                              and d, 5, what="the abort applied")
            assert stored["state"] == "aborted", stored["reason"]
            _, policy = admin_call(holder.url, "GET", "/admin/models/qc/policy")
            assert {v: w for v, w in policy["weights"].items() if w} == {"2": 100}, policy
            for gateway in (holder, other):
                wait_for(lambda gw=gateway: book_weights(gw) == {"2": 100}, 5,
                         what="both replicas' books at the stable")
