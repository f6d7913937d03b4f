"""Canaries of a composing model inside an ensemble: the variant the gateway generates, loads and folds.

An ensemble pins the version of each composing model in its config (a step's ``model_version``),
one config for all of the ensemble's versions, so a canary of ``qc`` v3 inside ``pipe`` needs a
second ensemble. A rollout of ``pipe`` with ``"composing": "qc@3"`` makes one:

- the **variant**'s config is the ensemble's own as Triton serves it (``GET .../config``), named
  ``{ensemble}__{model}_{version}`` (``pipe__qc_3``), with the ``model_version`` of every step
  running ``qc`` changed to 3, and nothing else;
- it is loaded through Triton's model-repository API on every server of the fleet (the config,
  and an empty file per version folder: Triton serves only versions that have a folder, and the
  variant has none in the repository), and must be READY everywhere, or it is unloaded again;
- the rollout splits ``pipe`` between the ensemble (its stable) and the variant (its canary),
  a renamed target: a request runs whole in one of them, so no request mixes the arms' stages,
  and the client sees ``pipe`` either way. The judge compares the arms end to end on the
  gateway's timings; Triton labels every ensemble version 1, so the difference is attributed by
  the composing model's own per-version statistics (:meth:`EnsembleCanaries.attribution`);
- **promotion** pins the canary's version in the ensemble itself (a reload with the config
  override: Triton swaps configs without dropping a request), moves the traffic back to it and
  unloads the variant: afterwards ``pipe`` is again one ensemble, what a client calling Triton
  directly gets too, and the next canary starts from it. (Keeping the variant as the new
  stable would leave production on a model only the gateway knows how to rebuild.) A
  **rollback** drains and unloads the variant;
- Triton forgets both after a restart (it reloads the ensemble from ``config.pbtxt``, and the
  variant has no folder): :meth:`EnsembleCanaries.restore` puts back what the ensemble's latest
  rollout record says: the variant while the rollout is active, and the ensemble's pin of the
  composing version the record settled on.

The record of it all is the rollout's ``variant`` document (:func:`plan`), so any replica, and
a restarted gateway, carries on from it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import urllib.parse
from typing import Any

from gateway.errors import Conflict, GatewayError, LoadFailed
from gateway.policy import TargetName, parse_target
from gateway.rollout.attribution import attribute
from gateway.services.engine_stats import EngineReading, EngineStats, interval
from gateway.services.triton_control import TritonControl

log = logging.getLogger("gateway.ensembles")
LOADED, FOLDED, UNLOADED = "loaded", "folded", "unloaded"
RESTORE_GRACE_S = 2.0  # a mismatch must last this long (a load on another replica is under way meanwhile)


def variant_name(ensemble: str, model: str, version: str) -> str:
    return f"{ensemble}__{model}_{version}"


def composing_target(key: str) -> TargetName:
    """``qc@3``: the composing model and the version to canary; ValueError otherwise."""
    target = parse_target(key)
    if target.model is None or target.version is None or target.fleet is not None:
        raise ValueError(f"'{key}' is not a composing model's version: write model@version (qc@3), no fleet")
    return target


def steps_running(config: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return [step for step in config.get("ensemble_scheduling", {}).get("step", []) if step.get("model_name") == model]


def plan(ensemble: str, config: dict[str, Any], composing: str, versions: list[str]) -> dict[str, Any]:
    """The variant document for canarying ``composing`` (``qc@3``) inside ``ensemble`` whose
    loaded config is ``config`` and READY versions ``versions``; Conflict saying why it cannot be."""
    target = composing_target(composing)
    model, canary = target.model, target.version
    assert model is not None and canary is not None
    if config.get("platform") != "ensemble":
        raise Conflict(f"model '{ensemble}' is not an ensemble (platform '{config.get('platform', '')}'): a canary of "
                       f"{composing} inside it needs ensemble_scheduling")
    steps = steps_running(config, model)
    if not steps:
        names = sorted({str(step.get("model_name")) for step in config["ensemble_scheduling"].get("step", [])})
        raise Conflict(f"no step of ensemble '{ensemble}' runs '{model}' (its steps run {', '.join(names)})")
    pins = {str(step.get("model_version", -1)) for step in steps}
    if pins & {"-1", ""}:
        raise Conflict(f"the step of ensemble '{ensemble}' running '{model}' says model_version -1 (the latest): "
                       f"every newer version of {model} runs in the stable arm as soon as it is loaded, so a canary "
                       "cannot be kept to a share of the traffic; pin the stable version in the ensemble's config "
                       "first (model_version: N)")
    if len(pins) > 1:
        raise Conflict(f"the steps of ensemble '{ensemble}' running '{model}' pin different versions "
                       f"({', '.join(sorted(pins))}): a canary replaces one version")
    stable = pins.pop()
    if stable == canary:
        raise Conflict(f"ensemble '{ensemble}' runs {model} version {canary} already")
    variant = pinned(config, model, canary)
    variant["name"] = variant_name(ensemble, model, canary)
    return {"ensemble": ensemble, "name": variant["name"], "model": model, "stable_version": stable,
            "canary_version": canary, "versions": sorted(versions, key=int), "config": variant, "state": "",
            "reading": None}


def pinned(config: dict[str, Any], model: str, version: str) -> dict[str, Any]:
    """``config`` with every step running ``model`` pinned to ``version`` (a copy)."""
    out = copy.deepcopy(config)
    for step in steps_running(out, model):
        step["model_version"] = int(version)
    return out


def gateway_pins(document: dict[str, Any] | None) -> dict[str, str]:
    """The composing versions an ensemble runs because the gateway pinned them, as its latest
    rollout record (``document``) says: the pins its earlier promotions made (``kept_pins``,
    carried from record to record) and its own canary's, once promoted and pinned."""
    variant = (document or {}).get("variant") or {}
    pins = dict(variant.get("kept_pins") or {})
    if document is not None and variant and document.get("state") == "promoted" \
            and variant.get("state") in (FOLDED, UNLOADED):
        pins[variant["model"]] = variant["canary_version"]
    return pins


