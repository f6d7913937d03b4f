"""One routed inference request on the HTTP port makes no avoidable per-request work (issue 37).

At c=1 the gateway's CPU per request was 2.8x nginx's, ~80 µs of Python against nginx's ~12. Some
of that was work no request needs: a new function object per request for each comprehension,
generator or lambda on the path (CPython 3.11 builds one for each), a timer handle armed and
cancelled per upstream exchange (``Deadlines`` keeps them under one), a getpid() system call
per request for the running loop (``asyncio.get_running_loop`` in 3.11), and an ``asyncio.Event``
per request, made and set in Python (the cycle's ``Arrival`` does the same with less); nor, for a request
that queues for an admission slot (every request does at 1,000 connections), a timer of its own for
its deadline or a loop lookup (the server's queue keeps its deadlines under one timer); nor uvicorn's two
regular-expression checks of the answer's header lines, ~1.7 µs an answer, for lines already found
writable (``http_output._WRITABLE``). Counted here with a
profile hook over requests served through the real front, proxy, pipeline, fleet and upstream
pool (a small fake upstream answers: only the gateway's own calls are counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway import http_output
from gateway.asgi import Dispatch
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.fleet.forward import FleetHttp
from gateway.http_front import protocol_for
from gateway.http_output import GatewayCycle
from gateway.pipeline import Pipeline
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.proxy.http import HttpProxy
from gateway.routing import WeylDraw
from gateway.settings import Settings
from gateway.telemetry.recorder import Recorder
from tests.unit.test_fleet_grpc import RecordingConnection
from tests.unit.test_fleet_http import Listener
from tests.unit.test_idle_connections import PeerTransport

REQUESTS = 50
WARM = 10
BODY = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
REQUEST = (b"POST /v2/models/qc/infer HTTP/1.1\r\nhost: gateway\r\ncontent-length: %d\r\n\r\n" % len(BODY)) + BODY
FUNCTION_PER_CALL = frozenset(["<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"])
# search: a regular expression; wait_for: a timer and two more futures and loop turns per wait;
# add_done_callback: a loop turn as the task ends (a request's task leaves the server's set as its handler ends)
AVOIDABLE = frozenset(["get_running_loop", "call_at", "call_later", "search", "wait_for", "add_done_callback"])


def ours(filename: str) -> bool:
    """The gateway's code and uvicorn's (not the fake upstream, asyncio's machinery or the test), but
    the loop's one sweep (``gateway.sweep``), whose timer ticks with time, not with requests."""
    return ("/gateway/" in filename or "/uvicorn/" in filename) and not filename.endswith("/gateway/sweep.py")


class Served(Dispatch):
    async def control(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("only inference here")


@pytest.fixture
async def gateway_front() -> AsyncIterator[tuple[Any, PeerTransport, Recorder]]:
    async with front(1) as (connections, recorder, _):
        yield connections[0][0], connections[0][1], recorder


@contextlib.asynccontextmanager
async def front(clients: int, max_inflight: int = 0, pool_size: int = 128) -> AsyncIterator[
        tuple[list[tuple[Any, PeerTransport]], Recorder, Fleet]]:
    """The gateway's HTTP front, proxy and one-server fleet, with ``clients`` connections to it."""
    http_output._WRITABLE.clear()  # what other tests in this process left there: the warm-up fills it
    listener = await Listener().start()
    fleet = Fleet("default", grpc_connect=RecordingConnection, max_inflight=max_inflight, pool_size=pool_size)
    server = fleet.add(ServerSpec(http=f"http://127.0.0.1:{listener.port}", grpc=f"127.0.0.1:{listener.port}"))
    server.up = server.in_service = True
    fleet.changed()
    book = PolicyBook()
    book.put("qc", PolicySpec.model_validate({"weights": {"2": 80, "3": 20}}), 1)
    recorder = Recorder()
    dispatch = Served()
    dispatch.proxy = HttpProxy(Pipeline(book, recorder), FleetHttp(fleet))
    config = Config(app=dispatch, lifespan="off", log_level="warning", ws="none", proxy_headers=False,
                    access_log=False, server_header=False)  # as gateway.server configures uvicorn
    config.load()
    protocol = protocol_for(Settings.load(None))
    connections = []
    for index in range(clients):
        connection = protocol(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
        transport = PeerTransport(1 + index)
        connection.connection_made(transport)
        connections.append((connection, transport))
    try:
        yield connections, recorder, fleet
    finally:
        for connection, _ in connections:
            connection.connection_lost(None)
        await fleet.aclose()
        await listener.stop()


async def serve(connection: Any, transport: PeerTransport, answered: int) -> None:
    connection.data_received(REQUEST)
    for _ in range(2000):
        if transport.written.count(b"HTTP/1.1 200 OK") > answered:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("no answer")


async def served_under(profile: Callable[[FrameType, str, Any], None], connection: Any,
                       transport: PeerTransport) -> None:
    """WARM requests (the upstream connection; each version's routing headers, made once), then
    REQUESTS more with ``profile`` as the profile hook."""
    for answered in range(WARM):
        await serve(connection, transport, answered)
    sys.setprofile(profile)
    try:
        for answered in range(WARM, WARM + REQUESTS):
            await serve(connection, transport, answered)
    finally:
        sys.setprofile(None)


def counter() -> tuple[Counter[str], Callable[[FrameType, str, Any], None]]:
    """What the profile hook finds of the avoidable work, by kind and caller."""
    seen: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            caller = frame.f_back
            if code.co_name in FUNCTION_PER_CALL and ours(code.co_filename):
                seen[f"{code.co_name} in {code.co_filename.rsplit('/', 2)[-2]}/{caller and caller.f_code.co_name}"] += 1
            elif code.co_name in AVOIDABLE and caller is not None and ours(caller.f_code.co_filename):
                seen[f"{code.co_name} from {caller.f_code.co_name}"] += 1  # asyncio's loop: Python methods
            elif code.co_filename.endswith("/asyncio/locks.py") and caller and ours(caller.f_code.co_filename):
                seen[f"asyncio.Event.{code.co_name} from {caller.f_code.co_name}"] += 1  # the cycle's is an Arrival
        elif event == "c_call" and getattr(arg, "__name__", "") in AVOIDABLE and ours(code.co_filename):
            seen[f"{arg.__name__} from {code.co_name}"] += 1

    return seen, profile


async def test_a_routed_request_builds_no_function_arms_no_timer_and_asks_for_no_loop(
        gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    connection, transport, recorder = gateway_front
    seen, profile = counter()
    await served_under(profile, connection, transport)
    assert transport.written.count(b"HTTP/1.1 200 OK") == WARM + REQUESTS
    routed = recorder.window("qc", "2", 60).requests + recorder.window("qc", "3", 60).requests
    assert routed == WARM + REQUESTS, "each one routed and recorded once"
    assert dict(seen) == {}, f"per-request work over {REQUESTS} requests: {dict(seen)}"
    assert not connection.tasks, "every request's task left the server's set as it ended"


# Python calls one routed request makes of these, each (the old code made more, each finding
# nothing to do: a second release of a slot the answer gave back, a wake with no waiter after the
# headers', a resume of reading that was not paused, a transport's is_closing through the
# coalescing one, a look at a content-length of digits, a receive() of a body already whole)
CALLS_PER_REQUEST = {"Admitted.release": 1, "Server.release": 1, "UpstreamResponse._wake": 1,
                     "UpstreamResponse._cancel_timer": 0, "FlowControl.resume_reading": 0, "_writable": 0,
                     "BatchedTransport.is_closing": 0,
                     # the body came with the head: handed over whole, no ASGI receive() (a coroutine, a
                     # message dict, a wait); uvicorn's on_message_complete inlined in ours
                     "GatewayCycle.receive": 0, "HttpToolsProtocol.on_message_complete": 0,
                     # the routed target with its version, written once per (target, version)
                     "_with_version": 0,
                     # a request naming none of the policy's headers is routed by the draw alone (no rule nor
                     # key to look for), a peer's IPv4 address is its client key as it is
                     "_by_rule": 0, "_by_key": 0, "HttpProxy._route": 0, "client_key": 0,
                     # the routing draw is a method call (calling an object through its class's __call__
                     # takes 3.11's slower way, slot_tp_call: ~1,000 instructions more)
                     "WeylDraw.next": 1, "WeylDraw.__call__": 0}


async def test_a_routed_request_makes_no_call_that_finds_nothing_to_do(
        gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    connection, transport, _ = gateway_front
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_qualname in CALLS_PER_REQUEST:
            calls[frame.f_code.co_qualname] += 1

    await served_under(profile, connection, transport)
    assert {name: calls[name] for name in CALLS_PER_REQUEST} == {
        name: count * REQUESTS for name, count in CALLS_PER_REQUEST.items()}, f"over {REQUESTS} requests"


class CountedQueue(deque[Any]):
    """A server's queue of waiters that counts the requests that joined it."""

    joined = 0

    def append(self, waiter: Any) -> None:
        self.joined += 1
        super().append(waiter)


async def bursts_under(profile: Callable[[FrameType, str, Any], None], clients: int, rounds: int,
                       max_inflight: int, pool_size: int = 128) -> int:
    """``rounds`` bursts of one request on each of ``clients`` connections at once (two more first,
    unprofiled: the upstream connection, the routing headers, the queue's timer), with ``profile``
    as the profile hook; every one answered and recorded. How many of the profiled ones queued."""
    async with front(clients, max_inflight=max_inflight, pool_size=pool_size) as (connections, recorder, fleet):
        server = fleet.single
        assert server is not None
        async def burst(done: int) -> None:
            for connection, _ in connections:
                connection.data_received(REQUEST)
            for _ in range(2000):
                if all(transport.written.count(b"HTTP/1.1 200 OK") > done for _, transport in connections):
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("not all answered")

        for done in range(2):
            await burst(done)
        queue = server.waiters = CountedQueue()
        if not max_inflight:  # no slots: the requests past the pool's connections wait in its queue
            queue = server.http._waiters = CountedQueue()
        sys.setprofile(profile)
        try:
            for done in range(2, 2 + rounds):
                await burst(done)
        finally:
            sys.setprofile(None)
        assert server.inflight == 0 and not server.waiters and server.http.open_connections <= pool_size
        routed = recorder.window("qc", "2", 60).requests + recorder.window("qc", "3", 60).requests
        assert routed == (2 + rounds) * clients
    return queue.joined


async def test_a_queued_request_arms_no_timer_and_asks_for_no_loop() -> None:
    """At 1,000 connections every request waits for an admission slot (``max_inflight_per_server``):
    that wait costs a future and a loop turn, not a timer armed and cancelled per request (its
    deadline shares the queue's one timer) nor a getpid() for the running loop. The old code: a
    ``call_later`` from ``wait_for_slot`` and two ``get_running_loop`` per queued request."""
    clients, rounds = 5, 8
    seen, profile = counter()
    queued = await bursts_under(profile, clients, rounds, max_inflight=1)
    assert queued >= rounds * (clients - 1) // 2, f"the requests queued for the one slot: {queued}"
    assert dict(seen) == {}, f"per-request work over {rounds * clients} requests, {queued} queued: {dict(seen)}"


async def test_a_queued_request_runs_no_coroutine_of_its_own_and_three_calls() -> None:
    """A queued request's wake resumes its task's whole chain of coroutine frames once more (the
    front's, the proxy's, the pipeline's, the fleet's): a coroutine between the request and its
    waiter is one more frame made and resumed per queued request, at 1,000 connections per request.
    The HTTP fleet awaits the queue's waiter in its request's own frame: besides the one more resume
    of the frames any request runs, a queued request makes three calls (the server's loop, its place
    in the queue, its deadline kept). The old code ran three coroutines of its own (``FleetHttp._admit``,
    ``Fleet.admit``, ``Server.wait_for_slot``) and seven calls."""
    clients, rounds = 5, 8

    def counting(calls: Counter[str]) -> Callable[[FrameType, str, Any], None]:
        def profile(frame: FrameType, event: str, arg: Any) -> None:
            code = frame.f_code  # not the recorder's: its windows roll with time, not with requests
            if event == "call" and ours(code.co_filename) and "/gateway/telemetry/" not in code.co_filename:
                kind = "coroutine" if code.co_flags & inspect.CO_COROUTINE else "call"
                calls[f"{kind} {code.co_qualname}"] += 1
        return profile

    served: Counter[str] = Counter()
    await bursts_under(counting(served), clients, rounds, max_inflight=0)
    queued: Counter[str] = Counter()
    waited = await bursts_under(counting(queued), clients, rounds, max_inflight=1)
    assert waited >= rounds * (clients - 1) // 2, f"the requests queued for the one slot: {waited}"
    coroutines = {name for name in queued if name.startswith("coroutine ")}
    assert coroutines - set(served) == set(), "coroutines only a queued request runs"
    more = {name: queued[name] - served[name] for name in queued if name.startswith("call ")
            and queued[name] != served[name]}
    assert more == {"call Server.running_loop": waited, "call Server.queue": waited,
                    "call WaiterDeadlines.keep": waited}, f"calls besides a served request's, {waited} queued"


def test_a_header_line_is_checked_once_and_a_line_uvicorn_refuses_is_never_kept() -> None:
    """What spares the checks keeps only lines that passed them: a line with a control character or
    a name with a separator is refused every time (the answer then takes uvicorn's way, a JSON 500),
    and the kept lines are bounded."""
    http_output._WRITABLE.clear()
    assert http_output._writable(b"content-type", b"application/json")
    assert (b"content-type", b"application/json") in http_output._WRITABLE
    assert http_output._writable(b"content-length", b"1234")
    refused = ((b"x-version", b"1\n2"), (b"x-version", b"1\x002"), (b"bad name", b"v"), (b"content-length", b"1\r"))
    for name, value in refused:
        assert not http_output._writable(name, value) and not http_output._writable(name, value), (name, value)
        assert (name, value) not in http_output._WRITABLE
    for index in range(http_output.WRITABLE_KEPT + 10):
        assert http_output._writable(b"x-n", b"%d-" % index)
    assert len(http_output._WRITABLE) <= http_output.WRITABLE_KEPT


async def test_a_request_waiting_for_a_pool_connection_arms_no_timer_and_makes_one_future() -> None:
    """Past the pool's connections (``pool_size``; no admission slots: ``max_inflight_per_server``
    0, or above it) a request waits for a connection in order: its own future, woken by the
    connection handed over, its deadline under the pool's one timer for waiters. The old code:
    ``asyncio.wait_for`` per waiting request (a timer armed and cancelled, two more futures)."""
    clients, rounds = 5, 8
    seen, counting = counter()
    futures = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal futures
        counting(frame, event, arg)
        if event == "call" and frame.f_code.co_name == "create_future":  # asyncio's loop: a Python method
            futures += frame.f_back is not None and ours(frame.f_back.f_code.co_filename)
        elif event == "c_call" and getattr(arg, "__name__", "") == "create_future":
            futures += ours(frame.f_code.co_filename)

    waited = await bursts_under(profile, clients, rounds, max_inflight=0, pool_size=1)
    assert waited >= rounds * (clients - 1) // 2, f"the requests that waited for the one connection: {waited}"
    assert dict(seen) == {}, f"per-request work over {rounds * clients} requests, {waited} waited: {dict(seen)}"
    served = rounds * clients  # a future per request for its answer (the exchange's waiter), one per wait
    assert futures == served + waited, f"{futures} futures for {served} requests, {waited} of them waiting"


class _ClassReads:
    """Counts, on an instance, the reads of a class's plain data attribute (not a method, a slot or
    a property) through the instance: Python 3.11 specializes a read of an instance's own attribute
    or slot into a direct load, and looks a class's up in full (~150 CPU instructions) each time."""

    counts: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if not name.startswith("__") and name not in object.__getattribute__(self, "__dict__"):
            held = next((vars(cls)[name] for cls in type(self).__mro__ if name in vars(cls)), None)
            if held is not None and not callable(held) and not hasattr(type(held), "__get__"):  # (a slot's, a property)
                _ClassReads.counts[f"{type(self).__mro__[2].__name__}.{name}"] += 1
        return value


async def test_a_request_reads_its_state_and_bounds_from_its_objects_not_their_classes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What each request reads of its connection (the head bounds, the sweep's ticks, whether it
    is ending) and of its cycle (uvicorn's state: disconnected, answered, ...) is the object's own:
    the old code kept them as class attributes, ~10 full look-ups per request."""
    import gateway.http_front as http_front

    class CountedCycle(_ClassReads, GatewayCycle):
        pass

    monkeypatch.setattr(http_front, "GatewayCycle", CountedCycle)
    real_protocol_for = http_front.protocol_for

    def counted_protocol_for(settings: Settings) -> type[Any]:
        return type("CountedProtocol", (_ClassReads, real_protocol_for(settings)), {})

    monkeypatch.setattr(sys.modules[__name__], "protocol_for", counted_protocol_for)
    async with front(1) as (connections, _, _):
        connection, transport = connections[0]
        for answered in range(WARM):
            await serve(connection, transport, answered)
        _ClassReads.counts.clear()
        for answered in range(WARM, WARM + REQUESTS):
            await serve(connection, transport, answered)
        read = dict(_ClassReads.counts)  # (not the connection's end: once per connection)
    assert read == {}, f"class attributes read over {REQUESTS} requests"
    draw = type("CountedDraw", (_ClassReads, WeylDraw), {})()  # each request's routing draw
    _ClassReads.counts.clear()
    for _ in range(REQUESTS):
        draw.next()
    assert dict(_ClassReads.counts) == {}, f"class attributes read over {REQUESTS} draws"


def test_the_url_is_never_searched_with_in(gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    """``b"?" in url`` first tries the needle as an integer (bytes' ``in`` takes one), building
    and dropping a TypeError with its formatted message: ~1,500 CPU instructions, twice a request
    for the query and fragment checks. ``find`` takes bytes at once."""
    searched: list[bytes] = []

    class Url(bytes):
        def __contains__(self, item: object) -> bool:
            searched.append(item)  # type: ignore[arg-type]
            return super().__contains__(item)  # type: ignore[operator]

    connection, _, _ = gateway_front
    connection.on_message_begin()
    connection.url = Url(b"/v2/models/qc/infer")
    connection.on_header(b"content-length", b"0")
    connection.on_headers_complete()
    assert connection.scope["path"] == "/v2/models/qc/infer" and connection.scope["query_string"] == b""
    assert searched == []
    connection.task.cancel()


async def test_a_request_task_gets_a_name_made_once(gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    """asyncio names a task "Task-<n>" unless told, a string formatted per task as Python 3.11
    makes it: each request's task shares one name instead."""
    connection, transport, _ = gateway_front
    names = set()
    for answered in range(3):
        connection.data_received(REQUEST)
        names.add(connection.task.get_name())
        await serve_rest(transport, answered)
    assert len(names) == 1, names


async def serve_rest(transport: PeerTransport, answered: int) -> None:
    for _ in range(2000):
        if transport.written.count(b"HTTP/1.1 200 OK") > answered:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("no answer")


class _Reads:
    """Stands for an object and counts what is read of it."""

    def __init__(self, inner: object) -> None:
        self.inner, self.reads = inner, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        self.reads[name] += 1
        return getattr(self.inner, name)


async def test_a_request_makes_its_scope_s_asgi_dict_and_status_label_once_and_reads_no_policy_spec() -> None:
    """Per-request objects that need not be: the scope's ``asgi`` dict (one per connection, read only),
    the recorder's status label (``str(200)``, one per status), and a read of the policy's pydantic
    spec for the versions of its split (the compiled policy holds them: a spec's attribute is a full
    look-up). The old code made a dict and a string per request and read ``spec.weights`` in each."""
    async with front(1) as (connections, recorder, _):
        connection, transport = connections[0]
        for answered in range(WARM):
            await serve(connection, transport, answered)
        book = getattr(connection._inference, "__self__", connection._inference).pipeline.book
        policy = book.get("qc")
        spec = _Reads(policy.spec)
        object.__setattr__(policy, "spec", spec)  # frozen: the test swaps it in place
        asgi, labels = [], []
        real_record = recorder.record

        def record(*args: Any) -> None:
            labels.append(args[6])
            real_record(*args)

        recorder.record = record  # type: ignore[method-assign,assignment]
        for answered in range(WARM, WARM + REQUESTS):
            await serve(connection, transport, answered)
            asgi.append(connection.scope["asgi"])
    assert labels == ["200"] * REQUESTS
    made = {"asgi dicts": len({id(made) for made in asgi}), "status labels": len({id(label) for label in labels}),
            "reads of the policy's spec": sum(spec.reads.values())}
    assert made == {"asgi dicts": 1, "status labels": 1, "reads of the policy's spec": 0}, f"over {REQUESTS} requests"


async def test_an_answer_s_header_lines_are_written_out_once(
        gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    """The answer's head is joined from its lines as written the first time (a header line in lower
    case, ``: `` and its end): the old code lower-cased each name and built four pieces per line,
    in every answer."""
    connection, transport, _ = gateway_front
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and frame.f_code.co_qualname == "GatewayCycle.answer":
            calls[getattr(arg, "__name__", "?")] += 1

    await served_under(profile, connection, transport)
    assert transport.written.count(b"\r\ncontent-type: application/json\r\n") == WARM + REQUESTS
    assert calls["lower"] == 0 and calls["join"] == REQUESTS, f"over {REQUESTS} requests: {dict(calls)}"


def test_the_front_calls_its_data_plane_handler_as_a_bound_method(
        gateway_front: tuple[Any, PeerTransport, Recorder]) -> None:
    """Calling an object through its class's ``__call__`` takes Python 3.11's slower way (a look-up
    and an argument tuple, ~1,000 CPU instructions more per call): the front holds the proxy's
    ``__call__`` as a bound method, called once per request."""
    connection, _, _ = gateway_front
    assert inspect.ismethod(connection._inference) and isinstance(connection._inference.__self__, HttpProxy)
