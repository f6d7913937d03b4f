"""Failed console logins, counted per client address: past a few, that address waits.

A token is guessed one login at a time, so each address gets ``FREE_FAILURES`` wrong tokens,
then every further one locks it out for twice as long as the last (1 s, 2 s, ... up to
``MAX_LOCKOUT_S``); while locked out its logins are answered 429 with ``Retry-After`` without
looking at the token. A login that succeeds, or ``FORGET_AFTER_S`` without a failure, clears the
address. The log gets the first failure from an address and one line per lockout (with the
count), not a line per guess. The table is bounded: past ``MAX_ADDRESSES`` the stalest goes.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import TooManyAttempts

log = logging.getLogger("gateway.console")
FREE_FAILURES = 5
MAX_LOCKOUT_S = 300.0
FORGET_AFTER_S = 900.0
MAX_ADDRESSES = 10_000


@dataclass
class _Failures:
    count: int
    last: float  # clock() of the last failure
    locked_until: float  # clock() time; 0.0: not locked


class LoginThrottle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()  # least recently failed first

    def check(self, address: str) -> None:
        """Raises TooManyAttempts while ``address`` is locked out."""
        failures = self._by_address.get(address)
        if failures is None:
            return
        now = self.clock()
        if now - failures.last >= FORGET_AFTER_S:
            del self._by_address[address]
        elif now < failures.locked_until:
            wait = math.ceil(failures.locked_until - now)
            raise TooManyAttempts(f"too many failed console logins from this address: try again in {wait} s", wait)

    def failed(self, address: str) -> None:
        now = self.clock()
        failures = self._by_address.pop(address, None)
        if failures is None or now - failures.last >= FORGET_AFTER_S:
            failures = _Failures(0, now, 0.0)
        failures.count += 1
        failures.last = now
        self._by_address[address] = failures
        while len(self._by_address) > MAX_ADDRESSES:
            self._by_address.popitem(last=False)
        beyond = failures.count - FREE_FAILURES
        if beyond > 0:
            lockout = min(2.0 ** (beyond - 1), MAX_LOCKOUT_S)
            failures.locked_until = now + lockout
            log.warning("console login refused: %d invalid tokens from %s, its logins wait %g s",
                        failures.count, address, lockout)  # never the token itself
        elif failures.count == 1:
            log.warning("console login refused: invalid token from %s", address)
        else:
            log.debug("console login refused: invalid token %d from %s", failures.count, address)

    def succeeded(self, address: str) -> None:
        self._by_address.pop(address, None)
