"""Which models batch sequences: read from Triton's model configs, off the request path.

``sequence_affinity: auto`` (the default) turns affinity on for exactly the models whose
Triton config has a ``sequence_batching`` section: a model Triton keeps sequence state for
breaks ("must specify the START flag") when one sequence's requests reach two versions. The
gateway learns it here, in the background: the fleet's repository index is read every
``interval_s``, and a model whose READY versions changed (a version loaded or unloaded,
through the gateway or on Triton's own port) has its config read again; the gateway's own
loads ask for a look at once (:meth:`SequenceModels.wake`). The result goes to the policy
book, which recompiles the policies it changes: requests only read a compiled flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse

from gateway.background import Background
from gateway.errors import GatewayError
from gateway.policy_book import PolicyBook
from gateway.services.triton_control import TritonControl

log = logging.getLogger("gateway.model_configs")
INTERVAL_S = 2.0


class SequenceModels:
    def __init__(self, triton: TritonControl, book: PolicyBook, interval_s: float = INTERVAL_S) -> None:
        self.triton = triton
        self.book = book
        self.interval_s = interval_s
        self._seen: dict[str, frozenset[str]] = {}  # model -> READY versions when its config was read
        self._batched: dict[str, bool] = {}  # model -> its config has a sequence batcher
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
        """Read the index (and the configs of models whose READY versions changed); the
        models that batch sequences, as given to the policy book."""
        ready: dict[str, set[str]] = {}
        for entry in await self.triton.index():
            if entry.get("state") == "READY" and "version" in entry:
                ready.setdefault(str(entry.get("name")), set()).add(str(entry["version"]))
        for model, versions in ready.items():
            if self._seen.get(model) != frozenset(versions):
                path = f"/v2/models/{urllib.parse.quote(model, safe='')}/config"
                status, config = await self.triton.call(b"GET", path)
                if status != 200 or not isinstance(config, dict):
                    continue  # unloading meanwhile, say: looked at again next time
                self._batched[model] = "sequence_batching" in config
                self._seen[model] = frozenset(versions)
        for model in set(self._seen) - set(ready):  # nothing READY: forget it, read again when it returns
            del self._seen[model]
            self._batched.pop(model, None)
        models = frozenset(model for model, batched in self._batched.items() if batched)
        if models != self.book.sequence_models():
            log.info("models with a sequence batcher (sequence_affinity auto is on for them): %s",
                     ", ".join(sorted(models)) or "none")
        self.book.set_sequence_models(models)
        return models

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.refresh()
            except GatewayError as exc:
                log.debug("reading Triton's model configs failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
