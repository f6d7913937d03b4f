"""Properties of what the gateway holds and keeps per request, over generated requests (issue 22).

Hypothesis generates what a client controls in a request the gateway reads, on both ports:

- HTTP: the model and the pinned version in the path (known ones, digits of every length,
  leading zeros, arbitrary text, percent-encoded control characters), a JSON header with every
  JSON type where the sequence id and flags belong, nested up to far past the parser's depth,
  padding from nothing to past ``max_body_bytes``, ``Content-Encoding`` (identity, gzip,
  deflate, bogus, a lying one, bombs that inflate to many times the limit) and
  ``Inference-Header-Content-Length`` from 0 (and below) past the body;
- gRPC: several streams on one connection, each with a message that is a ModelInferRequest
  (arbitrary model name and version, sequence ids of every protobuf type, strings past the
  bound), random bytes or a deflate bomb; the compressed flag, ``grpc-encoding``, message sizes
  around ``grpc_max_message_bytes``, whether the stream ends or the connection just closes.

The gateway under test has sequence affinity and a 100 % shadow on ``qc``, so it reads every
JSON header, keeps a shadow copy of every success and pins sequences: everything it may hold is
exercised. After every example:

- every request was answered (HTTP: a status, never a 500, and JSON for the gateway's own
  refusals; gRPC: a status per stream, or the connection closed) within the bound;
- once the example's connections are closed, the budget of held bytes is back to 0 and the
  in-flight counts to where they were;
- the process RSS stays under a bound derived from the budget;
- a bystander (/healthz and a gRPC ModelMetadata every ~50 ms: no inference, so Triton's
  count is the example's alone) is served, each time within 1 s;
- Triton's request count rose by no more than the requests completed (twice that, for the
  shadow's copies), counted from once Triton answered all that was sent to it before (an earlier
  test's or example's request, or a shadow still at Triton, was charged to the next example once:
  "Triton saw 1 requests; 0 completed" for a message sent without END_STREAM);
- the recorder's series name only versions Triton serves or ``_unserved``, the pipeline's target
  cache, the HTTP front's header cache and the route-metadata cache stay within their caps,
  whatever strings were sent.

``FUZZ_EXAMPLES`` sets the number of examples (small and derandomised by default, so CI replays
the same ones; ``make fuzz`` runs 5,000 random ones). The worst value of each invariant goes to
``tests/abuse/worst.py``, printed at the end of the run.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from gateway.devtools.local_triton import LocalTriton
from gateway.pipeline import _MAX_TARGETS, route_metadata
from gateway.telemetry.recorder import UNKNOWN_MODEL
from tests.abuse import worst
from tests.abuse.attack import (
    DATA,
    END_STREAM,
    Attacker,
    Bystander,
    frame,
    request_headers,
    rss_mb,
    settled_triton_requests,
    triton_requests,
    varint,
)
from tests.support import GatewayThread, gateway_settings

pytestmark = [pytest.mark.triton, pytest.mark.property]
MB = 1 << 20
HTTP_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
GRPC_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
MAX_BODY = MAX_MESSAGE = 1 * MB
BUDGET = 4 * MB
ANSWER_BOUND_S = 10.0  # Triton's answer, a bounded inflation and a loaded 2-core machine
# what the gateway may hold (the budget, twice while copied), plus the allocator's slack over
# thousands of examples (the gateway runs in a process of its own: this is its RSS alone)
RSS_BOUND_MB = 2 * BUDGET / MB + 64
SERVED = {"1", "2", "3"}  # the versions of qc Triton serves (deploy/model_repository)
LABELS = SERVED | {"_unserved", ""}
_SETTLE_S = 5.0


class HeldGateway:
    """The gateway under test in a process of its own (as ``gateway_process`` does for the head
    properties): hypothesis keeps what it generated, and in the test's process RSS would measure
    that rather than the gateway. The child answers :meth:`state` over a pipe."""

    def __init__(self, triton_url: str, **values: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(triton_url, values, child), daemon=True)
        self.port = self.grpc_port = 0

    @property
    def url(self) -> str:  # what attack.Bystander reads
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> HeldGateway:  # attack.Bystander reads settings.grpc_port
        return self

    def __enter__(self) -> HeldGateway:
        self._process.start()
        if not self._pipe.poll(60):
            self._process.kill()
            raise RuntimeError("the gateway process did not start")
        self.port, self.grpc_port = self._pipe.recv()
        return self

    def state(self) -> dict[str, Any]:
        self._pipe.send("state")
        if not self._pipe.poll(10):
            raise AssertionError("the gateway process did not answer within 10 s")
        found: dict[str, Any] = self._pipe.recv()
        return found

    def __exit__(self, *exc: object) -> None:
        self._pipe.send("stop")
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


def _serve(triton_url: str, values: dict[str, Any], pipe: Connection) -> None:
    """In the child: the gateway, and what it holds and keeps, read on its loop when asked."""
    with GatewayThread(gateway_settings(triton_url, **values)) as gateway:
        async def read() -> dict[str, Any]:
            app = gateway.app
            return {"held": app.budget.held, "inflight": dict(app.recorder.inflight),
                    "labels": {(model, version) for model, version, *_ in app.recorder.totals},
                    "targets": len(app.pipeline._targets), "reason_headers": len(app.proxy._reason_headers),
                    "route_metadata": route_metadata.cache_info().currsize, "shadow_queue": app.shadow._queue.qsize()}

        pipe.send((gateway.settings.port, gateway.settings.grpc_port))
        while pipe.recv() == "state":
            state: dict[str, Any] = gateway.call(read())
            state["rss_mb"] = rss_mb()
            pipe.send(state)


@pytest.fixture(scope="module")
def held_gateway(triton: LocalTriton) -> Iterator[tuple[HeldGateway, Bystander]]:
    policy = {"weights": {"2": 100}, "sequence_affinity": True, "shadow": {"version": "3", "percent": 100}}
    with HeldGateway(triton.http_url, triton_grpc_url=triton.grpc_url, policies={"qc": policy},
                     max_body_bytes=MAX_BODY, grpc_max_message_bytes=MAX_MESSAGE,
                     max_buffered_body_bytes=BUDGET) as gateway:
        bystander = Bystander(gateway, metadata_only=True)  # type: ignore[arg-type]  # no inference: Triton's count is ours
        thread = threading.Thread(target=bystander.run, daemon=True)
        thread.start()
        yield gateway, bystander
        bystander._stop.set()
        thread.join(10)


def _in_flight(state: dict[str, Any]) -> int:
    return sum(state["inflight"].values())


def _settled(gateway: HeldGateway) -> dict[str, Any]:
    """The state once the example's work is done: nothing held, no shadow queued, nothing in flight
    but the bystander's one call at a time."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        state = gateway.state()
        done = state["held"] == 0 and state["shadow_queue"] == 0 and _in_flight(state) <= 1
        if done or time.monotonic() > deadline:
            worst.note("budget: seconds until the example's bytes are released",
                       _SETTLE_S - (deadline - time.monotonic()), _SETTLE_S, "s")
            return state
        time.sleep(0.02)


