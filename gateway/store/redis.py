"""Redis store, for several gateway replicas sharing one routing state.

Records are JSON strings under ``{prefix}:policy:{model}`` / ``{prefix}:rollout:{model}``;
compare-and-set, the audit append and the change notification run in one Lua script, so
they are atomic. Changes are published on ``{prefix}:changes`` (every replica applies them
within milliseconds); the caller's periodic resync heals a missed message. Durability is
Redis's own (AOF/RDB as configured on the server).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import StaleRevision, StoreError
from gateway.policy import PolicySpec
from gateway.store.base import Event, EventDraft, StoredPolicy, StoredRollout, seed_once

# KEYS: record, events list, changes channel. ARGV: expected revision ('' = any), record
# JSON template (revision filled in here), event JSON, model, max events.
_CAS = """
local current = redis.call('GET', KEYS[1])
local revision = 0
if current then revision = cjson.decode(current)['revision'] end
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= revision then return {-1, revision, current or ''} end
-- Splice fields in as text: a cjson round trip would turn [] into {}.
redis.call('SET', KEYS[1], '{"revision":' .. (revision + 1) .. ',' .. string.sub(ARGV[2], 2))
if ARGV[3] ~= '' then
  local id = redis.call('INCR', KEYS[2] .. ':seq')
  redis.call('LPUSH', KEYS[2], '{"id":' .. id .. ',' .. string.sub(ARGV[3], 2))
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[5]) - 1)
end
redis.call('PUBLISH', KEYS[3], ARGV[4])
return {revision + 1, revision, current or ''}
"""


class RedisStore:
    def __init__(self, url: str, prefix: str = "gateway", max_events: int = 10_000) -> None:
        self.url = url
        self.prefix = prefix
        self.max_events = max_events
        self._redis: aioredis.Redis | None = None
        self._cas: Any = None

    @property
    def redis(self) -> aioredis.Redis:
        assert self._redis is not None, "store used before open()"
        return self._redis

    async def open(self) -> None:
        self._redis = aioredis.from_url(self.url, decode_responses=True, socket_connect_timeout=2, socket_timeout=5)
        self._cas = self._redis.register_script(_CAS)
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

    async def get_policy(self, model: str) -> StoredPolicy | None:
        raw = await self._call(self.redis.get(self._key("policy", model)))
        return _policy(raw) if raw else None

    async def _all(self, kind: str) -> list[str]:
        """Every record of a kind (policy, rollout), as stored."""
        try:
            keys = [key async for key in self.redis.scan_iter(match=self._key(kind, "*"))]
        except RedisError as exc:
            raise StoreError(f"state store {self.url}: {exc}") from exc
        values = await self._call(self.redis.mget(keys)) if keys else []
        return [value for value in values if value]

    async def list_policies(self) -> dict[str, StoredPolicy]:
        return {p.model: p for p in map(_policy, await self._all("policy"))}

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft) -> StoredPolicy:
        now = time.time()
        record = {"model": model, "spec": spec.document() if spec else None, "updated_at": now}
        before_raw = await self._call(self.redis.get(self._key("policy", model)))
        before = _policy(before_raw) if before_raw else None
        after_doc = StoredPolicy(model, spec, 0, now).document() if spec else None
        finished = event.finish(model, before.document() if before and before.spec else None, after_doc)
        revision, current, _ = await self._call(self._cas(
            keys=[self._key("policy", model), self._key("events"), self._key("changes")],
            args=["" if expected_revision is None else expected_revision, json.dumps(record),
                  json.dumps(_event_doc(finished)), model, self.max_events]))
        if revision == -1:
            raise StaleRevision(f"policy of model '{model}' is at revision {current}, not {expected_revision}: "
                                "read it again and retry")
        return StoredPolicy(model, spec, int(revision), now)

    async def seed_policy(self, model: str, spec: PolicySpec, actor: str) -> bool:
        return await seed_once(self, model, spec, actor)

    async def append_event(self, model: str, event: Event) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            seq = await self._call(self.redis.incr(self._key("events") + ":seq"))
            pipe.lpush(self._key("events"), json.dumps({**_event_doc(event), "id": seq}))
            pipe.ltrim(self._key("events"), 0, self.max_events - 1)
            await self._call(pipe.execute())

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        raw = await self._call(self.redis.lrange(self._key("events"), 0, self.max_events - 1))
        out = []
        for item in raw:
            doc = json.loads(item)
            if model is None or doc["model"] == model:
                out.append(Event(**doc))
                if len(out) >= limit:
                    break
        return out

    async def get_rollout(self, model: str) -> StoredRollout | None:
        raw = await self._call(self.redis.get(self._key("rollout", model)))
        return _rollout(raw) if raw else None

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        return {r.model: r for r in map(_rollout, await self._all("rollout"))}

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None) -> StoredRollout:
        record = {"model": model, "document": document}
        revision, current, _ = await self._call(self._cas(
            keys=[self._key("rollout", model), self._key("events"), self._key("changes")],
            args=["" if expected_revision is None else expected_revision, json.dumps(record), "", model,
                  self.max_events]))
        if revision == -1:
            raise StaleRevision(f"rollout of model '{model}' is at revision {current}, not {expected_revision}")
        return StoredRollout(model, document, int(revision))

    async def changes(self) -> AsyncIterator[str]:
        pubsub = self.redis.pubsub()
        await self._call(pubsub.subscribe(self._key("changes")))
        try:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    yield message["data"]
        except RedisError as exc:
            raise StoreError(f"change feed from {self.url} broke: {exc}") from exc
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

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


def _policy(raw: str) -> StoredPolicy:
    doc = json.loads(raw)
    spec = PolicySpec.model_validate(doc["spec"]) if doc.get("spec") else None
    return StoredPolicy(doc["model"], spec, int(doc["revision"]), float(doc["updated_at"]))


def _rollout(raw: str) -> StoredRollout:
    doc = json.loads(raw)
    return StoredRollout(doc["model"], doc["document"], int(doc["revision"]))


def _event_doc(event: Event) -> dict[str, Any]:
    return {"at": event.at, "actor": event.actor, "action": event.action, "model": event.model,
            "before": event.before, "after": event.after, "reason": event.reason}
