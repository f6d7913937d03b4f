"""Console logins: a token is exchanged once for a server-side session behind an HttpOnly cookie.

Sessions live in this replica's memory (bounded): a logout or the end of
``console_session_ttl_s`` ends one for good; a restart ends them all (log in again).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admin.auth import Identity

MAX_SESSIONS = 10_000  # past this the oldest login ends first: a flood of logins cannot grow memory


@dataclass(frozen=True)
class Session:
    id: str
    who: Identity
    csrf: str
    expires_at: float  # clock() time

    def csrf_matches(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self.csrf.encode())


class Sessions:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._open: OrderedDict[str, Session] = OrderedDict()

    def open(self, who: Identity) -> Session:
        session = Session(secrets.token_urlsafe(32), who, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        self._open[session.id] = session
        while len(self._open) > MAX_SESSIONS:
            self._open.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._open.get(session_id)
        if session is None:
            return None
        if self.clock() >= session.expires_at:
            del self._open[session_id]
            return None
        return session

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._open.pop(session_id, None)