def _check_after(gateway: HeldGateway, bystander: Bystander, triton: LocalTriton, start: dict[str, Any],
                 before_triton: int, completed: int, took: float, port: str) -> None:
    worst.note(f"budget ({port}): seconds to every answer or a close", took, ANSWER_BOUND_S, "s")
    assert took <= ANSWER_BOUND_S
    state = _settled(gateway)
    assert state["held"] == 0, f"{state['held']} bytes still held after the example"
    assert _in_flight(state) <= 1, f"in flight after the example: {state['inflight']} (the bystander's: 1 at most)"
    grown = state["rss_mb"] - _rss_start.setdefault(id(gateway), state["rss_mb"])  # from the first example on
    worst.note("budget: the gateway's RSS growth since the first example", grown, RSS_BOUND_MB, " MB")
    assert grown <= RSS_BOUND_MB, f"RSS grew by {grown:.0f} MB"
    slowest, bystander.slowest = bystander.slowest, 0.0
    worst.note("budget: bystander's slowest answer", slowest, 1.0, "s")
    assert not bystander.failures, bystander.failures[:3]
    assert slowest <= 1.0, f"the bystander waited {slowest:.2f}s"
    time.sleep(0.05)  # Triton's statistics count a call just after answering it
    extra = triton_requests(triton) - before_triton
    worst.note(f"budget ({port}): Triton requests beyond 2 per completed request", extra - 2 * completed, 0, "")
    assert extra <= 2 * completed, f"Triton saw {extra} requests; {completed} completed (each may be shadowed once)"
    labels = state["labels"]
    versions = {version for model, version in labels if model == "qc"}
    models = {model for model, _ in labels}
    worst.note("budget: recorder label sets", len(labels), 4096, "")
    assert versions <= LABELS, sorted(versions - LABELS)[:5]
    assert models <= {"qc", "tok", UNKNOWN_MODEL}, sorted(models)[:5]
    worst.note("budget: pipeline targets cached", state["targets"], _MAX_TARGETS, "")
    assert state["targets"] <= _MAX_TARGETS and state["reason_headers"] <= 1024 and state["route_metadata"] <= 1024


_rss_start: dict[int, float] = {}  # the gateway's RSS after the first example (its pools and caches warm)


# -- HTTP ------------------------------------------------------------------------------------------
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                         st.text(max_size=20), st.text(min_size=120, max_size=200))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3)), max_leaves=6)
SEQUENCE_IDS = st.one_of(st.integers(0, (1 << 64) + 5), st.sampled_from([0, 1, 7, "", "s", "x" * 128, "x" * 129]),
                         JSON_VALUES)
