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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from gateway.client_address import client_key
from gateway.control_surface import ControlGate, http_control_call
from gateway.errors import (
    BadRequest,
    ClientGone,
    GatewayError,
    Overloaded,
    UpstreamError,
    UpstreamUnavailable,
    UriTooLong,
)
from gateway.pipeline import Pipeline, Target, checked_model, passed_through_names
from gateway.proxy.limits import TRITON_MAX_TARGET, BodyReader, end_to_end
from gateway.proxy.renamed import Rename, is_event_stream, rename, renamed_path
from gateway.proxy.shadow import Mirror
from gateway.routing import VERSION_UNAVAILABLE_MARKERS, Decision, Policy, Reason
from gateway.sequences import SequenceFields, checked_sequence_id
from gateway.telemetry.recorder import STEERED_ROUTES, Outcome, http_outcome
from gateway.upstream import Body, HttpUpstream, UpstreamResponse

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

CONNECTION_KEY = "gateway.connection"  # set by gateway.http_front.GatewayHttpProtocol
ROUTED_ACTIONS = frozenset(["infer", "generate", "generate_stream"])
_JSON = [(b"content-type", b"application/json")]
_UNAVAILABLE = frozenset([404, 503])
_UNAVAILABLE_MARKERS = tuple(marker.encode() for marker in VERSION_UNAVAILABLE_MARKERS)
_NEEDS_BODY = Decision(None, Reason.SEQUENCE)  # marker: decide after reading the body
_AS_SENT = Target(None)  # not an inference call: the path goes upstream as the client sent it
_UNNAMED: tuple[str, str | None] = ("", None)  # a call that names no model: a fleet sends it to any server
_METHODS = {method: method.encode() for method in ("POST", "GET", "HEAD", "PUT", "DELETE", "OPTIONS")}
_STABLE_READS = frozenset(["ready", "config"])  # with the metadata call itself: answered for a renamed stable target
_MAX_RENAMED_TARGET = TRITON_MAX_TARGET + len("/versions/") + 19  # the most Triton reads whole (proxy.limits)
# A routed call's target with its version, as sent upstream: the same few (model, action, version)
# come back with every request, so each is written once (four calls a request). Bounded: full, it
# starts again empty (a query string makes a target of its own).
_VERSIONED: dict[tuple[bytes, str], bytes] = {}
_VERSIONED_KEPT = 1024


