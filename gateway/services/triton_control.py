"""Control-plane calls to the Triton servers of a fleet: repository index, readiness, model loads.

Low rate, correctness first; each server's calls go over its small control pool. Every
answer is about the whole fleet (its in-service servers, or every server when none is in
service, so a single unreachable Triton still answers with its own error):

- ``versions``/``index``: a version is READY only when every server reports it READY;
  otherwise its state and reason are those of the first server where it is not, named.
- ``reload``: the same version set on every server, concurrently; if one server fails,
  the others go back to what they had, and the error names the server and Triton's reason.
- ``sync_server``: a server joining the fleet (new pod, restart, re-admission) gets the
  loaded set of its peers applied before it takes traffic (``Fleet.on_join``).

What the gateway changed, and only that, is put back after a Triton restart
(:func:`with_change`, :func:`restore_target`): per model the store keeps the versions the
gateway itself loaded ("3") and unloaded ("-3"). A Triton that comes back with
``config.pbtxt``'s list gets the gateway's loads and unloads again; loads and unloads made on
Triton's own port (or by its config) are left as they are.

What a reload sends (:meth:`TritonControl.plan`; the answer says which, in words):

- an admin's ``config``: as given (with the wanted ``version_policy`` when it names none);
- with ``model_repository`` set (the default fleet's repository, readable by the gateway):
  no override at all when ``config.pbtxt``'s ``version_policy`` serves exactly the wanted
  versions; otherwise ``config.pbtxt`` as it is now with the wanted ``version_policy``;
- without it: Triton's loaded configuration with the wanted ``version_policy``, so changes
  made to ``config.pbtxt`` since Triton last read it are not applied.

Triton selects versions only through a ``config`` override of the whole model configuration
(one that names only ``version_policy`` leaves a model with no inputs, max_batch_size 0:
tried on 2.51), has no call that reads ``config.pbtxt`` without loading it, and keeps an
override's configuration through later loads without override until a file of the model is
newer than the override (see :mod:`gateway.services.model_repository`): a load without
override that leaves another set serving is followed by ``config.pbtxt``'s override.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import Conflict, GatewayError, LoadFailed, NotFound, UpstreamError
from gateway.fleet.balancer import Fleet
from gateway.fleet.members import Server
from gateway.fleet.reads import RepositoryIndex
from gateway.policy import TargetName, parse_target
from gateway.services.model_repository import RepositoryUnreadable, read_model_async


def with_change(changes: list[str], loaded: Collection[str] = (), unloaded: Collection[str] = ()) -> list[str]:
    """The gateway's own changes of one model after it loaded or unloaded versions: the last
    word on a version wins ("3": the gateway loaded it, "-3": it unloaded it)."""
    touched = {*loaded, *unloaded}
    kept = [entry for entry in changes if entry.lstrip("-") not in touched]
    return sorted([*kept, *loaded, *(f"-{version}" for version in unloaded)], key=lambda e: (int(e.lstrip("-")), e))


def restore_target(ready: set[str], changes: list[str]) -> set[str] | None:
    """What Triton should serve of a model so that every change the gateway made holds again,
    everything else as it is; None when nothing the gateway did is undone (or it would leave
    nothing). A record from before changes were kept (plain versions only) reads as loads."""
    loaded = {entry for entry in changes if not entry.startswith("-")}
    unloaded = {entry[1:] for entry in changes if entry.startswith("-")}
    wanted = (ready | loaded) - unloaded
    return wanted if wanted and wanted != ready else None


@dataclass(frozen=True)
class VersionState:
    version: str
    state: str  # READY, UNAVAILABLE, LOADING, UNLOADING, UNKNOWN
    reason: str


_Keyed = tuple[str, str | None]  # a target key and the version it names (None: the model's default)


def default_state(states: dict[str, VersionState]) -> VersionState | None:
    """The version Triton serves an unversioned request with: its newest READY one (None: none is)."""
    ready = [version for version, state in states.items() if state.state == "READY"]
    return states[max(ready, key=int)] if ready else None


@dataclass(frozen=True)
class LoadPlan:
    """What one reload sends: ``config`` as the override, or, when ``plain``, first a load
    without override and ``config`` only on a server that then serves another set; ``says``
    is that, in words."""
    config: dict[str, Any]
    plain: bool
    says: str


def load_hint(model: str, version: str, known: bool = True) -> str:
    """What a refusal naming a version that is not serving adds: how to load it. One Triton does
    not list may be a typo as well as a folder not loaded yet: the hint says so (it sent a
    mistyped version 9 to load a folder that is not there)."""
    where = "" if known else " if the model repository has it,"
    return (f":{where} load it with `gateway ctl versions load {model} {version}` "
            f"(POST /admin/models/{model}/versions/{version}/load)")


class TritonControl:
    """Model control for one fleet; the default fleet's also answers for targets on the named
    fleets (``fleet:version`` keys) and of other models (``qc_2026_12``, ``qc_2026_12@2``) in
    ``require_ready``, ``target_states`` and ``is_version_ready``."""

    def __init__(self, fleet: Fleet, named: dict[str, TritonControl] | None = None, timeout_s: float = 10.0,
                 repository: Path | None = None, share_s: float = 0.0) -> None:
        self.fleet = fleet
        # target_states answers from an index read at most this old (the controller's tick): the
        # health check's read serves every rollout's tick, whatever the number of rollouts
        self.share_s = share_s
        self.repository = repository  # the fleet's model repository as this gateway reads it (module docstring)
        self.named = named or {}
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()  # one reload or join sync at a time per fleet
        self.on_reload: list[Callable[[str], None]] = []  # told the model after every reload (done or not)

    def _for(self, key: str) -> tuple[TritonControl, TargetName]:
        """The control of the fleet a target key names, and the target read."""
        target = parse_target(key)
        if target.fleet is None or target.fleet == self.fleet.name:
            return self, target
        control = self.named.get(target.fleet)
        if control is None:
            hint = "" if target.model is not None else (
                f"; version {target.version} of a model named '{target.fleet}' is written "
                f"'{target.fleet}@{target.version}'")
            raise Conflict(f"fleet '{target.fleet}' (in target '{key}') is not configured on this gateway{hint}")
        return control, target

    def _by_model(self, model: str, keys: Collection[str]) -> dict[tuple[TritonControl, str], list[_Keyed]]:
        """Target keys of ``model``'s policy grouped by the fleet and model they name: (key, version) each."""
        grouped: dict[tuple[TritonControl, str], list[_Keyed]] = {}
        for key in keys:
            control, target = self._for(key)
            grouped.setdefault((control, target.model or model), []).append((key, target.version))
        return grouped

    def servers(self) -> list[Server]:
        return self.fleet.in_service() or list(self.fleet.servers.values())

    def servers_of(self, key: str) -> list[Server]:
        """The servers of the fleet a target key names (any target: a version, on a fleet, another model)."""
        return self._for(key)[0].servers()

    async def call_on(self, server: Server, method: bytes, path: str, body: Any = None,
                      timeout_s: float | None = None) -> tuple[int, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        headers = [(b"content-type", b"application/json")] if payload else []
        response = await server.control.request(method, path.encode(), headers, payload,
                                                timeout_s=timeout_s or self.timeout_s)
        raw = await response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError as exc:
            raise UpstreamError(f"Triton server {server.name} answered {path} with invalid JSON") from exc

    async def call(self, method: bytes, path: str, body: Any = None, timeout_s: float | None = None) -> tuple[int, Any]:
        """One call on one server of the fleet (reads that any server can answer)."""
        servers = self.servers()
        if not servers:
            raise UpstreamError(f"fleet '{self.fleet.name}' has no servers")
        return await self.call_on(servers[0], method, path, body, timeout_s)

    async def server_index(self, server: Server, max_age_s: float = 0.0) -> list[dict[str, Any]]:
        return (await self._index_on(server, max_age_s)).entries

    async def _index_on(self, server: Server, max_age_s: float) -> RepositoryIndex:
        """The server's repository index, read at most ``max_age_s`` ago (``gateway.fleet.reads``:
        shared with the health check and every other reader)."""
        try:
            return await server.reads.index(server, self.timeout_s, max_age_s)
        except ValueError as exc:
            raise UpstreamError(f"Triton server {server.name}: repository index failed: {exc}") from exc

    async def index(self, max_age_s: float = 0.0) -> list[dict[str, Any]]:
        """The fleet's repository index: one entry per (model, version), as Triton shapes it."""
        servers = self.servers()
        indexes = await asyncio.gather(*(self.server_index(server, max_age_s) for server in servers))
        if len(servers) == 1:
            return indexes[0]
        merged: dict[tuple[str, str | None], dict[str, Any]] = {}
        for server, entries in zip(servers, indexes, strict=True):
            for entry in entries:
                key = (str(entry.get("name")), str(entry["version"]) if "version" in entry else None)
                seen = merged.setdefault(key, {**entry, "servers": set()})
                seen["servers"].add(server.name)
                if entry.get("state") != "READY" and seen.get("state") == "READY":
                    seen["state"] = entry.get("state", "UNKNOWN")
                    seen["reason"] = f"on server {server.name}: {entry.get('reason') or seen['state']}"
        names = {server.name for server in servers}
        out = []
        for entry in merged.values():
            missing = sorted(names - entry.pop("servers"))
            if missing and entry.get("state") == "READY":
                entry["state"] = "UNAVAILABLE"
                entry["reason"] = f"not loaded on server {', '.join(missing)}"
            out.append(entry)
        return out

    async def versions(self, model: str, max_age_s: float = 0.0) -> dict[str, VersionState]:
        """Every version of ``model`` the fleet's index lists, with its fleet-wide state (as
        :meth:`index` merges it), looked up per model: O(the model's versions)."""
        servers = self.servers()
        indexes = await asyncio.gather(*(self._index_on(server, max_age_s) for server in servers))
        merged: dict[str, VersionState] = {}
        present: dict[str, set[str]] = {}
        for server, index in zip(servers, indexes, strict=True):
            for version, (state, reason) in index.states.get(model, {}).items():
                present.setdefault(version, set()).add(server.name)
                seen = merged.get(version)
                if seen is None:
                    merged[version] = VersionState(version, state, reason)
                elif state != "READY" and seen.state == "READY":
                    merged[version] = VersionState(version, state, f"on server {server.name}: {reason or state}")
        names = {server.name for server in servers}
        for version, found in merged.items():
            missing = sorted(names - present[version])
            if missing and found.state == "READY":
                merged[version] = VersionState(version, "UNAVAILABLE", f"not loaded on server {', '.join(missing)}")
        return merged

    async def ready_versions(self, max_age_s: float = 0.0) -> Mapping[str, frozenset[str]]:
        """Model -> versions READY on every server of the fleet. With one server, the shared
        mapping of its index read (the same object while Triton's answer does not change)."""
        servers = self.servers()
        indexes = await asyncio.gather(*(self._index_on(server, max_age_s) for server in servers))
        if len(indexes) == 1:
            return indexes[0].ready
        first, *others = indexes
        return {model: versions for model, ready in first.ready.items()
                if (versions := ready.intersection(*(other.ready.get(model, ()) for other in others)))}

    async def target_states(self, model: str, keys: set[str]) -> tuple[dict[str, VersionState], bool]:
        """The state of each target key of ``model``'s policy (``version``, ``fleet:version``,
        ``other_model[@version]``) on its own fleet, and whether anything of the models they
        name is loading or unloading on those fleets. A target without a version stands for
        Triton's default version of its model (its newest READY one)."""
        found: dict[str, VersionState] = {}
        busy = False
        for (control, name), pairs in self._by_model(model, keys).items():
            states = await control.model_states(name, control.share_s)
            busy = busy or any(state.state in ("LOADING", "UNLOADING") for state in states.values())
            for key, version in pairs:
                state = states.get(version) if version is not None else default_state(states)
                if state is not None:
                    found[key] = state
        return found, busy

    async def model_states(self, model: str, max_age_s: float = 0.0) -> dict[str, VersionState]:
        """:meth:`versions`, or, for a model the repository index does not list (one loaded through
        the repository API from a configuration alone, such as an ensemble variant), its READY
        versions as its metadata lists them (READY on every server)."""
        states = await self.versions(model, max_age_s)
        if states:
            return states
        ready: set[str] | None = None
        for server in self.servers():
            status, metadata = await self.call_on(server, b"GET", f"/v2/models/{model}", timeout_s=2.0)
            listed = set(metadata.get("versions", [])) if status == 200 and isinstance(metadata, dict) else set()
            ready = listed if ready is None else ready & listed
        return {version: VersionState(version, "READY", "") for version in ready or ()}

    async def require_ready(self, model: str, versions: set[str]) -> None:
        """Conflict (409) naming the first target of ``model``'s policy that is not READY on every
        server of its fleet."""
        if not versions:
            return
        for (control, name), pairs in self._by_model(model, versions).items():
            await control._require_ready(name, {version for _, version in pairs}, name != model)

    async def _require_ready(self, model: str, versions: set[str | None], other: bool = False) -> None:
        """Each version's own readiness on each server (one small call each, whatever the size of
        the repository; None: the model's, any version); the index is read only to say why one is
        not READY (``other``: a model the policy's targets name, which the index may not list)."""
        servers = self.servers()
        answers = await asyncio.gather(*(self._version_ready(server, model, version)
                                         for server in servers for version in versions), return_exceptions=True)
        if all(answer is True for answer in answers):
            return
        where = "" if not self.named and self.fleet.name == "default" else f" of fleet '{self.fleet.name}'"
        known = await self.model_states(model) if other else await self.versions(model)
        if None in versions and default_state(known) is None:
            raise Conflict(f"model '{model}' has no READY version on Triton{where} "
                           f"(known: {', '.join(sorted(known, key=int)) or 'none'})")
        for version in sorted((v for v in versions if v is not None), key=int):
            state = known.get(version)
            if state is None:
                listed = ", ".join(sorted(known, key=int)) or "none"
                raise Conflict(f"version {version} of model '{model}' is not known to Triton{where} "
                               f"(known: {listed}){load_hint(model, version, known=False)}")
            if state.state != "READY":
                why = f" ({state.reason})" if state.reason else ""
                raise Conflict(f"version {version} of model '{model}' is {state.state} on Triton{where}{why}, "
                               f"not READY{'' if state.state == 'LOADING' else load_hint(model, version)}")
        for (server, asked), answer in zip(((s, v) for s in servers for v in versions), answers, strict=True):
            if answer is not True:  # READY in the index read after: it was not when asked
                why = f": {answer}" if isinstance(answer, BaseException) else ""
                what = f"model '{model}'" if asked is None else f"version {asked} of model '{model}'"
                raise Conflict(f"{what} was not READY on Triton server {server.name}{where} when asked{why}")

    async def _version_ready(self, server: Server, model: str, version: str | None) -> bool:
        versioned = "" if version is None else f"/versions/{urllib.parse.quote(version, safe='')}"
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}{versioned}/ready"
        status, _ = await self.call_on(server, b"GET", path, timeout_s=min(self.timeout_s, 5.0))
        return status == 200

    async def is_version_ready(self, model: str, version: str) -> bool | None:
        """True when READY on every server (of the fleet a ``fleet:version`` key names; of the
        model a ``model[@version]`` key names); None when no server could be asked."""
        control, target = self._for(version)
        path = f"/v2/models/{target.model or model}" + ("" if target.version is None else
                                                        f"/versions/{target.version}") + "/ready"
        answers = []
        for server in control.servers():
            try:
                status, _ = await control.call_on(server, b"GET", path, timeout_s=2.0)
            except GatewayError:
                continue
            answers.append(status == 200)
        return all(answers) if answers else None

    # -- model control across the fleet -----------------------------------------------------------
    async def reload(self, model: str, versions: set[str], timeout_s: float,
                     config: dict[str, Any] | None = None) -> str:
        """Serve exactly ``versions`` of ``model`` on every server, or on none of them anew;
        ``config``: the model configuration an admin gave. Returns what was sent, in words."""
        try:
            return await self._reload(model, versions, timeout_s, config)
        finally:
            for listener in self.on_reload:
                listener(model)

    async def _reload(self, model: str, versions: set[str], timeout_s: float, given: dict[str, Any] | None) -> str:
        async with self._lock:
            servers = self.servers()
            plan = await self.plan(model, versions, given, servers[0])
            before = await asyncio.gather(*(self._state_on(server, model) for server in servers))
            results = await asyncio.gather(*(self._reload_on(server, model, plan, versions, timeout_s)
                                             for server in servers), return_exceptions=True)
            failed = [(server, result) for server, result in zip(servers, results, strict=True)
                      if isinstance(result, BaseException)]
            if not failed:
                return "; ".join([plan.says, *(note for note in results if isinstance(note, str))])
            undo = [(server, previous) for server, previous, result in zip(servers, before, results, strict=True)
                    if not isinstance(result, BaseException) and previous[0] and previous[0] != versions]
            await asyncio.gather(*(self._undo_on(server, model, *previous, timeout_s)  # as it was
                                   for server, previous in undo), return_exceptions=True)
            server, error = failed[0]
            if isinstance(error, GatewayError):
                raise error
            raise LoadFailed(f"Triton server {server.name} failed to load '{model}': {error!r}") from error

    async def plan(self, model: str, versions: set[str], given: dict[str, Any] | None, reference: Server) -> LoadPlan:
        """What to send Triton so that it serves exactly ``versions`` (module docstring);
        ``reference``: the server whose loaded configuration is used when nothing fresher is known."""
        selection = sorted(int(v) for v in versions)
        policy = {"specific": {"versions": selection}}
        if given is not None:
            if "version_policy" in given:
                return LoadPlan(given, False, "config override: the admin's configuration, as given")
            return LoadPlan({**given, "version_policy": policy}, False, "config override: the admin's configuration "
                            f"with version_policy specific {selection} (it named none)")
        why_not = "model_repository is not set"
        if self.repository is not None:
            try:
                found = await read_model_async(self.repository, model)
            except RepositoryUnreadable as exc:
                why_not = str(exc)
            else:
                fresh = {**found.config, "version_policy": policy}
                if found.versions == versions:
                    return LoadPlan(fresh, True, f"no config override: {found.path}'s version_policy serves "
                                    f"exactly {selection}")
                return LoadPlan(fresh, False, f"config override: {found.path} as it is now, with version_policy "
                                f"specific {selection} (its own serves {sorted(int(v) for v in found.versions)})")
        loaded = await self._config(reference, model)
        return LoadPlan({**loaded, "version_policy": policy}, False,
                        f"config override: Triton's loaded configuration of '{model}' with version_policy specific "
                        f"{selection}; changes to config.pbtxt since Triton last read it are not applied ({why_not})")

    async def sync_server(self, fleet: Fleet, server: Server) -> None:
        """Give a joining server the versions its in-service peers serve (``Fleet.on_join``)."""
        async with self._lock:
            peers = [peer for peer in fleet.in_service() if peer is not server]
            if not peers:
                return
            reference = peers[0]
            desired: dict[str, set[str]] = {}
            for entry in await self.server_index(reference):
                if entry.get("state") == "READY" and "version" in entry:
                    desired.setdefault(str(entry["name"]), set()).add(str(entry["version"]))
            own = await self.server_index(server)
            for model, versions in sorted(desired.items()):
                have = {str(e["version"]) for e in own if e.get("name") == model and e.get("state") == "READY"
                        and "version" in e}
                if have != versions:
                    plan = await self.plan(model, versions, None, reference)
                    await self._reload_on(server, model, plan, versions, max(self.timeout_s, 120.0))

    async def _config(self, server: Server, model: str) -> dict[str, Any]:
        status, config = await self.call_on(server, b"GET", f"/v2/models/{model}/config")
        if status != 200 or not isinstance(config, dict):
            raise NotFound(f"model '{model}' is not loaded on Triton server {server.name}: {config}")
        return config

    async def _ready_on(self, server: Server, model: str) -> set[str]:
        return {str(e["version"]) for e in await self.server_index(server)
                if e.get("name") == model and e.get("state") == "READY" and "version" in e}

    async def _reload_on(self, server: Server, model: str, plan: LoadPlan, versions: set[str],
                         timeout_s: float) -> str | None:
        """Make ``server`` serve exactly ``versions``; LoadFailed unless all are READY after.
        Returns a note when the server needed more than the plan said."""
        if plan.plain:
            await self._load(server, model, None, versions, timeout_s)
            if await self._ready_on(server, model) == versions:
                return None
            # Triton kept the configuration of its last override (no file of the model is newer)
        await self._load(server, model, plan.config, versions, timeout_s)
        await self._verify(server, model, versions)
        if not plan.plain:
            return None
        return (f"server {server.name} kept the configuration of an earlier override after the load without one, "
                "so config.pbtxt as it is now was sent with the version_policy")

    async def _state_on(self, server: Server, model: str) -> tuple[set[str], dict[str, Any] | None]:
        """The READY versions and the loaded configuration (None: not loaded) of ``model`` on ``server``."""
        ready = await self._ready_on(server, model)
        try:
            return ready, await self._config(server, model) if ready else None
        except NotFound:
            return ready, None

    async def _undo_on(self, server: Server, model: str, versions: set[str], config: dict[str, Any] | None,
                       timeout_s: float) -> None:
        """Back to ``versions`` with the configuration the server had, after the reload failed elsewhere."""
        if config is None:
            return
        config = {**config, "version_policy": {"specific": {"versions": sorted(int(v) for v in versions)}}}
        await self._load(server, model, config, versions, timeout_s)
        await self._verify(server, model, versions)

    async def _load(self, server: Server, model: str, config: dict[str, Any] | None, versions: set[str],
                    timeout_s: float) -> None:
        """One load call; ``config`` None: no override (Triton reads its repository)."""
        body = {} if config is None else {"parameters": {"config": json.dumps(config)}}
        try:
            status, answer = await self.call_on(server, b"POST", f"/v2/repository/models/{model}/load", body,
                                                timeout_s=timeout_s)
        except UpstreamError as exc:
            raise LoadFailed(f"Triton server {server.name} did not finish loading '{model}': {exc.message}") from exc
        if status != 200:
            reason = answer.get("error") if isinstance(answer, dict) else answer
            raise LoadFailed(f"Triton server {server.name} refused to load versions {sorted(versions, key=int)} "
                             f"of '{model}': {reason}")

    async def _verify(self, server: Server, model: str, versions: set[str]) -> None:
        # Triton answers 200 to a version_policy naming a version its repository lacks: check.
        entries = {str(e["version"]): e for e in await self.server_index(server)
                   if e.get("name") == model and "version" in e}
        for version in sorted(versions, key=int):
            entry = entries.get(version)
            if entry is None or entry.get("state") != "READY":
                why = (entry.get("reason") or entry.get("state")) if entry else "not in its model repository"
                raise LoadFailed(f"Triton server {server.name} did not make version {version} of '{model}' READY: "
                                 f"{why}")
