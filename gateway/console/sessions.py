"""Console logins: a token is exchanged once for a server-side session behind an HttpOnly cookie.

Sessions live in this replica's memory (bounded): a logout, the end of ``console_session_ttl_s``,
or a SIGHUP that removes or replaces the login's token ends one for good; a restart ends them
all (log in again).
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
# One login's sessions (browsers, tabs that logged in again): past this that login's own oldest
# ends, so one token logging in over and over never ends anyone else's session.
MAX_SESSIONS_PER_LOGIN = 16


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
        self._open: OrderedDict[str, Session] = OrderedDict()  # oldest first: every session has the same TTL
        self._of: dict[Identity, OrderedDict[str, None]] = {}  # each login's session ids, oldest first

    def __len__(self) -> int:
        return len(self._open)

    def open(self, who: Identity) -> Session:
        self._purge_expired()
        mine = self._of.setdefault(who, OrderedDict())
        while len(mine) >= MAX_SESSIONS_PER_LOGIN:
            self.close(next(iter(mine)))
        session = Session(secrets.token_urlsafe(32), who, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        self._open[session.id] = session
        self._of.setdefault(who, mine)[session.id] = None
        while len(self._open) > MAX_SESSIONS:  # only with more than MAX_SESSIONS / 16 logins in use
            self.close(next(iter(self._open)))
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._open.get(session_id)
        if session is None:
            return None
        if self.clock() >= session.expires_at:
            self.close(session_id)
            return None
        return session

    def close(self, session_id: str | None) -> None:
        session = self._open.pop(session_id, None) if session_id else None
        if session is not None:
            mine = self._of.get(session.who)
            if mine is not None:
                mine.pop(session.id, None)
                if not mine:
                    del self._of[session.who]

    def end_for(self, gone: set[Identity]) -> int:
        """End every session of these identities (their token was removed or replaced: SIGHUP);
        how many ended."""
        ended = [session_id for who in gone for session_id in self._of.get(who, {})]
        for session_id in ended:
            self.close(session_id)
        return len(ended)

    def _purge_expired(self) -> None:
        """Expired sessions go before anyone's live one: the oldest are at the front."""
        now = self.clock()
        while self._open:
            oldest = next(iter(self._open.values()))
            if now < oldest.expires_at:
                return
            self.close(oldest.id)
