"""Rollout webhooks and gates, for the controller.

Webhooks are told of transitions off the controller's critical section: :meth:`Notifier.notify`
only puts the signed body on a bounded queue (a full queue drops the event and counts it as a
failure rather than hold up a tick), and one sender task posts them, retrying with backoff.
What went wrong is kept per model for the rollout status; a webhook never blocks a rollout.

Gates are asked inside the tick, so the answer decides this tick's move; all the gates of one
move together are bounded by the controller's call timeout, which keeps a tick inside its lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.background import Background
from gateway.rollout import steps
from gateway.rollout.hook_spec import SIGNATURE_HEADER, Event, Gate, GateAt, sign
from gateway.rollout.phases import Phase
from gateway.rollout.steps import Rollout

log = logging.getLogger("gateway.rollout.hooks")
QUEUE_SIZE = 1000
ATTEMPTS = 4
FIRST_BACKOFF_S = 0.5
SEND_TIMEOUT_S = 5.0
PHASE_EVENTS: dict[Phase, Event] = {Phase.PAUSED: "paused", Phase.PROMOTED: "promoted",
                                    Phase.ROLLED_BACK: "rolled_back", Phase.ABORTED: "aborted",
                                    # sent once, when the gradual descent starts (the decision), never
                                    # again at its end: see controller._announce
                                    Phase.ROLLING_BACK: "rolled_back"}


def payload(rollout: Rollout, event: str, now: float, **extra: Any) -> bytes:
    """The JSON body webhooks and gates get: where the rollout is and the verdict that moved it."""
    doc = rollout.document()
    verdict = doc["verdicts"][-1] if doc["verdicts"] else None
    body = {"event": event, "model": rollout.model, "stable": rollout.stable, "canary": rollout.canary,
            "state": doc["state"], "step": rollout.step + 1, "steps": doc["steps"], "weights": doc["weights"],
            "reason": rollout.reason, "verdict": verdict, "time": now, **extra}
    if rollout.spec.baseline is not None:
        body["baseline"] = rollout.spec.baseline
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class Delivery:
    """Per model, what this replica's webhook deliveries came to (shown in the rollout status)."""
    delivered: int = 0
    failures: int = 0
    last_error: str | None = None
    last_error_at: float | None = None

    def document(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "failures": self.failures, "last_error": self.last_error,
                "last_error_at": self.last_error_at}


