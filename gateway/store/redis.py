"""Redis store, for several gateway replicas sharing one routing state.

Records are JSON strings under ``{prefix}:policy:{model}`` / ``{prefix}:rollout:{model}``;
compare-and-set, the audit append and trim, and the change notification run in one Lua
script, so they are atomic. Changes are published on ``{prefix}:changes`` (every replica
applies them within milliseconds); the caller's periodic resync heals a missed message.
Durability is Redis's own (AOF/RDB as configured on the server).

``{prefix}:generation`` is made (SET NX) by whoever first uses an empty database, so after
a FLUSHALL, or a failover to a replica that never had the data, the store has a new
generation and every replica rebuilds from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import CorruptRecord, LeaseLost, StaleRevision, StoreError
from gateway.policy import PolicySpec
from gateway.store.base import (
    RESYNC,
    WINDOW_PAGE,
    AppliedIntent,
    AuditBounds,
    Event,
    EventDraft,
    Fence,
    Guard,
    PolicyScan,
    ReplicaReport,
    StoredPolicy,
    StoredRollout,
    new_generation,
)
from gateway.store.memory import check_guard, fence_message
from gateway.store.records import load_json, record_field, spec_from_document, stored_spec

# Drops audit events older than the cutoff from the list's tail (the oldest end), a bounded
# number per call so one write never stalls Redis; count is bounded by LTRIM.
_TRIM = """
local function trim(events, keep, cutoff)
  redis.call('LTRIM', events, 0, keep - 1)
  for _ = 1, 100 do
    local oldest = redis.call('LINDEX', events, -1)
    if not oldest then return end
    local ok, doc = pcall(cjson.decode, oldest)
    if ok and type(doc) == 'table' and tonumber(doc['at']) and tonumber(doc['at']) >= cutoff then return end
    redis.call('RPOP', events)
  end
end
local function revision_of(raw)
  if not raw then return 0 end
  local ok, doc = pcall(cjson.decode, raw)
  if ok and type(doc) == 'table' and tonumber(doc['revision']) then return tonumber(doc['revision']) end
  return 0  -- an unreadable record: a write replaces it (that is how it gets repaired)
end
"""



def _guarded(key: int, revision: int) -> str:
    """The Guard check (base.Guard) of a CAS script: KEYS[key] must be at ARGV[revision] ('' = no guard)."""
    return f"""
if ARGV[{revision}] ~= '' then
  local guarded = revision_of(redis.call('GET', KEYS[{key}]))
  if guarded ~= tonumber(ARGV[{revision}]) then return {{-3, guarded, ''}} end
end
"""


# KEYS: record, events list, changes channel, generation, guarded record. ARGV: expected
# revision ('' = any), record JSON template (revision filled in here), event JSON ('' = none),
# model, max events, a fresh generation id (used only if the store has none), oldest event time
# to keep, the guarded record's revision ('' = no guard).
_CAS_BODY = """
redis.call('SET', KEYS[4], ARGV[6], 'NX')
local generation = redis.call('GET', KEYS[4])
local current = redis.call('GET', KEYS[1])
local revision = revision_of(current)
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= revision then return {-1, revision, generation} end
-- Splice fields in as text: a cjson round trip would turn [] into {}.
redis.call('SET', KEYS[1], '{"revision":' .. (revision + 1) .. ',' .. string.sub(ARGV[2], 2))
if ARGV[3] ~= '' then
  local id = redis.call('INCR', KEYS[2] .. ':seq')
  redis.call('LPUSH', KEYS[2], '{"id":' .. id .. ',' .. string.sub(ARGV[3], 2))
  trim(KEYS[2], tonumber(ARGV[5]), tonumber(ARGV[7]))
