"""``inference.GRPCInferenceService`` on the gateway's gRPC port, forwarded to Triton.

A generic handler with no (de)serializers: requests and responses stay raw bytes.
``ModelInfer`` and ``ModelStreamInfer`` are routed (an empty ``model_version`` gets one from
the policy; a pinned one is kept); every other method passes through unchanged. Only the
routing fields are read (``grpc_wire``), the tensors are never decoded. Deadlines and
cancellation propagate upstream; outcomes are classified by gRPC status code. Unary calls go
upstream through ``gateway.grpc_upstream`` (our lean HTTP/2 client); ``ModelStreamInfer``
through a grpc.aio channel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from gateway.grpc_upstream import UPSTREAM_FAULTS, GrpcUpstream
from gateway.policy_book import PolicyBook
from gateway.proxy.grpc_wire import RouteFields, WireError, route_fields, with_version
from gateway.proxy.shadow import GrpcMirror, ShadowMirror
from gateway.routing import (
    MAY_SHADOW,
    VERSION_UNAVAILABLE_MARKERS,
    Decision,
    Policy,
    Reason,
    WeylDraw,
    choose_in_sequence,
    fallback_for,
    inflight_key,
)
from gateway.sequences import SequencePins
from gateway.telemetry.recorder import UNKNOWN_MODEL, Outcome, Recorder

SERVICE = "/inference.GRPCInferenceService/"
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_PINNED = Reason.PINNED
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_UPSTREAM_FAULTS = frozenset(_STATUS[number] for number in UPSTREAM_FAULTS)
_VERSION_GONE = frozenset([grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.UNAVAILABLE.value[0]])


def classify(code: grpc.StatusCode) -> Outcome:
    """gRPC answers HTTP 200 even on failure: the status code says whose fault it was."""
    if code is grpc.StatusCode.OK:
        return Outcome.SUCCESS
    if code is grpc.StatusCode.CANCELLED:
        return Outcome.CANCELLED
    return Outcome.UPSTREAM_ERROR if code in _UPSTREAM_FAULTS else Outcome.CLIENT_ERROR


class GrpcProxy(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, book: PolicyBook, recorder: Recorder, pins: SequencePins, upstream_url: str,
                 access_log: Callable[..., None] | None = None, connect_timeout: float = 2.0,
                 shadow: ShadowMirror | None = None) -> None:
        self.book = book
        self.access_log = access_log
        self.recorder = recorder
        self.pins = pins
        self.shadow = shadow
        self.upstream_url = upstream_url
        self.channel = grpc.aio.insecure_channel(upstream_url, options=CHANNEL_OPTIONS)  # ModelStreamInfer
        self.unary = GrpcUpstream(upstream_url, connect_timeout)  # every unary call: see grpc_upstream
        self._draw = WeylDraw(seed=time.monotonic_ns() + 1)
        self._handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._handlers.get(method, False)
        if handler is False:
            handler = self._handlers[method] = self._build(method)
        return handler

    def _build(self, method: str) -> grpc.RpcMethodHandler | None:
        if not method.startswith(SERVICE):
            return None  # UNIMPLEMENTED, as Triton would answer
        if method.endswith("/ModelStreamInfer"):
            upstream_stream = self.channel.stream_stream(method)

            async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for response in self._stream(upstream_stream, requests, context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream)
        if method.endswith("/ModelInfer"):
            async def infer(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                return await self._infer(method, raw, context)

            return grpc.unary_unary_rpc_method_handler(infer)

        async def passthrough(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            code, details, answer = await self.unary.unary(method, raw, _forwarded(context), context.time_remaining())
            if code:
                await context.abort(_STATUS.get(code, grpc.StatusCode.UNKNOWN), self._details(code, details))
            return answer

        return grpc.unary_unary_rpc_method_handler(passthrough)

    # -- routing --------------------------------------------------------------------------
    def _route(self, fields: RouteFields, raw: bytes,
               metadata: tuple[Any, ...]) -> tuple[Policy | None, Decision | None, bytes]:
        policy = self.book.get(fields.model_name)
        if fields.model_version:
            return policy, Decision(fields.model_version, _PINNED), raw
        if policy is None:
            return None, None, raw
        names = policy.header_names
        headers = {key.encode(): value.encode() for key, value in metadata
                   if isinstance(value, str) and key.encode() in names}
        decision = choose_in_sequence(policy, headers, self._draw(), self.pins, fields.sequence_id,
                                      fields.sequence_start, fields.sequence_end)
        return policy, decision, with_version(raw, decision.version)  # type: ignore[arg-type]

    async def _infer(self, method: str, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started = time.perf_counter()
        try:
            fields = route_fields(raw)
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ModelInferRequest: {exc}")
            raise
        metadata = context.invocation_metadata() or ()
        policy, decision, routed = self._route(fields, raw, metadata)
        forwarded = _forwarded(context, metadata)
        inflight = inflight_key(fields.model_name, policy, decision)
        counts = self.recorder.inflight
        if inflight is not None:  # the drain before an unload waits for these
            counts[inflight] = counts.get(inflight, 0) + 1
        try:
            code, details, response = await self.unary.unary(method, routed, forwarded, context.time_remaining())
            if code in _VERSION_GONE and decision is not None and decision.version is not None \
                    and any(marker in details for marker in VERSION_UNAVAILABLE_MARKERS):
                fallback = fallback_for(policy, decision)
                if fallback is not None and fallback.version is not None:  # unloaded under us: re-send it
                    self.recorder.upstream_error(fields.model_name, decision.version, "VersionUnavailable")
                    decision, retried = fallback, with_version(raw, fallback.version)
                    code, details, response = await self.unary.unary(method, retried, forwarded,
                                                                     context.time_remaining())
        except asyncio.CancelledError:  # the client cancelled: the upstream stream was reset with us
            self._record(fields.model_name, decision, grpc.StatusCode.CANCELLED, started)
            raise
        finally:
            if inflight is not None:
                counts[inflight] -= 1
        status = _STATUS.get(code, grpc.StatusCode.UNKNOWN)
        self._record(fields.model_name, decision, status, started)
        if decision is not None and decision.reason is not _PINNED:  # after any fallback: the version that answered
            await context.send_initial_metadata(_decision_metadata(decision))
        if code:
            await context.abort(status, self._details(code, details))
        if policy is not None and policy.shadow_version is not None and decision is not None:
            self._maybe_shadow(method, fields.model_name, policy, decision, raw, forwarded, response)
        return response

    def _maybe_shadow(self, method: str, model: str, policy: Policy, decision: Decision, raw: bytes,
                      forwarded: tuple[Any, ...], response: bytes) -> None:
        version = policy.shadow_version
        if self.shadow is None or version is None or decision.reason not in MAY_SHADOW:
            return
        if self._draw() >= policy.shadow_bp or self.shadow.full(model, version):
            return
        self.shadow.offer(GrpcMirror(model, version, self.unary, method, with_version(raw, version), forwarded,
                                     response))

    async def _stream(self, upstream: Any, requests: AsyncIterator[bytes],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        metadata = context.invocation_metadata() or ()
        last: dict[str, Any] = {"model": None, "decision": None, "sent": time.perf_counter()}

        async def routed() -> AsyncIterator[bytes]:
            async for raw in requests:
                fields = route_fields(raw)
                _, decision, raw = self._route(fields, raw, metadata)
                last.update(model=fields.model_name, decision=decision, sent=time.perf_counter())
                yield raw

        call = upstream(routed(), metadata=_forwarded(context, metadata), timeout=context.time_remaining())
        announced = False
        try:
            async for response in call:
                decision = last["decision"]
                if not announced and decision is not None and decision.reason is not _PINNED:
                    await context.send_initial_metadata(_decision_metadata(decision))
                announced = True
                # ModelStreamInferResponse: field 1 error_message; a failed request inside a
                # stream comes back as a message and the stream stays open.
                failed = response[:1] == b"\x0a" and len(response) > 1 and response[1] != 0
                self._record(last["model"], decision, grpc.StatusCode.INTERNAL if failed else grpc.StatusCode.OK,
                             last["sent"])
                yield response
        except grpc.aio.AioRpcError as exc:
            self._record(last["model"], last["decision"], exc.code(), last["sent"])
            await context.abort(exc.code(), self._details(exc.code().value[0], exc.details()))

    def _details(self, code: int, details: str | None) -> str:
        if code == grpc.StatusCode.UNAVAILABLE.value[0]:
            return f"upstream triton at {self.upstream_url} is unavailable: {details}"
        return details or ""

    def _record(self, model: str | None, decision: Decision | None, code: grpc.StatusCode, started: float) -> None:
        if model is None:
            return
        version = decision.version if decision is not None and decision.version else ""
        reason = decision.reason if decision is not None else Reason.DEFAULT
        if code is grpc.StatusCode.NOT_FOUND or (decision is None and self.book.get(model) is None
                                                 and code is not grpc.StatusCode.OK):
            model, version = UNKNOWN_MODEL, ""
        outcome = classify(code)
        if outcome is Outcome.UPSTREAM_ERROR:
            self.recorder.upstream_error(model, version, code.name)
        latency = time.perf_counter() - started
        self.recorder.record(model, version, outcome, latency, reason, "grpc", code.name)
        if self.access_log is not None:
            self.access_log(model, version, reason, "grpc", code.name, latency)

    async def aclose(self) -> None:
        await self.channel.close()
        await self.unary.aclose()


def _decision_metadata(decision: Decision) -> tuple[tuple[str, str], ...]:
    return (("x-gateway-model-version", decision.version or ""), ("x-gateway-route", decision.reason))


def _forwarded(context: grpc.aio.ServicerContext, metadata: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """The client's metadata minus what gRPC sets itself (user-agent, grpc-*)."""
    source = metadata if metadata is not None else (context.invocation_metadata() or ())
    return tuple((key, value) for key, value in source if key != "user-agent" and not key.startswith("grpc-"))


async def start_server(proxy: GrpcProxy, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(handlers=[proxy], options=CHANNEL_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