class HttpProxy:
    """ASGI app for the KServe-v2 / Triton HTTP API: the HTTP side of the shared pipeline."""

    def __init__(self, pipeline: Pipeline, upstream: HttpUpstream, gate: ControlGate | None = None,
                 bodies: BodyReader | None = None, fleets: Mapping[str, HttpUpstream] | None = None) -> None:
        self.pipeline = pipeline
        self.book = pipeline.book
        self.upstream = upstream  # the default fleet
        self.gate = gate  # None: Triton control calls pass through (triton_control=allow)
        self.bodies = bodies or BodyReader()
        self.fleets = dict(fleets or {})  # named fleets, for targets such as "green:3"
        self._reason_headers: dict[tuple[str | None, str], list[tuple[bytes, bytes]]] = {}

    def upstream_for(self, target: Target) -> HttpUpstream:
        if target.fleet is None:
            return self.upstream
        upstream = self.fleets.get(target.fleet)
        if upstream is None:
            raise UpstreamUnavailable(f"fleet '{target.fleet}' is not configured on this gateway")
        return upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        raw_path: bytes = scope.get("raw_path") or path.encode()
        query = scope["query_string"]
        target = raw_path + b"?" + query if query else raw_path
        if len(target) > TRITON_MAX_TARGET:  # Triton would drop the connection, and the fleet the server (limits.py)
            await _send_error(send, UriTooLong(
                f"request URL of {len(target)} bytes: Triton's HTTP server reads at most {TRITON_MAX_TARGET} reliably"))
            return
        model = policy = decision = None
        as_sent = _AS_SENT  # where a call that is not routed goes
        named = _UNNAMED  # what a call passed through as sent names, for a fleet to choose by
        versioned = True  # the target names its version already (or none is needed)
        if path.startswith("/v2/models/"):
            parts = path[11:].split("/")
            try:
                if len(parts) == 2 and parts[1] in ROUTED_ACTIONS:
                    model = checked_model(parts[0])
                    policy = self.book.get(model)  # the one policy lookup of this request
                    decision = _NEEDS_BODY if policy is not None and policy.sequence_affinity \
                        else self.pipeline.route(policy, scope["headers"])  # (affinity: decided once the body is read)
                    versioned = False
                elif len(parts) == 4 and parts[1] == "versions" and parts[3] in ROUTED_ACTIONS:
                    model = checked_model(parts[0])
                    policy = self.book.get(model)
                    decision = self.pipeline.pinned(parts[2])
                else:
                    named = _named(parts)
                    if named[0] and (len(parts) == 1 or len(parts) == 2 and parts[1] in _STABLE_READS):
                        as_sent = self._stable_read(named[0])
            except BadRequest as exc:  # a name no Triton serves: it reaches no table, header or log
                await _send_error(send, exc)
                return
        if model is None and self.gate is not None:  # never an inference: those were routed above
            refused = await self._control(scope, path)
            if refused is not None:
                await _send_error(send, refused)
                return
        await self._forward(scope, receive, send, target, versioned, model, policy, decision, named, as_sent)

    def _stable_read(self, model: str) -> Target:
        """A model's unversioned metadata, ready or config: asked of its policy's stable target
        when that is another model's name (answered with the called name), else as it was sent."""
        policy = self.book.get(model)
        stable = policy.renamed_stable if policy is not None else None
        if stable is None:
            return _AS_SENT
        return self.pipeline.target(Decision(stable.key, Reason.DEFAULT))

    async def _control(self, scope: Scope, path: str) -> GatewayError | None:
        """Triton model control on the data port: refused, or admitted with its token taken out."""
        call = http_control_call(scope["method"], path, scope.get("raw_path"))
        if call is None or self.gate is None:
            return None
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
        refused = await self.gate.admit(call, authorization, "http", _client(self, scope))
        if refused is None:  # the admin token is the gateway's, not Triton's business
            scope["headers"] = [(name, value) for name, value in scope["headers"] if name != b"authorization"]
        return refused

    async def _forward(self, scope: Scope, receive: Receive, send: Send, target: bytes, versioned: bool,
                       model: str | None, policy: Policy | None, decision: Decision | None,
                       named: tuple[str, str | None] = _UNNAMED, as_sent: Target = _AS_SENT) -> None:
        started = time.perf_counter()
        budget = self.bodies.budget
        # our front's cycle (gateway.http_output) hands a body that came whole without an ASGI message
        whole_body = getattr(getattr(receive, "__self__", None), "whole_body", None)
        body: Body | None = whole_body() if whole_body is not None else None
        message = None
        if body is None:
            message = await receive()
            body = message.get("body", b"")
        held = 0
        try:  # the body's bytes are released on every way out: answers, exceptions, cancellation
            try:
                if message is not None and message.get("more_body"):  # all of it before an upstream connection is
                    body = await self.bodies.read(message["body"], receive, scope["headers"])  # taken (proxy.limits)
                else:
                    budget.take(len(body))
                held = len(body)
                sequence = None
                if decision is _NEEDS_BODY or decision is not None and self._pins_sequences():
                    sequence = await self._sequence(scope["headers"], body, scope)  # read once: routing, the fleet
                    if decision is _NEEDS_BODY:
                        decision = await self._route_sequence(policy, scope, sequence)  # type: ignore[arg-type]
            except GatewayError as exc:  # refused before anything went upstream: not a sample of any version
                if not isinstance(exc, ClientGone):
                    await _send_error(send, exc)
                return
            await self._exchange(scope, receive, send, target, versioned, model, policy, decision, body, started,
                                 sequence, named, as_sent)
        finally:
            if held:
                budget.release(held)

    async def _exchange(self, scope: Scope, receive: Receive, send: Send, target: bytes, versioned: bool,
                        model: str | None, policy: Policy | None, decision: Decision | None, body: Body,
                        started: float, sequence: SequenceFields | None, named: tuple[str, str | None],
                        as_sent: Target = _AS_SENT) -> None:
        # what a fleet chooses the server by, read once here: the routed model (its version is
        # the target's), or what a call passed through as sent names
        exchange = HttpExchange(self, scope, send, target, versioned, body, named[0] if model is None else model,
                                named[1])
        exchange.sequence = sequence
        if model is not None and scope["path"].endswith("/generate_stream"):  # its responses are timed as they go out
            exchange.stream_of, exchange.started = model, started
        connection = scope.get(CONNECTION_KEY)
        task = exchange.task = connection.task if connection is not None else asyncio.current_task()
        watcher = None
        if decision is not None:
            if connection is not None:  # our server protocol tells us when the client leaves
                connection.on_lost = exchange.client_lost
            else:  # any other ASGI server: watch receive() for http.disconnect
                watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, exchange))
        try:
            if model is None or decision is None:  # not an inference call: passed through, not routed or recorded
                await exchange.send(as_sent)
                await exchange.deliver(None)
            else:
                await self.pipeline.forward(exchange, model, policy, decision, started, "http", _client(self, scope))
        except GatewayError as exc:
            if exchange.response is not None:  # broke mid-stream: headers are out, just stop
                exchange.response.abort()
            elif not isinstance(exc, ClientGone):
                exchange.handed = True
                await _send_error(send, exc)
            self._record_error(model, decision, started, exc, _client(self, scope), exchange.server)
        except asyncio.CancelledError:
            if exchange.response is not None:
                exchange.response.abort()
            if exchange.client_left and task is not None:  # our own cancel: the client left, nothing to answer
                task.uncancel()
                self._record_error(model, decision, started, ClientGone("client went away"), _client(self, scope),
                                   exchange.server)
                return
            raise
        finally:
            if watcher is not None and not watcher.done():
                exchange.handed = True
                watcher.cancel()
            if connection is not None:
                connection.on_lost = None

    def _record_error(self, model: str | None, decision: Decision | None, started: float, error: GatewayError,
                      client: str = "", server: str = "") -> None:
        if model is None or decision is None:
            return
        cancelled = isinstance(error, ClientGone)
        fault = type(error).__name__ if isinstance(error, UpstreamError) and not cancelled else None
        outcome = Outcome.CANCELLED if cancelled else Outcome.OVERLOAD if isinstance(error, Overloaded) \
            else Outcome.CLIENT_ERROR if error.status < 500 else Outcome.UPSTREAM_ERROR
        self.pipeline.record(model, decision, outcome, error.status, "http", started, fault, client, server)

    async def _route_sequence(self, policy: Policy, scope: Scope, sequence: SequenceFields | None) -> Decision:
        """Routing for models with sequence affinity: the sequence fields live in the body. A
        start's pin is its client's (read for starts only: a pin table quota per client)."""
        if sequence is None:
            return self.pipeline.route(policy, scope["headers"])
        return await self.pipeline.route_sequence(policy, scope["headers"], sequence.id, sequence.start,
                                                  sequence.end, sequence.client if sequence.start else None)

    def _pins_sequences(self) -> bool:
        """A fleet of several servers keeps each sequence on one: it needs the requests' sequence fields."""
        if self.upstream.reads_sequences:
            return True
        return bool(self.fleets) and any(fleet.reads_sequences for fleet in self.fleets.values())

    async def _sequence(self, headers: list[tuple[bytes, bytes]], body: Body,
                        scope: Scope | None = None) -> SequenceFields | None:
        """The request's sequence fields, read once (BadRequest for an id Triton would not take),
        with the client of ``scope`` (whose quota the pins it makes count against, in every pin
        table). An uncompressed body whose JSON header lacks the word ``sequence_id`` is not parsed at all."""
        header_end = len(body)
        for name, value in headers:
            if name == b"content-encoding":
                header_end = -1  # compressed: the word cannot be looked for without inflating
                break
            if name == b"inference-header-content-length" and value.isdigit():
                header_end = min(int(value) or header_end, header_end)  # the JSON header, not the tensors after it
        if header_end >= 0 and body.find(b"sequence_id", 0, header_end) < 0:
            return None
        header = await self._json_header(headers, body)
        copied = 0 if header is None or header is body else len(header)  # inflated, or cut from the body
        with self.bodies.budget.charged(copied):  # held while it is parsed (GatewayBusy if it does not fit)
            sequence_id, start, end = sequence_fields(header)
        checked = checked_sequence_id(sequence_id)
        if checked is None:
            return None
        return SequenceFields(checked, start, end, None if scope is None else _client(self, scope))

    async def _json_header(self, headers: list[tuple[bytes, bytes]], body: Body) -> Body | None:
        """The request's JSON header: the first Inference-Header-Content-Length bytes of a binary
        body, else all of it; decompressed (within the body limit) when the body is compressed.
        None when it cannot be read (Triton answers such a request itself)."""
        ihcl = encoding = None
        for name, value in headers:
            if name == b"inference-header-content-length":
                ihcl = value
            elif name == b"content-encoding":
                encoding = value.lower()
        try:
            prefix = int(ihcl) if ihcl is not None else None
            if prefix is not None and prefix < 0:
                return None
            header = await self.bodies.decoded(body, encoding, prefix)  # a decompression bomb: PayloadTooLarge
        except (ValueError, zlib.error):
            return None
        return header[:prefix] if prefix else header

    def decision_headers(self, decision: Decision, response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
        key = (decision.version, decision.reason)
        cached = self._reason_headers.get(key)
        if cached is None:
            version = decision.version or _version_from(response)
            announced = self.pipeline.announce(version, decision.reason)
            cached = [(name.encode(), value.encode()) for name, value in announced]
            if decision.version is not None and len(self._reason_headers) < 1024:
                self._reason_headers[key] = cached
        return cached


class HttpExchange:
    """One HTTP request and its answer, as the pipeline drives it (see ``pipeline.Exchange``)."""

    __slots__ = ("proxy", "scope", "send_to_client", "target", "versioned", "body", "response", "status",
                 "handed", "client_left", "task", "stream_of", "started", "delivered", "judged", "model", "version",
                 "sequence", "server", "renamed")

    def __init__(self, proxy: HttpProxy, scope: Scope, send: Send, target: bytes, versioned: bool,
                 body: Body, model: str = "", version: str | None = None) -> None:
        self.proxy = proxy
        self.scope = scope
        self.send_to_client = send
        self.target = target
        self.versioned = versioned
        self.body = body  # whole: read before anything goes upstream
        # What the front read of the request, once: a fleet of several servers chooses by them
        # (and pins on ``sequence``) without reading the request again. ``version``: the one a
        # call passed through as sent names (a routed call goes to its target's).
        self.model = model
        self.version = version
        self.server = ""  # the fleet's server it went to, noted by the fleet (pipeline.Exchange.server)
        self.response: UpstreamResponse | None = None
        self.status: int = 0
        self.handed = False  # the response was fully handed to the server
        self.client_left = False
        self.task: asyncio.Task[Any] | None = None
        self.stream_of: str | None = None  # the model of a generate_stream call, whose responses are timed
        self.started = 0.0  # when the request arrived (perf_counter)
        self.delivered = 0.0  # when the previous response went to the client; 0.0: none yet
        self.judged = True  # False when the client chose the version: its stream timings are not judged
        self.sequence: SequenceFields | None = None
        self.renamed: Rename | None = None  # the answer comes from another model than the one called (proxy.renamed)

    def _path(self, target: Target) -> bytes:
        if self.versioned or target.version is None:
            return self.target
        key = (self.target, target.version)
        path = _VERSIONED.get(key)
        if path is None:
            path = _with_version(self.target, target.version)
            if len(_VERSIONED) >= _VERSIONED_KEPT:
                _VERSIONED.clear()
            _VERSIONED[key] = path
        return path

    async def send(self, target: Target) -> None:
        scope = self.scope
        upstream = self.proxy.upstream if target.fleet is None else self.proxy.upstream_for(target)
        model, path = self.model, None
        if target.model is not None and target.model != model:  # a renamed target (its policy's own name: not)
            self.renamed, model = rename(target.model, model), target.model
            path = renamed_path(self.target, model, target.version)
            if len(path) > _MAX_RENAMED_TARGET:  # a longer name than the one called: the limit holds all the same
                raise UriTooLong(f"request URL of {len(path)} bytes once addressed to '{model}': Triton's HTTP "
                                 f"server reads at most {_MAX_RENAMED_TARGET} reliably")
        else:
            self.renamed = None  # a fallback after a renamed target may answer as the called model
        method = scope["method"]
        self.response = await upstream.request(_METHODS.get(method) or method.encode(), path or self._path(target),
                                               scope["headers"],
                                               self.body, model=model, version=self.version or target.version,
                                               sequence=self.sequence, for_exchange=self)
        self.status = self.response.status

    def unavailable(self) -> bool:
        return self.status in _UNAVAILABLE

    async def version_gone(self) -> bool:
        """The request is still in memory and Triton's short error body names the version as gone."""
        if self.response is None:
            return False
        answer = await self.response.read()  # a short error body; it may arrive after the headers
        return any(marker in answer for marker in _UNAVAILABLE_MARKERS)

    async def deliver(self, decision: Decision | None) -> None:
        response, send = self.response, self.send_to_client
        assert response is not None
        headers = end_to_end(response.headers)
        version = None  # the version whose generate_stream responses are timed
        if decision is not None:
            headers += self.proxy.decision_headers(decision, response)
            if self.stream_of is not None and response.status == 200:
                version = decision.version or ""
                self.judged = decision.reason not in STEERED_ROUTES
        renamed, chunks, body = self.renamed, None, None
        if renamed is not None:  # another model answered: the client sees the name it called
            if response.complete or not is_event_stream(headers):
                headers, body = await self._renamed(renamed, response, headers)
            else:
                chunks = renamed.events(response)  # its length changes: sent chunked
        elif response.complete:
            body = response.body()
        if body is not None:
            headers.append((b"content-length", str(len(body)).encode()))
            self.handed = True
            if version is not None:  # the whole stream at once: one delivery
                self._timed(version)
            # our front's cycle (gateway.http_output) writes a whole answer at once; found through the
            # send callable, as the scope must not hold the cycle (a reference cycle per request: GC work)
            answer = getattr(getattr(send, "__self__", None), "answer", None)
            if answer is not None:
                await answer(response.status, headers, body)
                return
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        length = [] if chunks is not None else [(name, value) for name, value in response.headers
                                                 if name.lower() == b"content-length"]
        await send({"type": "http.response.start", "status": response.status, "headers": headers + length})
        async for chunk in chunks or response.chunks():
            if version is not None:
                self._timed(version)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.handed = True
        await send({"type": "http.response.body", "body": b""})

    async def _renamed(self, renamed: Rename, response: UpstreamResponse,
                       headers: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The whole answer with the called name. One that did not arrive with its headers is
        read to its end here, charged to the byte budget while it is renamed."""
        if response.complete:
            return renamed.answer(response.status, headers, response.body(), self.proxy.bodies.max_body)
        body = await response.read()
        with self.proxy.bodies.budget.charged(len(body)):
            return renamed.answer(response.status, headers, body, self.proxy.bodies.max_body)

    def _timed(self, version: str) -> None:
        """A generate_stream response goes to the client now. Triton writes each server-sent
        event as one chunk, so a chunk is a response (events read together go out together:
        one delivery, never a gap of 0)."""
        assert self.stream_of is not None
        self.delivered = self.proxy.pipeline.recorder.stream_response(self.stream_of, version, self.started,
                                                                      self.delivered, self.judged)

    def outcome(self) -> Outcome:
        response = self.response
        # A 503's short body tells Triton's full or timed-out queue (rejected) from a failing version, a 500's
        # a body Triton could not parse (the client's error) from a failing version.
        body = response.body() if self.status in (500, 503) and response is not None and response.complete else b""
        return http_outcome(self.status, body)

    def fault(self) -> str | None:
        return None  # an HTTP 5xx counts as an upstream error in the outcome; kinds are transport failures

    def mirrorable(self) -> bool:
        return self.status == 200 and self.response is not None and self.response.complete

    def mirror(self, model: str, decision: Decision, shadow: Target) -> Mirror:
        response = self.response
        assert response is not None
        if shadow.model is not None and shadow.model != model:  # a renamed shadow: the outputs are compared, not names
            path, answering = renamed_path(self.target, shadow.model, shadow.version), shadow.model
        else:
            assert shadow.version is not None
            path, answering = _with_version(self.target, shadow.version), None
        return Mirror(model, shadow.version, self.scope["method"].encode(), path, self.scope["headers"], self.body,
                      response.status, response.body(), response.headers, shadow.fleet, shadow.key, answering)

    def client_lost(self) -> None:
        """The client went away before the answer was out: stop the upstream work."""
        if not self.handed and self.task is not None:
            self.client_left = True
            self.task.cancel()


def _with_version(target: bytes, version: str) -> bytes:
    """/v2/models/{m}/{action}[?q] -> /v2/models/{m}/versions/{version}/{action}[?q]"""
    path, sep, query = target.partition(b"?")
    head, _, action = path.rpartition(b"/")
    return b"".join((head, b"/versions/", version.encode(), b"/", action, sep, query))


def _named(parts: list[str]) -> tuple[str, str | None]:
    """``/v2/models/{m}[/versions/{v}]...`` of a call passed through as sent (metadata, ready, stats):
    its model and version as a fleet may choose by them (``pipeline.passed_through_names``)."""
    return passed_through_names(parts[0], parts[2] if len(parts) > 2 and parts[1] == "versions" else None)


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


async def _cancel_on_disconnect(receive: Receive, exchange: HttpExchange) -> None:
    """Cancel the request's task when the client disconnects before the response is sent."""
    message = await receive()
    if message["type"] == "http.disconnect":
        exchange.client_lost()


async def _send_error(send: Send, error: GatewayError) -> None:
    body = error.body()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *error.headers]})
    await send({"type": "http.response.body", "body": body})