end
redis.call('PUBLISH', KEYS[3], ARGV[4])
return {revision + 1, revision, generation}
"""
_CAS = _TRIM + _guarded(5, 8) + _CAS_BODY

# KEYS: events list. ARGV: event JSON, max events, oldest event time to keep.
_APPEND = _TRIM + """
local id = redis.call('INCR', KEYS[1] .. ':seq')
redis.call('LPUSH', KEYS[1], '{"id":' .. id .. ',' .. string.sub(ARGV[1], 2))
trim(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
"""

# KEYS: record, changes channel. ARGV: expected revision, model.
_DELETE = _TRIM + """
local revision = revision_of(redis.call('GET', KEYS[1]))
if tonumber(ARGV[1]) ~= revision then return {-1, revision} end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[2], ARGV[2])
return {0, revision}
"""

# KEYS: generation, then records to read. ARGV: a fresh generation id. Returns the
# generation and the records, read atomically with it.
_READ = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local out = {redis.call('GET', KEYS[1])}
for i = 2, #KEYS do out[i] = redis.call('GET', KEYS[i]) or '' end
return out
"""


class RedisStore:
    def __init__(self, url: str, prefix: str = "gateway", audit: AuditBounds | None = None,
                 heartbeat_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix
        self.audit = audit or AuditBounds()
        self.heartbeat_s = heartbeat_s  # the change feed pings when quiet, to notice a dead connection
        self._redis: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._parsed: dict[str, tuple[str, StoredPolicy]] = {}  # model -> (stored text, its record)

    @property
    def redis(self) -> aioredis.Redis:
        assert self._redis is not None, "store used before open()"
        return self._redis

    async def open(self) -> None:
        self._redis = aioredis.from_url(self.url, decode_responses=True, socket_connect_timeout=2, socket_timeout=5)
        self._scripts = {name: self._redis.register_script(text) for name, text in
                         (("cas", _CAS), ("append", _APPEND), ("delete", _DELETE), ("read", _READ),
                          ("fenced_cas", _FENCED_CAS))}
        try:
            await self._redis.ping()
        except RedisError as exc:
            raise StoreError(f"cannot reach the state store {self.url}: {exc}") from exc

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def _key(self, kind: str, model: str = "") -> str:
        return f"{self.prefix}:{kind}:{model}" if model else f"{self.prefix}:{kind}"

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except RedisError as exc:
            raise StoreError(f"state store {self.url}: {exc}") from exc

    async def _read(self, *keys: str) -> tuple[str, list[str]]:
        """The generation and the given records ('' for a missing one), atomically."""
        out = await self._call(self._scripts["read"](keys=[self._key("generation"), *keys], args=[new_generation()]))
        return str(out[0]), [str(value) for value in out[1:]]

    async def generation(self) -> str:
        return (await self._read())[0]

    async def get_policy(self, model: str) -> StoredPolicy | None:
        generation, (raw,) = await self._read(self._key("policy", model))
        return self._policy(model, raw, generation) if raw else None

    def _policy(self, model: str, raw: str, generation: str) -> StoredPolicy:
        """The record parsed, or the one parsed from the same text before: a full resync parses
        only the records that changed (gateway.store.records.SpecCache says why)."""
        kept = self._parsed.get(model)
        if kept is not None and kept[0] == raw and kept[1].generation == generation:
            return kept[1]
        stored = _policy(model, raw, generation)
        self._parsed[model] = (raw, stored)
        return stored

    async def _all(self, kind: str) -> tuple[str, dict[str, str]]:
        """The generation and every record of a kind (policy, rollout) by model, as stored."""
        prefix = f"{self.prefix}:{kind}:"
        for _ in range(3):  # a reset between the two reads: read again, so records and generation agree
            generation = await self.generation()
            try:
                keys = [key async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]
            except RedisError as exc:
                raise StoreError(f"state store {self.url}: {exc}") from exc
            again, values = await self._read(*keys)
            if again == generation:
                break
        return again, {key.removeprefix(prefix): value for key, value in zip(keys, values) if value}

    async def list_policies(self) -> dict[str, StoredPolicy]:
        return (await self.scan_policies()).policies

    async def policy_mark(self) -> str | None:
        return None  # the feed is pub/sub, which drops messages while a replica is away: a resync reads all

    async def policies_since(self, mark: str) -> tuple[str, dict[str, StoredPolicy]] | None:
        return None

    async def scan_policies(self) -> PolicyScan:
        generation, raws = await self._all("policy")
        policies, corrupt = {}, {}
        for model, raw in raws.items():
            try:
                policies[model] = self._policy(model, raw, generation)
            except CorruptRecord as exc:
                corrupt[model] = exc.message
        self._parsed = {model: self._parsed[model] for model in policies}
        return PolicyScan(generation, policies, corrupt)

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft, guard: Guard | None = None) -> StoredPolicy:
        now, record, finished = await self._policy_write(model, spec, event)
        revision, current, generation = await self._call(self._scripts["cas"](
            keys=[self._key("policy", model), self._key("events"), self._key("changes"), self._key("generation"),
                  self._guard_key(model, guard)],
            args=["" if expected_revision is None else expected_revision, json.dumps(record),
                  json.dumps(_event_doc(finished)), model, self.audit.max_events, new_generation(),
                  now - self.audit.max_age_s, "" if guard is None else guard.revision]))
        _refused(revision, current, "policy", model, expected_revision, guard)
        return StoredPolicy(model, spec, int(revision), now, str(generation), event.actor)

    def _guard_key(self, model: str, guard: Guard | None) -> str:
        return self._key(guard.kind if guard is not None else "policy", model)

    async def append_event(self, model: str, event: Event) -> None:
        await self._call(self._scripts["append"](keys=[self._key("events")], args=[
            json.dumps(_event_doc(event)), self.audit.max_events, time.time() - self.audit.max_age_s]))

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        out: list[Event] = []
        page = max(limit, 500)  # filtering by model reads on, a page at a time, never the whole trail at once
        for start in range(0, self.audit.max_events, page):
            raw = await self._call(self.redis.lrange(self._key("events"), start, start + page - 1))
            for item in raw:
                try:
                    doc = json.loads(item)
                    event = Event(**{name: doc.get(name) for name in _EVENT_FIELDS})
                except (ValueError, TypeError):
                    continue  # an unreadable audit line hides nothing else
                if model is None or event.model == model:
                    out.append(event)
                    if len(out) >= limit:
                        return out
            if len(raw) < page:
                break
        return out

    async def count_events(self) -> int:
        return int(await self._call(self.redis.llen(self._key("events"))))

    async def get_rollout(self, model: str) -> StoredRollout | None:
        raw = await self._call(self.redis.get(self._key("rollout", model)))
        return _rollout(model, raw) if raw else None

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        """Every readable rollout record (an unreadable one is left out)."""
        out = {}
        for model, raw in (await self._all("rollout"))[1].items():
            try:
                out[model] = _rollout(model, raw)
            except CorruptRecord:
                continue
        return out

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None,
                          guard: Guard | None = None) -> StoredRollout:
        record = {"model": model, "document": document}
        revision, current, _ = await self._call(self._scripts["cas"](
            keys=[self._key("rollout", model), self._key("events"), self._key("changes"), self._key("generation"),
                  self._guard_key(model, guard)],
            args=["" if expected_revision is None else expected_revision, json.dumps(record), "", model,
                  self.audit.max_events, new_generation(), 0, "" if guard is None else guard.revision]))
        _refused(revision, current, "rollout", model, expected_revision, guard)
        return StoredRollout(model, document, int(revision))

    async def delete_rollout(self, model: str, expected_revision: int) -> None:
        done, current = await self._call(self._scripts["delete"](
            keys=[self._key("rollout", model), self._key("changes")], args=[expected_revision, model]))
        if done == -1:
            raise StaleRevision(f"rollout of model '{model}' is at revision {current}, not {expected_revision}")

    async def archive_rollout(self, model: str, document: dict[str, Any], keep: int) -> None:
        """A sorted set per model, scored by started_at: the same rollout replaces itself, the
        oldest go past ``keep``, in one MULTI."""
        key, started_at = self._key("rollout-history", model), float(document["started_at"])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, started_at, started_at)
            pipe.zadd(key, {json.dumps(document): started_at})
            pipe.zremrangebyrank(key, 0, -keep - 1)
            await self._call(pipe.execute())

    async def rollout_history(self, model: str, limit: int) -> list[dict[str, Any]]:
        raws = await self._call(self.redis.zrevrange(self._key("rollout-history", model), 0, limit - 1))
        out = []
        for raw in raws:
            try:
                document = json.loads(raw)
            except ValueError:
                continue  # an unreadable entry hides no other
            if isinstance(document, dict):
                out.append(document)
        return out

    async def get_applied(self, model: str) -> AppliedIntent | None:
        raw = await self._call(self.redis.hget(self._key("applied"), model))
        if not raw:
            return None
        doc = load_json(raw, f"config intent of model '{model}'")
        return AppliedIntent(str(doc["digest"]), int(doc["revision"]), float(doc["at"]))

    async def set_applied(self, model: str, intent: AppliedIntent) -> None:
        await self._call(self.redis.hset(self._key("applied"), model, json.dumps(
            {"digest": intent.digest, "revision": intent.revision, "at": intent.at})))

    async def changes(self) -> AsyncIterator[str]:
        """Reads with a timeout and pings when quiet: a connection that died without a word
        (a partition, a frozen server) is noticed within a few heartbeats, not never."""
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self._key("changes"))
            heard = time.monotonic()
            pinged = heard
            while True:
                message = await pubsub.get_message(timeout=self.heartbeat_s)
                now = time.monotonic()
                if message is not None:
                    heard = now
                    if message["type"] == "subscribe":
                        # Live (again: redis-py resubscribes after a reconnect by itself):
                        # whatever changed before this moment is found by a full resync.
                        yield RESYNC
                    elif message["type"] == "message":
                        yield str(message["data"])
                elif now - heard > 3 * self.heartbeat_s:
                    raise StoreError(f"change feed from {self.url}: no answer for {now - heard:.1f} s")
                if now - max(heard, pinged) >= self.heartbeat_s:
                    pinged = now
                    await pubsub.ping()
        except RedisError as exc:
            raise StoreError(f"change feed from {self.url} broke: {exc}") from exc
        finally:
            try:
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
            except RedisError:
                pass  # the connection is already gone

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        key = self._key("lease", name)
        ms = max(1, int(ttl_s * 1000))
        if await self._call(self.redis.set(key, holder, nx=True, px=ms)):
            return True
        # Renew only our own lease, atomically.
        renewed = await self._call(self.redis.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
            "return 0", 1, key, holder, ms))
        return bool(renewed)

    # -- fencing: the epoch check runs inside the same Lua script as the write -------------
    async def _policy_write(self, model: str, spec: PolicySpec | None,
                            event: EventDraft) -> tuple[float, dict[str, Any], Event]:
        """What a policy write stores: its time, the record, and the audit event (before/after)."""
        now = time.time()
        record = {"model": model, "spec": stored_spec(spec) if spec else None, "updated_at": now, "actor": event.actor}
        try:
            before = await self.get_policy(model)
        except CorruptRecord:  # overwriting a corrupt record is how it gets repaired
            before = None
        after_doc = StoredPolicy(model, spec, 0, now).document() if spec else None
        return now, record, event.finish(model, before.document() if before and before.spec else None, after_doc)

    async def acquire_fenced_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        epoch = await self._call(self.redis.eval(
            _ACQUIRE_FENCED, 2, self._key("fence", name), self._key("fence", name) + ":live", holder,
            max(1, int(ttl_s * 1000))))
        return None if int(epoch) < 0 else int(epoch)

    async def renew_fenced_lease(self, name: str, holder: str, epoch: int, ttl_s: float) -> bool:
        renewed = await self._call(self.redis.eval(
            _RENEW_FENCED, 2, self._key("fence", name), self._key("fence", name) + ":live", holder, epoch,
            max(1, int(ttl_s * 1000))))
        return bool(renewed)

    async def release_fenced_lease(self, name: str, holder: str, epoch: int) -> None:
        await self._call(self.redis.eval(
            "local fence = redis.call('HMGET', KEYS[1], 'holder', 'epoch') "
            "if fence[1] == ARGV[1] and tonumber(fence[2]) == tonumber(ARGV[2]) and redis.call('GET', KEYS[2]) == "
            "ARGV[1] then redis.call('DEL', KEYS[2]) end return 0",
            2, self._key("fence", name), self._key("fence", name) + ":live", holder, epoch))

    async def put_policy_fenced(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                                event: EventDraft, fence: Fence, guard: Guard | None = None) -> StoredPolicy:
        now, record, finished = await self._policy_write(model, spec, event)
        revision, generation = await self._fenced_cas("policy", model, expected_revision, record,
                                                      json.dumps(_event_doc(finished)), fence, now, guard)
        return StoredPolicy(model, spec, revision, now, generation, event.actor)

    async def put_rollout_fenced(self, model: str, document: dict[str, Any], expected_revision: int | None,
                                 fence: Fence, guard: Guard | None = None) -> StoredRollout:
        revision, _ = await self._fenced_cas("rollout", model, expected_revision,
                                             {"model": model, "document": document}, "", fence, 0.0, guard)
        return StoredRollout(model, document, revision)

    async def _fenced_cas(self, kind: str, model: str, expected_revision: int | None, record: dict[str, Any],
                          event: str, fence: Fence, now: float, guard: Guard | None) -> tuple[int, str]:
        revision, current, generation = await self._call(self._scripts["fenced_cas"](
            keys=[self._key(kind, model), self._key("events"), self._key("changes"), self._key("generation"),
                  self._key("fence", fence.name), self._guard_key(model, guard)],
            args=["" if expected_revision is None else expected_revision, json.dumps(record), event, model,
                  self.audit.max_events, new_generation(), now - self.audit.max_age_s if event else 0,
                  fence.holder, fence.epoch, "" if guard is None else guard.revision]))
        if revision == -2:
            raise LeaseLost(fence_message(fence, int(current)))
        _refused(revision, current, kind, model, expected_revision, guard)
        return int(revision), str(generation)

    async def put_loaded_versions(self, model: str, versions: list[str]) -> None:
        await self._call(self.redis.hset(self._key("loaded"), model, json.dumps(sorted(versions, key=int))))

    async def loaded_versions(self) -> dict[str, list[str]]:
        raw = await self._call(self.redis.hgetall(self._key("loaded")))
        return {model: json.loads(versions) for model, versions in raw.items()}

    async def release_lease(self, name: str, holder: str) -> None:
        await self._call(self.redis.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            1, self._key("lease", name), holder))

    async def publish_windows(self, replica: str, payload: str, keep_s: float) -> None:
        oldest = int((time.time() - keep_s) * 1000)  # stream ids are milliseconds: older entries go
        await self._call(self.redis.xadd(self._key("windows"), {"replica": replica, "payload": payload},
                                         minid=oldest, approximate=False))

    async def read_windows(self, cursor: str) -> tuple[str, list[tuple[str, str]]]:
        start = f"({cursor}" if cursor else "-"
        entries = await self._call(self.redis.xrange(self._key("windows"), min=start, count=WINDOW_PAGE))
        page = [(_text(fields.get("replica") or fields.get(b"replica")), _text(fields.get("payload") or
                 fields.get(b"payload"))) for _, fields in entries]
        return (_text(entries[-1][0]) if entries else cursor), page

    async def report_replica(self, report: ReplicaReport, ttl_s: float) -> None:
        await self._call(self.redis.set(self._key("replica", report.replica), json.dumps(report.document()),
                                        px=max(1, int(ttl_s * 1000))))

    async def live_replicas(self) -> list[ReplicaReport]:
        reports = []
        for raw in (await self._all("replica"))[1].values():  # expired reports are gone: Redis expires them
            try:
                report = ReplicaReport.from_document(json.loads(raw))
            except ValueError:
                report = None
            if report is not None:
                reports.append(report)
        return reports

    async def set_draining(self, model: str, version: str, drain_id: str | None, ttl_s: float = 0.0) -> None:
        key = self._key("draining", f"{model}/{version}")
        if drain_id is None:
            await self._call(self.redis.delete(key))
        else:
            await self._call(self.redis.set(key, drain_id, px=max(1, int(ttl_s * 1000))))

    async def draining(self) -> dict[tuple[str, str], str]:
        out = {}
        for name, drain_id in (await self._all("draining"))[1].items():
            model, _, version = name.rpartition("/")
            out[(model, version)] = drain_id
        return out

    async def save_pins(self, changes: Mapping[str, tuple[str, float] | None], idle_s: float) -> None:
        """One key per pin, expiring ``idle_s`` after its last use: Redis forgets idle pins itself."""
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, entry in changes.items():
                left_s = idle_s - (now - entry[1]) if entry is not None else 0.0
                if left_s <= 0:
                    pipe.delete(self._key("pin", key))
                else:
                    pipe.set(self._key("pin", key), json.dumps(entry), px=max(1, int(left_s * 1000)))
            await self._call(pipe.execute())

    async def load_pins(self, idle_s: float) -> dict[str, tuple[str, float]]:
        out = {}
        for key, raw in (await self._all("pin"))[1].items():
            try:
                version, used_at = json.loads(raw)
                out[key] = (str(version), float(used_at))
            except (ValueError, TypeError):
                continue  # an unreadable pin: that sequence starts over, as after a plain restart
        return out

    async def load_pin(self, key: str, idle_s: float) -> tuple[str, float] | None:
        raw = await self._call(self.redis.get(self._key("pin", key)))  # expires by itself when idle
        try:
            version, used_at = json.loads(raw)
            return str(version), float(used_at)
        except (ValueError, TypeError):
            return None  # none, or unreadable: that sequence starts over

