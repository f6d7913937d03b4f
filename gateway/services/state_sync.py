"""Keeps this replica's policy book in step with the shared store, whatever happens to it.

A change made through any replica reaches the others through the store's change feed
(Redis pub/sub: milliseconds; SQLite: polled); a periodic full resync heals anything the
feed missed. A store that counts its policy writes (SQLite: ``StateStore.policy_mark``) gives a
resync only the records written since its last read (``policies_since``), so an idle resync
reads one number, not every record (15-20 ms a pass at 5,000 models); one that cannot tell is
read whole. The feed says RESYNC whenever it (re)connects, so a change made while this replica
was not listening is found at once, not at the next periodic resync.

What the store holds wins, even when it went *back*: a new store generation (a wiped or
replaced store) or a revision below the book's (a failover that lost writes) rebuilds the
book from the store, and models gone from the store leave the book. One record that cannot
be read is skipped, logged once and counted; every other model keeps syncing, and the
book keeps the unreadable model's last good policy. A new store generation also gets the
config file's policies applied again (``on_new_store``): a wiped store forgot them too.

While the store is unreachable the book is left as it is (the data path keeps serving),
``store_up`` says so, and /readyz stays ready: pulling every replica out of the load
balancer would turn a control-plane outage into a data-plane one. A sync that fails for
any other reason (a bug) makes the replica unready after ``unready_after_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

from gateway.background import Background
from gateway.errors import CorruptRecord, StoreError
from gateway.services.policies import PolicyService
from gateway.store.base import RESYNC, PolicyScan, StateStore
from gateway.telemetry.recorder import Recorder

log = logging.getLogger("gateway.sync")
FEED_RETRY_S = (0.1, 0.5)  # first and longest wait before resubscribing: a change after a store
# outage must reach every replica within a second of the store coming back


class StateSync:
    def __init__(self, store: StateStore, policies: PolicyService, resync_interval_s: float,
                 unready_after_s: float = 30.0, recorder: Recorder | None = None,
                 on_new_store: Callable[[], Awaitable[object]] | None = None) -> None:
        self.on_new_store = on_new_store  # run when the store turns out to be a new one (wiped, replaced)
        self.store = store
        self.policies = policies
        self.book = policies.book
        self.resync_interval_s = resync_interval_s
        self.unready_after_s = unready_after_s
        # where /metrics reads sync errors and gateway_store_up
        self.recorder = recorder if recorder is not None else Recorder()
        self._failing_since: float | None = None  # first failure that is not the store being down
        self._last_failure = ""
        self._reported: dict[str, str] = {}  # model -> the unreadable record's message, logged once
        self._lock = asyncio.Lock()  # one sync step at a time: a rebuild never interleaves with a refresh
        # The store's policy mark (StateStore.policy_mark) as of the last read: a resync reads the
        # records written since (none: nothing), not all of them (15-20 ms each 5 s at 5,000 models).
        self._read_at_mark: str | None = None
        self._background = Background()

    @property
    def restarts(self) -> Counter[str]:
        return self._background.restarts

    @property
    def errors(self) -> Mapping[str, int]:
        return self.recorder.sync_errors

    @property
    def store_up(self) -> bool:
        return self.recorder.store_up

    # -- one sync step ------------------------------------------------------------------------
    async def resync(self) -> None:
        """Bring the book to everything the store holds."""
        async with self._lock:
            await self._resync()
        self._succeeded()

    async def refresh(self, model: str) -> None:
        """Bring one model to the store (a feed message); a store that went back rebuilds all."""
        async with self._lock:
            try:
                stored = await self.store.get_policy(model)
            except CorruptRecord as exc:
                self._corrupt({model: exc.message})
                return
            if stored is None:
                if await self.store.generation() != self.book.generation:
                    await self._resync()
                elif model in self.book.known():
                    self.book.remove(model)  # removed from the store behind our back
                return
            self._healed(model)
            known = self.book.revision(model)
            if stored.generation != self.book.generation or (known is not None and stored.revision < known):
                await self._resync()
            else:
                self.policies.apply(stored)
        self._mark_store(True)

    async def _resync(self) -> None:
        if self._read_at_mark is not None and not self._reported and await self._read_written():
            return
        mark = await self.store.policy_mark()
        self._read_at_mark = None  # until this read has been applied whole
        await self._read_all()
        self._read_at_mark = mark

    async def _read_written(self) -> bool:
        """Only the records written since the last read (``StateStore.policies_since``); False
        when the store cannot tell them apart, or one went back: then everything is read."""
        assert self._read_at_mark is not None
        written = await self.store.policies_since(self._read_at_mark)
        self._mark_store(True)
        if written is None:
            return False
        mark, policies = written
        if any(stored.revision < (self.book.revision(model) or 0) for model, stored in policies.items()):
            return False  # a store that went back: the full read rebuilds
        for stored in policies.values():
            self.policies.apply(stored)
        self._read_at_mark = mark
        return True

    async def _read_all(self) -> None:
        scan = await self.store.scan_policies()
        self._mark_store(True)
        self._corrupt(scan.corrupt)
        for model in set(self._reported) - scan.corrupt.keys():
            self._healed(model)
        if scan.generation != self.book.generation and self.book.generation is not None and self.on_new_store:
            # A wiped store lost the config file's intent too: declare it again (every replica may;
            # compare-and-set keeps it to one write per model), then build the book from both.
            log.warning("the store is a new one (generation %s): applying the config file's policies to it",
                        scan.generation)
            await self.on_new_store()
            scan = await self.store.scan_policies()
        went_back = [m for m, p in scan.policies.items() if p.revision < (self.book.revision(m) or 0)]
        if scan.generation != self.book.generation or went_back:
            self._rebuild(scan, went_back)
            return
        for stored in scan.policies.values():
            self.policies.apply(stored)
        for model in self.book.known() - scan.policies.keys() - scan.corrupt.keys():
            if self.book.holds(model):
                log.warning("policy of %s is gone from the store: back to Triton's default version", model)
            self.book.remove(model)

    def _rebuild(self, scan: PolicyScan, went_back: list[str]) -> None:
        if self.book.generation is not None:
            why = (f"the store is a new one (generation {scan.generation}): wiped, or replaced by a failover"
                   if scan.generation != self.book.generation else
                   f"the store went back to older revisions for {sorted(went_back)} (a failover that lost writes?)")
            log.warning("rebuilding the policy book from the store: %s", why)
        specs = {m: (p.spec, p.revision) for m, p in scan.policies.items() if p.spec is not None}
        tombstones = {m: p.revision for m, p in scan.policies.items() if p.spec is None}
        self.book.rebuild(scan.generation, specs, tombstones, keep=set(scan.corrupt))

    # -- bookkeeping ----------------------------------------------------------------------------
    def _corrupt(self, corrupt: dict[str, str]) -> None:
        for model, message in corrupt.items():
            self.recorder.count_sync_error("corrupt_record")
            if self._reported.get(model) != message:
                self._reported[model] = message
                log.error("%s: skipped, the replica keeps its last good policy for %s until the record is "
                          "fixed (PUT a new policy to replace it)", message, model)

    def _healed(self, model: str) -> None:
        if self._reported.pop(model, None) is not None:
            log.info("stored policy of %s is readable again", model)

    def _mark_store(self, up: bool, problem: BaseException | None = None) -> None:
        if up and not self.store_up:
            log.info("state store reachable again")
        elif not up:
            self.recorder.count_sync_error("store_unreachable")
            if self.store_up:
                log.warning("state store unreachable (%s): serving from the last policies until it is back",
                            problem)
        self.recorder.store_up = up

    def _succeeded(self) -> None:
        self._failing_since = None

    def _crashed(self, name: str, problem: BaseException) -> None:
        self.recorder.count_sync_error("internal")
        self.recorder.count_loop_restart(name)
        self._last_failure = f"{name}: {type(problem).__name__}: {problem}"
        if self._failing_since is None:
            self._failing_since = time.monotonic()

    def problem(self) -> str | None:
        """Why this replica should not be ready, or None (an unreachable store is not a reason)."""
        if self._failing_since is None:
            return None
        failing_s = time.monotonic() - self._failing_since
        if failing_s <= self.unready_after_s:
            return None
        return f"policy sync has been failing for {failing_s:.0f} s ({self._last_failure})"

    # -- the loops ------------------------------------------------------------------------------
    def start(self) -> None:
        self._background.supervise("state-sync-feed", self._follow_feed, self._crashed)
        self._background.supervise("state-sync-resync", self._resync_forever, self._crashed)

    async def stop(self) -> None:
        await self._background.cancel_all()

    async def _follow_feed(self) -> None:
        wait = FEED_RETRY_S[0]
        while True:
            try:
                async for model in self.store.changes():
                    wait = FEED_RETRY_S[0]
                    if model == RESYNC:
                        await self.resync()
                    else:
                        await self.refresh(model)
            except StoreError as exc:
                self._mark_store(False, exc)
            await asyncio.sleep(wait)
            wait = min(wait * 2, FEED_RETRY_S[1])

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval_s)
            try:
                await self.resync()
            except StoreError as exc:
                self._mark_store(False, exc)
