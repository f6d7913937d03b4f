"""Keeps this replica's policy book in step with the shared store.

A change made through any replica reaches the others through the store's change feed
(Redis pub/sub: milliseconds; SQLite: polled); a periodic full resync heals anything the
feed missed (a dropped connection, a message lost while reconnecting).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.background import Background
from gateway.errors import GatewayError
from gateway.services.policies import PolicyService
from gateway.store.base import StateStore

log = logging.getLogger("gateway.sync")


class StateSync:
    def __init__(self, store: StateStore, policies: PolicyService, resync_interval_s: float) -> None:
        self.store = store
        self.policies = policies
        self.resync_interval_s = resync_interval_s
        self._background = Background()

    async def resync(self) -> None:
        for stored in (await self.store.list_policies()).values():
            self.policies.apply(stored)

    async def refresh(self, model: str) -> None:
        stored = await self.store.get_policy(model)
        if stored is not None:
            self.policies.apply(stored)

    def start(self) -> None:
        self._background.spawn(self._follow_feed())
        self._background.spawn(self._resync_forever())

    async def stop(self) -> None:
        await self._background.cancel_all()

    async def _follow_feed(self) -> None:
        while True:
            try:
                async for model in self.store.changes():
                    await self.refresh(model)
            except GatewayError as exc:
                log.warning("change feed interrupted (%s); resubscribing", exc)
            await asyncio.sleep(1.0)

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resync_interval_s)
            try:
                await self.resync()
            except GatewayError as exc:
                log.warning("policy resync failed: %s", exc)