_EVENT_FIELDS = ("id", "at", "actor", "action", "model", "before", "after", "reason")


def _refused(revision: int, current: int, kind: str, model: str, expected: int | None, guard: Guard | None) -> None:
    """StaleRevision for a CAS script's refusal: -1 the record's own revision, -3 the guard's."""
    if revision == -1:
        raise StaleRevision(f"{kind} of model '{model}' is at revision {current}, not {expected}: "
                            "read it again and retry")
    if revision == -3 and guard is not None:
        check_guard(model, guard, int(current))


def _policy(model: str, raw: str, generation: str) -> StoredPolicy:
    what = f"stored policy of model '{model}'"
    doc = load_json(raw, what)
    if not isinstance(doc, dict):
        raise CorruptRecord(f"{what} is not a JSON object")
    revision = record_field(doc, "revision", int, what)
    what = f"stored policy of model '{model}' (revision {revision})"
    spec = spec_from_document(doc["spec"], what) if doc.get("spec") is not None else None
    actor = doc.get("actor")
    return StoredPolicy(model, spec, revision, record_field(doc, "updated_at", float, what), generation,
                        actor if isinstance(actor, str) else "")


def _rollout(model: str, raw: str) -> StoredRollout:
    what = f"stored rollout of model '{model}'"
    doc = load_json(raw, what)
    if not isinstance(doc, dict) or not isinstance(doc.get("document"), dict):
        raise CorruptRecord(f"{what} has no rollout document")
    return StoredRollout(model, doc["document"], record_field(doc, "revision", int, what))


