"""The lean ASGI handler for ``/v2/...``: route, forward bytes, record one sample.

FastAPI's per-route machinery serves the admin API; this hot path is a plain ASGI callable.
Per request it reads the path, looks the model's policy up in the current snapshot, picks a
version (only unversioned ``infer`` / ``generate`` / ``generate_stream`` are routed), and
forwards the body untouched over a pooled keep-alive connection. Nothing here parses a body,
takes a lock or logs inline.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any

from gateway.errors import ClientGone, GatewayError, UpstreamError
from gateway.policy_book import PolicyBook
from gateway.proxy.shadow import Mirror, ShadowMirror
from gateway.routing import (
    MAY_FALL_BACK,
    MAY_SHADOW,
    VERSION_UNAVAILABLE_MARKERS,
    Decision,
    Policy,
    Reason,
    WeylDraw,
    choose,
    choose_in_sequence,
    fallback_for,
    inflight_key,
)
from gateway.sequences import SequencePins
from gateway.telemetry.recorder import UNKNOWN_MODEL, Outcome, Recorder, http_outcome
from gateway.upstream import HttpUpstream, UpstreamResponse

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

CONNECTION_KEY = "gateway.connection"  # set by gateway.server.GatewayHttpProtocol
ROUTED_ACTIONS = frozenset(["infer", "generate", "generate_stream"])
_DROP_RESPONSE = frozenset([b"connection", b"keep-alive", b"transfer-encoding", b"content-length"])
_JSON = [(b"content-type", b"application/json")]
_UNAVAILABLE = frozenset([404, 503])
_UNAVAILABLE_MARKERS = tuple(marker.encode() for marker in VERSION_UNAVAILABLE_MARKERS)
_DEFAULT = Decision(None, Reason.DEFAULT)
_NEEDS_BODY = Decision(None, Reason.SEQUENCE)  # marker: decide after reading the body
_UNKNOWN = Decision("", Reason.DEFAULT)
_ROUTE_VERSION = b"x-gateway-model-version"
_ROUTE_REASON = b"x-gateway-route"


class HttpProxy:
    """ASGI app for the KServe-v2 / Triton HTTP API."""

    def __init__(self, book: PolicyBook, upstream: HttpUpstream, recorder: Recorder,
                 access_log: Callable[..., None] | None = None, pins: SequencePins | None = None,
                 shadow: ShadowMirror | None = None) -> None:
        self.book = book
        self.pins = pins or SequencePins()
        self.shadow = shadow
        self.upstream = upstream
        self.recorder = recorder
        self.access_log = access_log
        self._draw = WeylDraw(seed=time.monotonic_ns())
        self._reason_headers: dict[tuple[str | None, str], list[tuple[bytes, bytes]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        raw_path: bytes = scope.get("raw_path") or path.encode()
        query = scope["query_string"]
        target = raw_path + b"?" + query if query else raw_path
        model = policy = decision = None
        if path.startswith("/v2/models/"):
            parts = path[11:].split("/")
            if len(parts) == 2 and parts[1] in ROUTED_ACTIONS:
                model = parts[0]
                policy = self.book.get(model)  # the one policy lookup of this request
                decision = self._route(policy, scope)
                if decision.version is not None:
                    target = _with_version(target, decision.version)
            elif len(parts) == 4 and parts[1] == "versions" and parts[3] in ROUTED_ACTIONS:
                model = parts[0]
                policy = self.book.get(model)
                decision = Decision(parts[2], Reason.PINNED)
        await self._forward(scope, receive, send, target, model, policy, decision)

    def _route(self, policy: Policy | None, scope: Scope) -> Decision:
        if policy is None:
            return _DEFAULT
        if policy.sequence_affinity:
            return _NEEDS_BODY  # decided in _forward, once the JSON header is read
        names = policy.header_names
        found = {name: value for name, value in scope["headers"] if name in names}
        return choose(policy, found, self._draw())

    async def _forward(self, scope: Scope, receive: Receive, send: Send, target: bytes, model: str | None,
                       policy: Policy | None, decision: Decision | None) -> None:
        started = time.perf_counter()
        message = await receive()
        body: bytes | AsyncIterator[bytes] = message.get("body", b"")
        length = None
        if message.get("more_body"):
            if decision is _NEEDS_BODY:  # sequence requests are small: buffer to read the header
                body = b"".join([chunk async for chunk in _rest_of_body(body, receive)])  # type: ignore[arg-type]
            else:
                body = _rest_of_body(body, receive)  # type: ignore[arg-type]
                length = _content_length(scope["headers"])
        if decision is _NEEDS_BODY:
            decision = self._route_sequence(policy, scope, body)  # type: ignore[arg-type]
            target = _with_version(target, decision.version)  # type: ignore[arg-type]
        task = asyncio.current_task()
        done = [False, False]  # [response fully handed to the server, client went away]
        watcher = None
        connection = scope.get(CONNECTION_KEY)
        if decision is not None and isinstance(body, bytes):
            if connection is not None:  # our server protocol tells us when the client leaves
                connection.on_lost = partial(_client_lost, task, done)
            else:  # any other ASGI server: watch receive() for http.disconnect
                watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, task, done))
        response: UpstreamResponse | None = None
        inflight = inflight_key(model, policy, decision)
        if inflight is not None:
            counts = self.recorder.inflight
            counts[inflight] = counts.get(inflight, 0) + 1
        try:
            response = await self.upstream.request(scope["method"].encode(), target, scope["headers"], body,
                                                   content_length=length)
            if response.status in _UNAVAILABLE and decision is not None and decision.reason in MAY_FALL_BACK:
                response, decision = await self._fall_back(scope, target, body, response, model, policy, decision)
            await self._relay(response, send, decision, done)
            if response.status == 200 and isinstance(body, bytes) and decision is not None and policy is not None:
                self._maybe_shadow(model, policy, decision, scope, target, body, response)  # type: ignore[arg-type]
        except GatewayError as exc:
            if response is not None:  # broke mid-stream: headers are out, just stop
                response.abort()
            elif not isinstance(exc, ClientGone):
                done[0] = True
                await _send_error(send, exc)
            self._record(model, decision, started, exc)
            return
        except asyncio.CancelledError:
            if response is not None:
                response.abort()
            if done[1] and task is not None:  # our own cancel: the client left, nothing to answer
                task.uncancel()
                self._record(model, decision, started, ClientGone("client went away"))
                return
            raise
        finally:
            if inflight is not None:
                self.recorder.inflight[inflight] -= 1
            if watcher is not None and not watcher.done():
                done[0] = True
                watcher.cancel()
            if connection is not None:
                connection.on_lost = None
        # A 503's short body tells Triton's queue-full (overload) from a failing version.
        self._record(model, decision, started, response.status,
                     response.body() if response.status == 503 and response.complete else b"")

    def _route_sequence(self, policy: Policy, scope: Scope, body: bytes) -> Decision:
        """Routing for models with sequence affinity: the sequence fields live in the body."""
        names = policy.header_names
        found = {name: value for name, value in scope["headers"] if name in names}
        sequence_id, start, end = sequence_fields(scope["headers"], body)
        return choose_in_sequence(policy, found, self._draw(), self.pins, sequence_id, start, end)

    def _maybe_shadow(self, model: str, policy: Policy, decision: Decision, scope: Scope, target: bytes,
                      body: bytes, response: UpstreamResponse) -> None:
        if policy.shadow_version is None or self.shadow is None or not response.complete:
            return
        if decision.reason not in MAY_SHADOW or self._draw() >= policy.shadow_bp:
            return
        if self.shadow.full(model, policy.shadow_version):
            return
        shadow_target = _retarget(target, decision.version, policy.shadow_version)  # type: ignore[arg-type]
        self.shadow.offer(Mirror(model, policy.shadow_version, scope["method"].encode(), shadow_target,
                                 scope["headers"], body, response.status, response.body()))

    async def _fall_back(self, scope: Scope, target: bytes, body: bytes | AsyncIterator[bytes],
                         response: UpstreamResponse, model: str | None, policy: Policy | None, decision: Decision,
                         ) -> tuple[UpstreamResponse, Decision]:
        """Triton says the routed version is not available (unloaded, failed): send the same
        request, still in memory, to the fallback version of the policy it was routed by."""
        fallback = fallback_for(policy, decision)
        if fallback is None or not isinstance(body, bytes):
            return response, decision
        answer = await response.read()  # a short error body; it may arrive after the headers
        if not any(marker in answer for marker in _UNAVAILABLE_MARKERS):
            return response, decision
        self.recorder.upstream_error(model, decision.version, "VersionUnavailable")  # type: ignore[arg-type]
        target = _retarget(target, decision.version, fallback.version)  # type: ignore[arg-type]
        retried = await self.upstream.request(scope["method"].encode(), target, scope["headers"], body)
        return retried, fallback

    async def _relay(self, response: UpstreamResponse, send: Send, decision: Decision | None, done: list[bool]) -> None:
        headers = [(name, value) for name, value in response.headers if name.lower() not in _DROP_RESPONSE]
        if decision is not None:
            headers += self._decision_headers(decision, response)
        if response.complete:
            body = response.body()
            headers.append((b"content-length", str(len(body)).encode()))
            done[0] = True
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        length = [(name, value) for name, value in response.headers if name.lower() == b"content-length"]
        await send({"type": "http.response.start", "status": response.status, "headers": headers + length})
        async for chunk in response.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        done[0] = True
        await send({"type": "http.response.body", "body": b""})

    def _decision_headers(self, decision: Decision, response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
        key = (decision.version, decision.reason)
        cached = self._reason_headers.get(key)
        if cached is None:
            version = decision.version or _version_from(response)
            cached = [(_ROUTE_REASON, decision.reason.encode())]
            if version:
                cached.append((_ROUTE_VERSION, version.encode()))
            if decision.version is not None and len(self._reason_headers) < 1024:
                self._reason_headers[key] = cached
        return cached

    def _record(self, model: str | None, decision: Decision | None, started: float,
                result: int | GatewayError, body: bytes = b"") -> None:
        if model is None or decision is None:
            return
        latency = time.perf_counter() - started
        if isinstance(result, int):
            code = result
            outcome = http_outcome(code, body)
            if code == 404:  # names and versions Triton does not know: one label, bounded cardinality
                model, decision = UNKNOWN_MODEL, _UNKNOWN
        else:
            code = result.status
            outcome = Outcome.CANCELLED if isinstance(result, ClientGone) else Outcome.UPSTREAM_ERROR
            if isinstance(result, UpstreamError) and outcome is Outcome.UPSTREAM_ERROR:
                self.recorder.upstream_error(model, decision.version or "", type(result).__name__)
        self.recorder.record(model, decision.version or "", outcome, latency, decision.reason, "http", str(code))
        if self.access_log is not None:
            self.access_log(model, decision.version, decision.reason, "http", code, latency)


def _with_version(target: bytes, version: str) -> bytes:
    """/v2/models/{m}/{action}[?q] -> /v2/models/{m}/versions/{version}/{action}[?q]"""
    path, sep, query = target.partition(b"?")
    head, _, action = path.rpartition(b"/")
    return b"%s/versions/%s/%s%s%s" % (head, version.encode(), action, sep, query)


def _retarget(target: bytes, old: str, new: str) -> bytes:
    """The same versioned request, sent to another version."""
    return target.replace(b"/versions/%s/" % old.encode(), b"/versions/%s/" % new.encode(), 1)


def _version_from(response: UpstreamResponse) -> str | None:
    """Triton picked the version (no policy): it says which in a complete JSON body."""
    if not response.complete or response.status >= 400:
        return None
    body = response.body()
    marker = body.find(b'"model_version":"', 0, 512)
    if marker < 0:
        return None
    start = marker + 17
    end = body.find(b'"', start, start + 24)
    return body[start:end].decode() if end > 0 else None


async def _rest_of_body(first: bytes, receive: Receive) -> AsyncIterator[bytes]:
    yield first
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client closed the connection while sending the body")
        yield message.get("body", b"")
        if not message.get("more_body"):
            return


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)
    return None


def _client_lost(task: asyncio.Task[Any] | None, done: list[bool]) -> None:
    if not done[0] and task is not None:
        done[1] = True
        task.cancel()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any] | None, done: list[bool]) -> None:
    """Cancel the request's task when the client disconnects before the response is sent."""
    message = await receive()
    if message["type"] == "http.disconnect" and not done[0] and task is not None:
        done[1] = True
        task.cancel()


async def _send_error(send: Send, error: GatewayError) -> None:
    body = error.body()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def sequence_fields(headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[object | None, bool, bool]:
    """(sequence_id, start, end) from the request's JSON header; only the header is read
    (the first Inference-Header-Content-Length bytes of a binary body), from a
    decompressed copy when the body is compressed."""
    ihcl = encoding = None
    for name, value in headers:
        if name == b"inference-header-content-length":
            ihcl = int(value)
        elif name == b"content-encoding":
            encoding = value.lower()
    try:
        if encoding in (b"gzip", b"deflate"):
            body = zlib.decompress(body, 47 if encoding == b"gzip" else 15)
        parameters = json.loads(body[:ihcl] if ihcl else body).get("parameters") or {}
    except (ValueError, zlib.error, AttributeError):
        return None, False, False  # Triton will answer the malformed request itself
    sequence_id = parameters.get("sequence_id")
    if sequence_id in (None, 0, ""):
        return None, False, False
    return sequence_id, parameters.get("sequence_start") is True, parameters.get("sequence_end") is True

