"""Store calls on a time budget, for a caller that must not wait on a locked or silent store.

The rollout controller's tick decides rollbacks; a store that holds a lock (another process in
``BEGIN EXCLUSIVE`` on the SQLite file) or does not answer must not hold that decision back.
Inside ``with call_budget(seconds):`` every call through a :class:`BoundedStore` made by the
same task ends within ``seconds`` (a :class:`StoreError` otherwise), and once one has failed
the budget's later calls fail at once: the caller goes on from memory instead of paying the
wait again for each call. A backend that waits inside a call reads :data:`CALL_BUDGET_S`
(SQLite sets its busy timeout from it), so the call itself gives up too rather than finishing
later behind the caller's back. Calls outside a budget (admin requests, replica sync) are
passed through unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

from gateway.errors import StoreError
from gateway.store.base import StateStore

# Seconds the current store call may wait, when its caller set a budget (else None).
CALL_BUDGET_S: ContextVar[float | None] = ContextVar("store_call_budget_s", default=None)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.task = asyncio.current_task()
        self.failure: str | None = None  # why the store is not asked again under this budget


_ACTIVE: ContextVar[Budget | None] = ContextVar("store_budget", default=None)


@contextmanager
def call_budget(seconds: float) -> Iterator[Budget]:
    budget = Budget(seconds)
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


class BoundedStore:
    """``store``, with its calls bounded while the calling task has a :func:`call_budget`."""

    def __init__(self, store: StateStore) -> None:
        self.inner = store

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attribute):
            return attribute

        @functools.wraps(attribute)
        async def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = _ACTIVE.get()
            if budget is None or budget.task is not asyncio.current_task():  # a task spawned inside: not bounded
                return await attribute(*args, **kwargs)
            if budget.failure is not None:
                raise StoreError(f"{budget.failure} (earlier in this tick): not asked again")
            token = CALL_BUDGET_S.set(budget.seconds)
            try:
                async with asyncio.timeout(budget.seconds):
                    return await attribute(*args, **kwargs)
            except TimeoutError:
                budget.failure = f"the store did not answer within {budget.seconds:g}s"
                raise StoreError(budget.failure) from None
            except StoreError as exc:
                budget.failure = f"the store failed: {exc}"
                raise
            finally:
                CALL_BUDGET_S.reset(token)

        return bounded


def bounded(store: StateStore) -> StateStore:
    """A :class:`BoundedStore` over ``store``, typed as the store it stands for."""
    return cast(StateStore, BoundedStore(store))
