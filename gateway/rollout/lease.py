"""The rollout controller's fenced lease, kept apart from its ticks.

One replica holds the lease and judges every rollout; each of its writes carries the lease's
epoch, so a deposed holder's writes are refused by the store. The lease is short (``controller_
lease_ttl_s``, 3 s) and renewed often, by a task of its own rather than by the tick: when its
holder dies (kill -9) another replica takes over within the TTL and one ask, and its first tick
runs at once, so a rollback the dead holder had not applied yet is applied within seconds (the
lease moved 14.6 s after the kill with the 15 s lease renewed by ticks); and a tick that waits
on a slow Prometheus or Triton never lets the lease lapse under it.

- a holder renews every ``ttl / 3``; one whose lease lapsed (starved, paused) takes it again only
  if no other replica has taken it meanwhile, else it stops judging;
- a replica without the lease asks for it every ``min(tick_s, ttl / 6)``;
- with the store away the last holder keeps ticking from memory (no one else can take the lease),
  probes the store briefly until it answers, and then takes the lease again if it lapsed meanwhile
  and no one else has (what it decided from memory is written under the new epoch);
- a graceful stop gives the lease up at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.errors import StoreError
from gateway.store.base import Fence, StateStore
from gateway.store.budget import Budget, call_budget

log = logging.getLogger("gateway.rollout")
LEASE = "rollout-controller"
LEASE_PROBE_S = 0.25  # a renewal's budget while the store is away (an answering store takes milliseconds)


class ControllerLease:
    def __init__(self, store: StateStore, holder: str, ttl_s: float, tick_s: float, call_timeout_s: float,
                 on_lost: Callable[[], Awaitable[None]], on_held: Callable[[], None]) -> None:
        self.store = store
        self.holder = holder
        self.ttl_s = ttl_s
        self.tick_s = tick_s
        self.call_timeout_s = call_timeout_s
        self.on_lost = on_lost  # the controller forgets what it could not save
        self.on_held = on_held  # each renewal: restore the versions the gateway loaded, if Triton lost them
        self.fence: Fence | None = None  # set while this replica holds the lease
        self.store_away = False  # the last renewal failed (store locked, down or silent)
        self.taken = asyncio.Event()  # the lease was just taken: tick now
        self.keeping = False  # keep() runs: the ticks leave the renewals to it

    @property
    def tick_bound_s(self) -> float:
        """A tick is cut off past this: half the lease, or room for its four bounded calls."""
        return max(self.ttl_s / 2, 4 * self.call_timeout_s)

    def renewal_budget_s(self) -> float:
        # Once the store has failed a renewal, it is only probed (briefly) until it answers
        # again: a last holder ticking from memory does not wait a call timeout every tick.
        budget = min(self.call_timeout_s, self.ttl_s / 3)
        return budget if not self.store_away else min(budget, LEASE_PROBE_S)

    async def keep(self) -> None:
        """Renew while held, ask while not, until cancelled."""
        self.keeping = True
        while True:
            try:
                with call_budget(self.renewal_budget_s()):
                    await self.hold()
            except Exception:  # the keeper must go on: the tick reports store trouble itself
                log.exception("rollout controller: keeping the lease failed")
            await asyncio.sleep(self.ttl_s / 3 if self.fence is not None else min(self.tick_s, self.ttl_s / 6))

    async def hold(self, budget: Budget | None = None) -> bool:
        """Renew the lease while held, else take it if it is free. True while this replica holds
        it, or held it last and the store is away (it goes on ticking from memory). A failed call
        is noted on ``budget``: the tick then asks the store nothing more."""
        fence = self.fence
        try:
            if fence is not None:
                renewed = await self.store.renew_fenced_lease(LEASE, self.holder, fence.epoch, self.ttl_s)
                # lapsed (the store was away, this process was starved or paused): taken again
                # only if no other replica has taken it meanwhile, keeping what it decided since
                epoch = fence.epoch if renewed else await self.store.acquire_fenced_lease(
                    LEASE, self.holder, self.ttl_s)
            else:
                epoch = await self.store.acquire_fenced_lease(LEASE, self.holder, self.ttl_s)
        except StoreError as exc:
            self.store_away = True
            if budget is not None:
                budget.failure = f"the lease was not renewed: {exc}"
            if self.fence is None:
                return False
            log.warning("rollout controller: lease not renewed (%s): last holder, ticking from memory", exc)
            return True
        self.store_away = False
        if self.fence is not fence:  # the other caller (tick or keeper) changed it meanwhile
            return self.fence is not None
        if fence is not None and epoch is None:
            log.warning("rollout controller: lease lost (epoch %d): another replica holds it", fence.epoch)
            await self.lost(fence)
            return False
        if epoch is None:
            return False
        if fence is None or fence.epoch != epoch:
            self.fence = Fence(LEASE, self.holder, epoch)
            log.info("rollout controller: lease taken (epoch %d)", epoch)
            self.taken.set()
        self.on_held()
        return True

    async def lost(self, fence: Fence | None) -> None:
        """``fence`` turned out stale (another replica holds the lease, a fenced write was refused):
        the controller forgets what it could not save; a lease taken since is left alone."""
        if fence is None or self.fence is not fence:
            return
        await self.on_lost()

    async def hand_over(self) -> None:
        """A graceful stop gives the lease up, so another replica takes it at its next ask instead of
        after the TTL (kill -9 leaves it to the TTL)."""
        fence, self.fence = self.fence, None
        if fence is None:
            return
        try:
            with call_budget(min(self.call_timeout_s, 1.0)):
                await self.store.release_fenced_lease(LEASE, self.holder, fence.epoch)
        except (StoreError, TimeoutError) as exc:
            log.warning("rollout controller: the lease was not given up (%s): it lapses in %gs", exc, self.ttl_s)