def _shown(pins: dict[str, str]) -> str:
    return ", ".join(f"{model} version {version}" for model, version in sorted(pins.items()))


def pin_of(config: dict[str, Any], model: str) -> str | None:
    steps = steps_running(config, model)
    return str(steps[0].get("model_version", -1)) if steps else None


class EnsembleCanaries:
    """The variants of the ensembles' rollouts, on the default fleet's servers."""

    def __init__(self, triton: TritonControl, timeout_s: float = 120.0) -> None:
        self.triton = triton
        self.timeout_s = timeout_s
        self.stats = EngineStats(triton)
        self._mismatch_since: dict[str, tuple[str, float]] = {}  # ensemble -> (what differs, first seen)

    async def prepare(self, ensemble: str, composing: str) -> dict[str, Any]:
        """The variant document, from the ensemble's config as Triton serves it now."""
        config = await self._config(ensemble)
        versions = [v for v, state in (await self.triton.versions(ensemble)).items() if state.state == "READY"]
        if not versions:
            raise Conflict(f"ensemble '{ensemble}' has no READY version on Triton")
        try:
            document = plan(ensemble, config, composing, versions)
        except ValueError as exc:
            raise Conflict(str(exc)) from None
        model, canary = document["model"], document["canary_version"]
        await self.triton.require_ready(model, {canary, document["stable_version"]})
        return document

    async def load(self, variant: dict[str, Any]) -> None:
        """Load the variant on every server of the fleet and wait for it to be READY on each;
        LoadFailed (the variant unloaded from every server again) otherwise."""
        name = variant["name"]
        body = {"parameters": {"config": json.dumps(variant["config"]),
                               **{f"file:{version}/README": "" for version in variant["versions"]}}}
        servers = self.triton.servers()
        results = await asyncio.gather(*(self.triton.call_on(server, b"POST", _path(name, "load"), body,
                                                             timeout_s=self.timeout_s) for server in servers),
                                       return_exceptions=True)
        for server, result in zip(servers, results, strict=True):
            failure = result if isinstance(result, BaseException) else None
            if failure is None and isinstance(result, tuple) and result[0] != 200:
                failure = LoadFailed(_error(result[1]))
            if failure is not None:
                await self.unload(variant)
                why = failure.message if isinstance(failure, GatewayError) else repr(failure)
                raise LoadFailed(f"Triton server {server.name} did not load the variant '{name}' of ensemble "
                                 f"'{variant['ensemble']}': {why}") from None
        if await self.ready(name) is not True:
            await self.unload(variant)
            raise LoadFailed(f"the variant '{name}' did not become READY on every server")

    async def ready(self, name: str) -> bool | None:
        return await self.triton.is_version_ready(name, name)

    async def unload(self, variant: dict[str, Any]) -> None:
        """Unload the variant from every server (one that does not have it answers 200 as well)."""
        answers = await asyncio.gather(*(self.triton.call_on(server, b"POST", _path(variant["name"], "unload"), {},
                                                             timeout_s=self.timeout_s)
                                         for server in self.triton.servers()), return_exceptions=True)
        failed = [answer for answer in answers if isinstance(answer, BaseException) or answer[0] != 200]
        if failed:
            raise LoadFailed(f"unloading the variant '{variant['name']}' failed: {failed[0]!r}")

    async def fold(self, variant: dict[str, Any], pins: dict[str, str]) -> str:
        """Make the ensemble itself run these versions of its composing models (a reload with its
        config, the steps pinned): what promotion (the canary's version) and restore do. A
        no-op when it does already. Returns what was done, in words."""
        ensemble = variant["ensemble"]
        config = await self._config(ensemble)
        wanted = {model: version for model, version in pins.items() if pin_of(config, model) not in (None, version)}
        if not wanted:
            return f"ensemble '{ensemble}' runs {_shown(pins)} already"
        for model, version in wanted.items():
            config = pinned(config, model, version)
        ready = {v for v, state in (await self.triton.versions(ensemble)).items() if state.state == "READY"}
        sent = await self.triton.reload(ensemble, ready or set(variant["versions"]), self.timeout_s, config)
        return f"ensemble '{ensemble}' reloaded with {_shown(wanted)} pinned ({sent})"

    async def attribution(self, variant: dict[str, Any], since: EngineReading | None = None
                          ) -> tuple[dict[str, Any] | None, EngineReading]:
        """The composing model's two versions in Triton since ``since`` (the variant's last reading
        when None): Triton labels every ensemble version 1, so its own numbers of the arms cannot
        be told apart, but each arm runs its own version of the composing model. Returns the
        attribution (None without an earlier reading) and the reading just taken."""
        model, stable, canary = variant["model"], variant["stable_version"], variant["canary_version"]
        now = await self.stats.read(model, [stable, canary])
        before = since if since is not None else EngineReading.from_document(variant.get("reading"))
        if before is None:
            return None, now
        mine, theirs = interval(before, now, model, canary), interval(before, now, model, stable)
        failures = None
        if mine.counters is not None and theirs.counters is not None:
            failures = (f"Triton failed {mine.counters.fail} of {mine.counters.success + mine.counters.fail} requests "
                        f"of {model} v{canary}, {theirs.counters.fail} of "
                        f"{theirs.counters.success + theirs.counters.fail} of v{stable}")
        found = attribute(mine, theirs, [], [], 0.05, versus=f"{model} v{stable}", errors=failures)
        document = found.document()
        said = f"{found.summary}; {found.errors}" if found.errors else found.summary  # its failures, said always
        document["summary"] = f"{model} v{canary} inside the variant: {said}"
        return document, now

    async def restore(self, variant: dict[str, Any], active: bool, pins: dict[str, str]) -> str | None:
        """After a Triton restart: the variant loaded again while its rollout is ``active``, and the
        ensemble's pins the gateway made (:func:`gateway_pins`) put back; each mismatch must last
        ``RESTORE_GRACE_S``. What was done, or None."""
        ensemble = variant["ensemble"]
        config = await self._config(ensemble) if pins else {}
        missing = active and variant.get("state") == LOADED and await self.ready(variant["name"]) is False
        wrong_pin = any(pin_of(config, model) not in (None, version) for model, version in pins.items())
        if not missing and not wrong_pin:
            self._mismatch_since.pop(ensemble, None)
            return None
        what = f"{missing}/{wrong_pin}"
        seen = self._mismatch_since.setdefault(ensemble, (what, time.monotonic()))
        if seen[0] != what:
            self._mismatch_since[ensemble] = (what, time.monotonic())
            return None
        if time.monotonic() - seen[1] < RESTORE_GRACE_S:
            return None
        del self._mismatch_since[ensemble]
        done = []
        if wrong_pin:
            done.append(await self.fold(variant, pins))
        if missing:
            await self.load(variant)
            done.append(f"variant '{variant['name']}' loaded again")
        return "; ".join(done)

    async def _config(self, ensemble: str) -> dict[str, Any]:
        status, config = await self.triton.call(b"GET", f"/v2/models/{urllib.parse.quote(ensemble, safe='')}/config")
        if status != 200 or not isinstance(config, dict):
            raise Conflict(f"model '{ensemble}' is not loaded on Triton: {_error(config)}")
        return config


def _path(name: str, action: str) -> str:
    return f"/v2/repository/models/{urllib.parse.quote(name, safe='')}/{action}"


def _error(answer: Any) -> str:
    return str(answer.get("error")) if isinstance(answer, dict) and "error" in answer else str(answer)