def sequence_fields(header: Body | None) -> tuple[object | None, bool, bool]:
    """(sequence_id, start, end) from a request's JSON header (see ``HttpProxy._json_header``).
    The id is as the client wrote it (``Pipeline.route`` checks it); BadRequest for a header
    nested deeper than the parser goes."""
    if header is None:
        return None, False, False
    try:
        parsed = json.loads(header)
    except ValueError:
        return None, False, False  # Triton will answer the malformed request itself
    except RecursionError:
        raise BadRequest("the request's JSON header is nested too deeply to be read") from None
    parameters = parsed.get("parameters") if isinstance(parsed, dict) else None
    if not isinstance(parameters, dict):
        return None, False, False  # no parameters (or not an object: Triton answers that itself)
    sequence_id = parameters.get("sequence_id")
    if sequence_id is None:
        return None, False, False
    return sequence_id, parameters.get("sequence_start") is True, parameters.get("sequence_end") is True


def _client(proxy: HttpProxy, scope: Scope) -> str:
    """The request's client for the rollout judge: the peer, or whom a trusted proxy forwarded."""
    peer = scope.get("client")
    clients = proxy.pipeline.clients
    if not clients.trusted:  # no proxy is believed: the peer's address itself (a call less per request)
        address = peer[0] if peer else ""
        return address if ":" not in address else client_key(address)  # IPv4 is its own key: no call
    return clients.of(peer[0] if peer else None, scope["headers"])
