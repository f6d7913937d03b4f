"""Wrong tokens, counted per client wherever a token is tried: the console's login, ``/admin``'s
bearer token, the data ports' Triton-control token (HTTP ``Authorization``, gRPC ``authorization``
metadata) and ``/metrics``' token. One :class:`TokenThrottle` per node holds the count.

A token is guessed one try at a time, so each client gets ``FREE_FAILURES`` wrong tokens, then
every further one locks it out for twice as long as the last (1 s, 2 s, ... up to
``MAX_LOCKOUT_S``); while locked out its tries are answered 429 (gRPC ``RESOURCE_EXHAUSTED``)
with ``Retry-After`` without looking at the token. A client is what the rest of the gateway
calls a client: the peer address, an IPv6 /64, or whom a trusted proxy forwarded (behind a load
balancer every user shared the balancer's count, and six wrong tries locked a colleague's right
token out). A right token clears nothing: interleaved with a viewer's logins, 200 guesses at
the operator's token were never locked out. ``FORGET_AFTER_S`` without a failure forgets a
client. The log gets the first failure from a client and one line per lockout (with the count
and where), never a line per guess, never the token. The table is bounded: past
``MAX_CLIENTS`` the stalest goes.

With ``--workers`` the control plane holds the count: a worker *relays* each failure over its
channel and hears each lockout back (:meth:`TokenThrottle.lock`), so N workers do not give a
guesser N times the tries.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.client_address import client_key
from gateway.errors import TooManyAttempts

log = logging.getLogger("gateway.auth")
FREE_FAILURES = 5
MAX_LOCKOUT_S = 300.0
FORGET_AFTER_S = 900.0
MAX_CLIENTS = 10_000


@dataclass
class _Failures:
    count: int
    last: float  # clock() of the last failure
    locked_until: float  # clock() time; 0.0: not locked


class TokenThrottle:
    """``clock`` is ``time.monotonic`` (one clock for every process of a node: lockouts cross
    the workers' channel as its times)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_client: OrderedDict[str, _Failures] = OrderedDict()  # least recently failed first
        self.relay: Callable[[str, str], None] | None = None  # a worker's: failures go to the control plane
        self.on_lockout: Callable[[str, float], None] | None = None  # the control plane's: tell the workers

    def check(self, client: str) -> None:
        """Raises TooManyAttempts while ``client`` is locked out."""
        failures = self._by_client.get(client_key(client))
        if failures is None:
            return
        now = self.clock()
        if now < failures.locked_until:
            wait = math.ceil(failures.locked_until - now)
            raise TooManyAttempts(f"too many wrong tokens from this client: try again in {wait} s", wait)
        if now - failures.last >= FORGET_AFTER_S:
            del self._by_client[client_key(client)]

    def failed(self, client: str, where: str) -> None:
        """A wrong token from ``client`` at ``where`` (the console, the admin API, ...)."""
        if self.relay is not None:
            self.relay(client, where)  # the control plane counts, and says when to lock
            return
        key, now = client_key(client), self.clock()
        failures = self._by_client.pop(key, None)
        if failures is None or now - failures.last >= FORGET_AFTER_S:
            failures = _Failures(0, now, 0.0)
        failures.count += 1
        failures.last = now
        self._by_client[key] = failures
        while len(self._by_client) > MAX_CLIENTS:
            self._by_client.popitem(last=False)
        beyond = failures.count - FREE_FAILURES
        if beyond > 0:
            lockout = min(2.0 ** (beyond - 1), MAX_LOCKOUT_S)
            failures.locked_until = now + lockout
            log.warning("wrong token from %s (%s): %d in a row, its tries wait %g s", key, where, failures.count,
                        lockout)  # never the token itself
            if self.on_lockout is not None:
                self.on_lockout(key, failures.locked_until)
        elif failures.count == 1:
            log.warning("wrong token from %s (%s)", key, where)
        else:
            log.debug("wrong token %d from %s (%s)", failures.count, key, where)

    def lock(self, client: str, until: float) -> None:
        """A lockout the control plane decided (a worker's copy)."""
        key = client_key(client)
        failures = self._by_client.pop(key, None) or _Failures(0, self.clock(), 0.0)
        failures.locked_until = max(failures.locked_until, until)
        failures.last = self.clock()
        self._by_client[key] = failures
        while len(self._by_client) > MAX_CLIENTS:
            self._by_client.popitem(last=False)
