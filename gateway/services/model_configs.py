"""Which models batch sequences: read from Triton's model configs, off the request path.

``sequence_affinity: auto`` (the default) turns affinity on for exactly the models whose
Triton config has a ``sequence_batching`` section: a model Triton keeps sequence state for
breaks ("must specify the START flag") when one sequence's requests reach two versions. The
gateway learns it here, in the background: the fleet's repository index is read every
``interval_s`` (the read the fleet's health check made, when it is recent: ``gateway.fleet.reads``),
and a model whose READY versions changed (a version loaded or unloaded, through the gateway or
on Triton's own port) has its config read again, a few at once; an index that did not change
costs nothing. The gateway's own loads ask for a look at once (:meth:`SequenceModels.wake`).
The result goes to the policy book, which recompiles the policies it changes: requests only
read a compiled flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Mapping

from gateway.background import Background
from gateway.errors import GatewayError
from gateway.policy_book import PolicyBook
from gateway.services.triton_control import TritonControl

log = logging.getLogger("gateway.model_configs")
INTERVAL_S = 2.0
SHARE_S = 1.0  # an index read this recently (the health check's, each second) serves
CONCURRENT_READS = 3  # config reads at once: the server's control pool has 4 connections (one for health)


class SequenceModels:
    def __init__(self, triton: TritonControl, book: PolicyBook, interval_s: float = INTERVAL_S) -> None:
        self.triton = triton
        self.book = book
        self.interval_s = interval_s
        self._seen: dict[str, frozenset[str]] = {}  # model -> READY versions when its config was read
        self._batched: dict[str, bool] = {}  # model -> its config has a sequence batcher
        self._ready: Mapping[str, frozenset[str]] | None = None  # the index mapping last looked at whole
        self._wake = asyncio.Event()
        self._background = Background()

    def start(self) -> None:
        self._background.supervise("model-configs", self._run)

    async def first_look(self, timeout_s: float) -> None:
        """At start, before traffic: a Triton that does not answer in time is looked at again by the loop."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.refresh()
        except (GatewayError, TimeoutError) as exc:
            log.warning("could not read Triton's model configs at start (%s): sequence_affinity auto is off "
                        "until they are read", exc)

    async def stop(self) -> None:
        await self._background.cancel_all()

    def wake(self, _model: str = "") -> None:
        """Look now (the gateway just loaded or unloaded a version)."""
        self._wake.set()

    async def refresh(self) -> frozenset[str]:
        """Read the index (shared: ``gateway.fleet.reads``) and the configs of models whose READY
        versions changed; the models that batch sequences, as given to the policy book. An
        index that did not change since the last refresh is the same mapping: nothing to do."""
        ready = await self.triton.ready_versions(min(self.interval_s, SHARE_S))
        if ready is not self._ready:
            changed = [model for model, versions in ready.items() if self._seen.get(model) != versions]
            limit = asyncio.Semaphore(CONCURRENT_READS)
            read = await asyncio.gather(*(self._read(model, ready[model], limit) for model in changed))
            for model in set(self._seen) - set(ready):  # nothing READY: forget it, read again when it returns
                del self._seen[model]
                self._batched.pop(model, None)
            self._ready = ready if all(read) else None  # a config not read: looked at again next time
        models = frozenset(model for model, batched in self._batched.items() if batched)
        if models != self.book.sequence_models():
            log.info("models with a sequence batcher (sequence_affinity auto is on for them): %s",
                     ", ".join(sorted(models)) or "none")
        self.book.set_sequence_models(models)
        return models

    async def _read(self, model: str, versions: frozenset[str], limit: asyncio.Semaphore) -> bool:
        async with limit:
            path = f"/v2/models/{urllib.parse.quote(model, safe='')}/config"
            status, config = await self.triton.call(b"GET", path)
        if status != 200 or not isinstance(config, dict):
            return False  # unloading meanwhile, say
        self._batched[model] = "sequence_batching" in config
        self._seen[model] = versions
        return True

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.refresh()
            except GatewayError as exc:
                log.debug("reading Triton's model configs failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
