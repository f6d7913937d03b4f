"""What the gateway reads of one Triton server, shared by everyone who asks within an age bound.

Triton's repository index lists every version of every model: 810 KB at 5,000 models. The
fleet's health check, the rollout controller and the model-config reader each read it, and the
controller did once per rollout per tick (50 rollouts at 5,000 models: 0.3 CPU s/s with no
traffic, bench/scale.py). Here each server has one :class:`ServerReads`: a read of a path is
shared by every caller that accepts an answer at most ``max_age_s`` old, and callers that ask
while a read is under way wait for it instead of sending their own (single flight). So the
index is read at most once per server per age bound, whoever asks.

An index whose bytes did not change since the previous read is not parsed again: the parsed
:class:`RepositoryIndex` is the same object, so readers can tell "nothing changed" by identity.

Other per-server reads (a model's statistics, its configuration) go through :meth:`ServerReads.read`
with a path of their own, and get the same sharing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.errors import UpstreamError

if TYPE_CHECKING:
    from gateway.fleet.members import Server

T = TypeVar("T")
INDEX_PATH = "/v2/repository/index"
_JSON = [(b"content-type", b"application/json")]


class RepositoryIndex:
    """One server's repository index as read at ``at`` (monotonic): Triton's entries, and per
    model each version's (state, reason) and the READY versions, built once per distinct answer."""

    __slots__ = ("raw", "at", "entries", "states", "ready")

    def __init__(self, raw: bytes, at: float) -> None:
        entries = json.loads(raw)
        if not isinstance(entries, list):
            raise ValueError("the repository index is not a list")
        states: dict[str, dict[str, tuple[str, str]]] = {}
        ready: dict[str, set[str]] = {}
        for entry in entries:
            if not isinstance(entry, dict) or "version" not in entry:
                continue
            model, version, state = str(entry.get("name")), str(entry["version"]), str(entry.get("state", "UNKNOWN"))
            states.setdefault(model, {})[version] = (state, str(entry.get("reason", "")))
            if state == "READY":
                ready.setdefault(model, set()).add(version)
        self.raw = raw
        self.at = at
        self.entries: list[dict[str, Any]] = [entry for entry in entries if isinstance(entry, dict)]
        self.states: Mapping[str, Mapping[str, tuple[str, str]]] = states
        # model -> READY versions; shared by every reader of this answer, never changed
        self.ready: dict[str, frozenset[str]] = {model: frozenset(found) for model, found in ready.items()}


class ServerReads:
    """The last answer per path of one server, and the read under way per path."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.sent = 0  # reads sent to the server (what sharing saves is visible: tests, benchmark)
        self._answers: dict[str, tuple[float, Any]] = {}
        self._pending: dict[str, tuple[float, asyncio.Future[Any]]] = {}  # path -> (asked at, read)
        self._index: RepositoryIndex | None = None

    async def read(self, path: str, fetch: Callable[[], Awaitable[T]], max_age_s: float) -> T:
        """``fetch()``'s answer for ``path``: the last one if it was asked less than ``max_age_s``
        ago, or the one under way if that was; else a new read (``max_age_s`` 0: always a read
        sent after this call, as a check right after a load needs). A failed read is not kept:
        the next caller tries again (and every caller waiting on it gets its error)."""
        now = self.clock()
        kept = self._answers.get(path)
        if kept is not None and now - kept[0] < max_age_s:
            answer: T = kept[1]
            return answer
        pending = self._pending.get(path)
        if pending is None or now - pending[0] >= max_age_s:
            future = asyncio.ensure_future(self._fetch(path, fetch, now))
            pending = self._pending[path] = (now, future)
            future.add_done_callback(lambda done: self._forget(path, done))
        found: T = await asyncio.shield(pending[1])
        return found

    def _forget(self, path: str, done: asyncio.Future[Any]) -> None:
        pending = self._pending.get(path)
        if pending is not None and pending[1] is done:
            del self._pending[path]

    async def _fetch(self, path: str, fetch: Callable[[], Awaitable[T]], asked: float) -> T:
        self.sent += 1
        answer = await fetch()
        kept = self._answers.get(path)
        if kept is None or kept[0] <= asked:  # a later read may have finished first: the newest stays
            self._answers[path] = (asked, answer)  # as old as the moment it was asked
        return answer

    async def index(self, server: Server, timeout_s: float, max_age_s: float = 0.0) -> RepositoryIndex:
        """The server's repository index, at most ``max_age_s`` old; UpstreamError when it
        cannot be read, ValueError when it is not a list."""
        return await self.read(INDEX_PATH, lambda: self._read_index(server, timeout_s), max_age_s)

    async def _read_index(self, server: Server, timeout_s: float) -> RepositoryIndex:
        at = self.clock()
        response = await server.control.request(b"POST", INDEX_PATH.encode(), _JSON, b"{}", timeout_s=timeout_s)
        raw = await response.read()
        if response.status != 200:
            raise UpstreamError(f"Triton server {server.name}: repository index failed ({response.status}): "
                                f"{raw[:200].decode('utf-8', 'replace')}")
        previous = self._index
        if previous is not None and previous.raw == raw:
            previous.at = at  # the same answer: parsed once, kept (readers compare it by identity)
            return previous
        self._index = RepositoryIndex(raw, at)
        return self._index
