"""The background loops a component runs (sync, controller, log flusher, shadow workers).

Kept in one set so none is garbage-collected mid-flight, and cancelled and awaited together
at shutdown (uvicorn's habit). A loop that must run for the life of the process is started
with :meth:`Background.supervise`: if it crashes (a bug, an error nobody foresaw) it is
logged, counted and started again after a short backoff, instead of dying silently while
the process looks healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("gateway.background")
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
STABLE_S = 30.0  # a loop that ran this long before crashing starts again at the first backoff

CrashHook = Callable[[str, BaseException], None]


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.restarts: Counter[str] = Counter()  # loop name -> restarts, for /metrics

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def supervise(self, name: str, loop: Callable[[], Coroutine[Any, Any, Any]],
                  on_crash: CrashHook | None = None) -> asyncio.Task[Any]:
        """Run ``loop()`` forever: whenever it raises (or returns), log it, count it, call
        ``on_crash``, and start it again after a backoff (0.1 s doubling to 5 s)."""
        return self.spawn(self._supervised(name, loop, on_crash))

    async def _supervised(self, name: str, loop: Callable[[], Coroutine[Any, Any, Any]],
                          on_crash: CrashHook | None) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            try:
                await loop()
                problem: BaseException = RuntimeError(f"background loop {name} returned")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                problem = exc
            if time.monotonic() - started > STABLE_S:
                backoff = FIRST_BACKOFF_S
            self.restarts[name] += 1
            log.error("background loop %s stopped (%s: %s): restarting in %.1f s", name, type(problem).__name__,
                      problem, backoff, exc_info=problem)
            if on_crash is not None:
                on_crash(name, problem)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