MODELS = st.one_of(st.sampled_from(["qc", "qc", "qc", "tok", "nope"]), st.text(max_size=300),
                   st.sampled_from(["m" * 255, "m" * 256, "q\nc", "q\"c"]))
VERSIONS = st.one_of(st.sampled_from(["1", "2", "3", "0002", "4", "9" * 19, "9" * 20, "1\n2", "1\"2", "-1", "", "v2"]),
                     st.integers(0, 10 ** 25).map(str), st.text(max_size=24))
ENCODINGS = st.sampled_from([None, "identity", "gzip", "deflate", "br", "gzip, deflate", "GZIP", "lying-gzip"])


_DEEP = "__deep__"  # replaced by the nested text after json.dumps (which would recurse as deep itself)


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    model = urllib.parse.quote(draw(MODELS), safe="")
    if draw(st.booleans()):
        path = f"/v2/models/{model}/infer"
    else:
        path = f"/v2/models/{model}/versions/{urllib.parse.quote(draw(VERSIONS), safe='')}/infer"
    parameters: dict[str, Any] = {}
    if draw(st.booleans()):
        parameters["sequence_id"] = draw(SEQUENCE_IDS)
    for flag in ("sequence_start", "sequence_end"):
        if draw(st.booleans()):
            parameters[flag] = draw(st.one_of(st.booleans(), JSON_SCALARS))
    depth = draw(st.sampled_from([0, 0, 10, 900, 1500, 5000]))
    if depth:
        parameters["deep"] = _DEEP
    header: dict[str, Any] = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                          "data": [1, 2, 3, 4]}]}
    if draw(st.booleans()):
        header["parameters"] = parameters
    elif parameters:
        header["parameters"] = draw(st.sampled_from([[parameters], "x", 5, None]))  # the wrong type altogether
    padding = draw(st.sampled_from([0, 0, 100, 64 << 10, 900_000, MAX_BODY + 10]))
    if padding:
        header["id"] = "p" * padding
    body = json.dumps(header).replace(f'"{_DEEP}"', "[" * depth + "1" + "]" * depth).encode()
    binary = draw(st.sampled_from([b"", b"", b"\x00" * 16, b"\x00" * (2 * MB)]))
    headers = {"content-type": "application/json"}
    ihcl = draw(st.one_of(st.none(), st.sampled_from([0, -1, 1, len(body) - 1, len(body), len(body) + len(binary) + 9]),
                          st.sampled_from(["x", "1e3", " 5", "18446744073709551616"])))
    if ihcl is not None or binary:
        headers["inference-header-content-length"] = str(len(body) if ihcl is None else ihcl)
    payload = body + binary
    encoding = draw(ENCODINGS)
    bomb = draw(st.sampled_from([0, 0, 0, 4, 64]))  # MiB of spaces after the header, inflating far past the limit
    if encoding in ("gzip", "GZIP", "deflate", "gzip, deflate"):
        packer = zlib.compressobj(1, zlib.DEFLATED, 31 if "gzip" in encoding.lower() else 15)
        payload = packer.compress(payload) + b"".join(packer.compress(bytes(MB)) for _ in range(bomb)) \
            + packer.flush()
    if encoding is not None:
        headers["content-encoding"] = "gzip" if encoding == "lying-gzip" else encoding
    return path, payload, headers


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes] | None:
    """The answer, or None when the gateway closed the connection (as after a 413 it may)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=ANSWER_BOUND_S)
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    except (ConnectionError, http.client.RemoteDisconnected):
        return None
    finally:
        connection.close()


@settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=http_requests())
def test_every_http_body_is_released_and_no_string_is_kept(
        held_gateway: tuple[HeldGateway, Bystander], triton: LocalTriton,
        request: tuple[str, bytes, dict[str, str]]) -> None:
    gateway, bystander = held_gateway
    path, body, headers = request
    start, before_triton = gateway.state(), settled_triton_requests(triton, still_s=0.02)
    started = time.monotonic()
    answer = _post(gateway.port, path, body, headers)
    took = time.monotonic() - started
    completed = 0
    if answer is not None:
        status, answer_headers, answer_body = answer
        # a 500 only from Triton itself, passed on (the pipeline's answers carry x-gateway-route)
        assert status < 600 and (status != 500 or "x-gateway-route" in answer_headers), (status, answer_body[:300])
        if status in (400, 413, 503) and answer_headers.get("content-type") == "application/json":
            assert "error" in json.loads(answer_body), answer_body[:300]
        assert "\n" not in answer_headers.get("x-gateway-model-version", "")
        completed = 1
    _check_after(gateway, bystander, triton, start, before_triton, completed, took, "http")


# -- gRPC ------------------------------------------------------------------------------------------
SEQUENCE_PARAMETERS = st.one_of(
    st.none(),
    st.integers(0, (1 << 63) - 1).map(lambda n: ("int64_param", n)),
    st.integers(0, (1 << 64) - 1).map(lambda n: ("uint64_param", n)),
    st.text(max_size=200).map(lambda s: ("string_param", s)),
    st.booleans().map(lambda b: ("bool_param", b)),
)


@st.composite
def grpc_messages(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """(the framed message, the grpc-encoding it is sent with)."""
    kind = draw(st.sampled_from(["infer", "infer", "random", "bomb"]))
    if kind == "infer":
        message = service_pb2.ModelInferRequest(model_name=draw(MODELS), model_version=draw(VERSIONS))
        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(b"\x00" * 16)
        parameter = draw(SEQUENCE_PARAMETERS)
        if parameter is not None:
            setattr(message.parameters["sequence_id"], *parameter)
            message.parameters["sequence_start"].bool_param = draw(st.booleans())
        pad = draw(st.sampled_from([0, 0, 1000, MAX_MESSAGE - 200, MAX_MESSAGE + 10]))
        raw = message.SerializeToString() + (b"\x7a" + varint(pad) + bytes(pad) if pad else b"")
    elif kind == "random":
        raw = draw(st.binary(max_size=64))
    else:  # zeros of a size around and far past the limit, sent compressed when the stream says so
        size = draw(st.sampled_from([MAX_MESSAGE - 100, 4 * MB, 16 * MB]))
        encoding = draw(st.sampled_from([b"gzip", b"deflate", None]))
        if encoding is None:  # uncompressed: only its length prefix and a first piece (the bytes would be refused)
            return b"\x00" + size.to_bytes(4, "big") + bytes(min(size, 64 << 10)), None
        return b"\x01" + _bomb(size, encoding), encoding
    encoding = draw(st.sampled_from([None, b"gzip", b"deflate", b"identity", b"snappy"]))
    compressed = draw(st.sampled_from([0, 1, 1, 2])) if encoding is not None else draw(st.sampled_from([0, 0, 1]))
    if compressed == 1 and encoding in (b"gzip", b"deflate"):
        packer = zlib.compressobj(1, zlib.DEFLATED, 31 if encoding == b"gzip" else 15)
        raw = packer.compress(raw) + packer.flush()
    return bytes([compressed]) + len(raw).to_bytes(4, "big") + raw, encoding


_bombs: dict[tuple[int, bytes], bytes] = {}


def _bomb(size: int, encoding: bytes) -> bytes:
    """``size`` zero bytes compressed, length-prefixed; built once per size (the test runs in the
    gateway's process: building them per example would show in the RSS it measures)."""
    if (size, encoding) not in _bombs:
        packer = zlib.compressobj(1, zlib.DEFLATED, 31 if encoding == b"gzip" else 15)
        packed = b"".join(packer.compress(bytes(MB)) for _ in range(size // MB)) + packer.compress(
            bytes(size % MB)) + packer.flush()
        _bombs[size, encoding] = len(packed).to_bytes(4, "big") + packed
    return _bombs[size, encoding]


@settings(max_examples=GRPC_EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(messages=st.lists(grpc_messages(), min_size=1, max_size=6), end=st.booleans())
def test_every_grpc_message_is_released_and_no_string_is_kept(
        held_gateway: tuple[HeldGateway, Bystander], triton: LocalTriton,
        messages: list[tuple[bytes, bytes | None]], end: bool) -> None:
    gateway, bystander = held_gateway
    start, before_triton = gateway.state(), settled_triton_requests(triton, still_s=0.02)
    started = time.monotonic()
    attacker = Attacker(gateway.grpc_port, timeout=ANSWER_BOUND_S)
    streams = [2 * index + 1 for index in range(len(messages))]
    for stream, (message, encoding) in zip(streams, messages, strict=True):
        extra = [(b"grpc-encoding", encoding)] if encoding is not None else []
        data = b"".join(frame(DATA, 0, stream, message[i:i + 16384]) for i in range(0, len(message), 16384))
        attacker.send(attacker.headers(stream, request_headers(extra=extra)) + data
                      + (frame(DATA, END_STREAM, stream) if end else b""))
    if end:
        statuses = attacker.statuses(*streams, until=ANSWER_BOUND_S)
        answered = attacker.closed or None not in statuses.values()
        assert answered, f"unanswered streams: {statuses}"
        completed = sum(1 for status in statuses.values() if status is not None)
    else:
        time.sleep(0.1)  # the client leaves with its streams open: what they held must be let go
        completed = 0  # a unary call goes upstream only once its stream has ended
    took = time.monotonic() - started
    attacker.close()
    _check_after(gateway, bystander, triton, start, before_triton, completed, took, "grpc")