class Hooks:
    def __init__(self, clock: Any, first_backoff_s: float = FIRST_BACKOFF_S) -> None:
        self.clock = clock
        self.first_backoff_s = first_backoff_s
        self.deliveries: dict[str, Delivery] = {}
        self._queue: asyncio.Queue[tuple[str, str, bytes, str | None]] | None = None
        self._client: httpx.AsyncClient | None = None
        self._background = Background()
        self._sender: asyncio.Task[Any] | None = None

    # -- webhooks ----------------------------------------------------------------------------
    def notify(self, rollout: Rollout, event: str) -> None:
        """Queue ``event`` for every webhook of the rollout that asked for it; never waits."""
        hooks = [hook for hook in rollout.spec.webhooks if event in hook.on]
        if not hooks:
            return
        if self._queue is None:
            self._queue = asyncio.Queue(QUEUE_SIZE)
        if self._sender is None or self._sender.done():
            self._sender = self._background.spawn(self._send_forever(self._queue))
        body = payload(rollout, event, self.clock())
        for hook in hooks:
            try:
                self._queue.put_nowait((rollout.model, hook.url, body, hook.secret))
            except asyncio.QueueFull:
                self._failed(rollout.model, f"{event} to {hook.url} dropped: {QUEUE_SIZE} deliveries waiting")

    def status(self, model: str) -> dict[str, Any]:
        pending = 0 if self._queue is None else self._queue.qsize()
        return {**self.deliveries.get(model, Delivery()).document(), "queued": pending}

    async def _send_forever(self, queue: asyncio.Queue[tuple[str, str, bytes, str | None]]) -> None:
        while True:
            model, url, body, secret = await queue.get()
            headers = {"Content-Type": "application/json"}
            if secret is not None:
                headers[SIGNATURE_HEADER] = sign(body, secret)
            try:
                await self._deliver(model, url, body, headers)
            except Exception as exc:  # one odd delivery must not end the sender (and every later event)
                self._failed(model, f"{url}: {type(exc).__name__}: {exc}")

    async def _deliver(self, model: str, url: str, body: bytes, headers: dict[str, str]) -> None:
        backoff = self.first_backoff_s
        for attempt in range(1, ATTEMPTS + 1):
            problem = await self._post(url, body, headers, SEND_TIMEOUT_S)
            if problem is None:
                self.deliveries.setdefault(model, Delivery()).delivered += 1
                return
            if attempt == ATTEMPTS:
                self._failed(model, f"{url}: {problem} ({ATTEMPTS} attempts)")
                return
            await asyncio.sleep(backoff)
            backoff *= 2

    def _failed(self, model: str, error: str) -> None:
        log.warning("rollout of %s: webhook failed: %s", model, error)
        delivery = self.deliveries.setdefault(model, Delivery())
        delivery.failures += 1
        delivery.last_error = error
        delivery.last_error_at = self.clock()

    # -- gates -------------------------------------------------------------------------------
    async def refusal(self, rollout: Rollout, at: tuple[GateAt, ...], limit_s: float,
                      **extra: Any) -> tuple[Gate, str] | None:
        """The first gate at one of ``at`` that did not answer 2xx, and why; None when all let it
        pass. All of them together take at most ``limit_s``."""
        gates = [gate for gate in rollout.spec.gates if gate.at in at]
        if not gates:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        for gate in gates:
            left = deadline - loop.time()
            problem = "no time left in the tick" if left <= 0 else \
                await self._post(gate.url, payload(rollout, "gate", self.clock(), at=gate.at, **extra),
                                 {"Content-Type": "application/json"}, min(gate.timeout_s, left))
            if problem is not None:
                return gate, problem
        return None

    async def gated(self, rollout: Rollout, moved: Rollout, now: float, limit_s: float) -> Rollout:
        """``moved`` unless it is an automatic advance the spec's gates refuse: then held at the
        current step (asked again next interval) or rolled back. All within ``limit_s``."""
        if not (moved.phase is Phase.PROMOTED or moved.step > rollout.step):
            return moved
        at: tuple[GateAt, ...] = ("each_step", "pre_promotion") if moved.canary_percent == 100 > \
            rollout.canary_percent else ("each_step",)
        refused = await self.refusal(rollout, at, limit_s, next_weights=moved.document()["weights"])
        if refused is None:
            return moved
        gate, problem = refused
        why = f"the {gate.at} gate {gate.url} refused: {problem}"
        held = dataclasses.replace(moved, phase=rollout.phase, step=rollout.step, history=rollout.history,
                                   last_transition_at=rollout.last_transition_at, applied=rollout.applied,
                                   step_started_at=now, reason=f"held at step {rollout.step + 1}: {why} "
                                   "(asked again next interval)")
        return steps.roll_back(held, now, why) if gate.on_failure == "rollback" else held

    # -- HTTP --------------------------------------------------------------------------------
    async def _post(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> str | None:
        """None on a 2xx answer within ``timeout_s``; otherwise what happened instead."""
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._client.post(url, content=body, headers=headers, timeout=timeout_s)
        except (TimeoutError, httpx.TimeoutException):  # whichever of the two clocks fires first
            return f"no answer within {timeout_s:.3g}s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if not 200 <= response.status_code < 300:
            return f"answered {response.status_code}"
        return None

    async def close(self) -> None:
        await self._background.cancel_all()
        self._sender = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
