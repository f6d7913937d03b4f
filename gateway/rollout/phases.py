"""Rollout phases and the only transitions allowed between them.

Every phase change goes through :func:`transition`, which checks :data:`ALLOWED` and stamps
the time and the reason, so a forbidden edge (e.g. rolled_back -> progressing: no silent
retry) is impossible by construction, not by convention.
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    PROGRESSING = "progressing"
    PAUSED = "paused"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    # The judge found the canary worse and ``rollback.mode`` is gradual: its weight goes down
    # through the rollback steps, one per interval. Not pausable (a resume would be a silent
    # retry of a failed canary) and not promotable; only a critical failure, the last step or
    # an abort ends it.
    ROLLING_BACK = "rolling_back"

    @property
    def active(self) -> bool:
        return self in (Phase.PROGRESSING, Phase.PAUSED, Phase.ROLLING_BACK)


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.PROGRESSING: frozenset({Phase.PROGRESSING, Phase.PAUSED, Phase.PROMOTED, Phase.ROLLED_BACK, Phase.ABORTED,
                                  Phase.ROLLING_BACK}),
    Phase.ROLLING_BACK: frozenset({Phase.ROLLING_BACK, Phase.ROLLED_BACK, Phase.ABORTED}),
    Phase.PAUSED: frozenset({Phase.PROGRESSING, Phase.PROMOTED, Phase.ROLLED_BACK, Phase.ABORTED}),
    Phase.PROMOTED: frozenset(),  # final: a new rollout starts a new record
    Phase.ROLLED_BACK: frozenset(),  # final: stays rolled back until someone starts a new rollout
    Phase.ABORTED: frozenset(),
}


class TransitionError(ValueError):
    """A phase change the table forbids."""


def check(current: Phase, target: Phase) -> None:
    if target not in ALLOWED[current]:
        raise TransitionError(f"a rollout that is {current.value} cannot become {target.value}")