def _event_doc(event: Event) -> dict[str, Any]:
    return {"at": event.at, "actor": event.actor, "action": event.action, "model": event.model,
            "before": event.before, "after": event.after, "reason": event.reason}


# KEYS: fence record (hash: epoch, last holder; never expires), liveness key (expires).
# ARGV: holder, ttl ms. Returns the epoch, or -1 while another holder's lease is live.
_ACQUIRE_FENCED = """
local live = redis.call('GET', KEYS[2])
if live and live ~= ARGV[1] then return -1 end
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if not live then
  epoch = epoch + 1
  redis.call('HSET', KEYS[1], 'epoch', epoch, 'holder', ARGV[1])
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return epoch
"""
# Renew only our own live lease at our epoch: a lapsed one is never taken back this way.
_RENEW_FENCED = """
local fence = redis.call('HMGET', KEYS[1], 'holder', 'epoch')
if fence[1] ~= ARGV[1] or tonumber(fence[2]) ~= tonumber(ARGV[2]) then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
# _CAS behind a fence check: KEYS[5] is the fence record, ARGV[8] the holder, ARGV[9] the epoch;
# the guarded record is KEYS[6], its revision ARGV[10].
_FENCED_CAS = """
local fence = redis.call('HMGET', KEYS[5], 'holder', 'epoch')
if fence[1] ~= ARGV[8] or tonumber(fence[2]) ~= tonumber(ARGV[9]) then
  return {-2, tonumber(fence[2]) or 0, ''}
end
""" + _TRIM + _guarded(6, 10) + _CAS_BODY


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
