"""Which upstream a shadow copy goes to: its own fleet's, never the default fleet in its place.

The upstreams here record what they are asked and answer nothing real: what is tested is the
choice of upstream (tests/integration/test_fleet_shadow.py sends copies to two real Tritons).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from gateway.errors import UpstreamUnavailable
from gateway.grpc.router import GrpcInfer
from gateway.grpc.status import StatusCode
from gateway.grpc.wire import RouteFields
from gateway.pipeline import Target
from gateway.proxy.shadow import Mirror, ShadowMirror
from gateway.telemetry.recorder import Recorder
from gateway.upstream import Body, HttpUpstream, UpstreamResponse


class RecordingHttp(HttpUpstream):
    def __init__(self) -> None:  # no pool: nothing is sent
        self.asked: list[tuple[bytes, str | None]] = []

    async def request(self, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                      body: Body | AsyncIterator[bytes] = b"", **kwargs: Any) -> UpstreamResponse:
        self.asked.append((target, kwargs.get("version")))
        raise UpstreamUnavailable("recorded, not sent")


class RecordingGrpc:
    def __init__(self) -> None:
        self.asked: list[str | None] = []

    async def unary(self, path: str, message: bytes, metadata: Any = (), timeout: float | None = None,
                    **kwargs: Any) -> tuple[int, str, bytes]:
        self.asked.append(kwargs.get("version"))
        return StatusCode.UNAVAILABLE, "recorded", b""


def mirror(fleet: str | None) -> Mirror:
    return Mirror("qc", "3", b"POST", b"/v2/models/qc/versions/3/infer", [], b"{}", 200, b"{}", [], fleet)


async def test_an_http_copy_goes_to_its_fleet_and_is_counted_under_the_policys_name() -> None:
    default, green = RecordingHttp(), RecordingHttp()
    recorder = Recorder()
    shadow = ShadowMirror(default, recorder, fleets={"green": green})
    await shadow._send(mirror("green"))
    await shadow._send(mirror(None))
    assert green.asked == [(b"/v2/models/qc/versions/3/infer", "3")] and len(default.asked) == 1
    assert recorder.shadow_stats("qc", "green:3").requests == 1 and recorder.shadow_stats("qc", "3").requests == 1


async def test_a_copy_for_a_fleet_this_gateway_lacks_is_an_error_and_goes_nowhere_else() -> None:
    default = RecordingHttp()
    recorder = Recorder()
    await ShadowMirror(default, recorder)._send(mirror("red"))
    assert default.asked == [] and recorder.shadow_stats("qc", "red:3").errors == 1

    grpc_default, grpc_green = RecordingGrpc(), RecordingGrpc()
    infer = GrpcInfer(grpc_default, "ModelInfer", b"", RouteFields("qc", ""), (), None,  # type: ignore[arg-type]
                      {"green": grpc_green})  # type: ignore[dict-item]
    shadow = ShadowMirror(default, recorder)
    await shadow._send(infer.mirror("qc", None, Target("3", "green")))  # type: ignore[arg-type]
    await shadow._send(infer.mirror("qc", None, Target("3", "red")))  # type: ignore[arg-type]
    assert grpc_green.asked == ["3"] and grpc_default.asked == []
    assert recorder.shadow_stats("qc", "green:3").requests == 1
    assert recorder.shadow_stats("qc", "red:3").errors == 2
