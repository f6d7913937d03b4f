from __future__ import annotations

import asyncio
import io
import json
import threading

from gateway.telemetry.access_log import AccessLog


def test_lines_are_valid_json_even_for_hostile_model_names() -> None:
    buffer = io.StringIO()
    log = AccessLog(buffer)
    log('q"c\\\n', "2", "weighted", "http", 200, 0.0012345)
    log("qc", None, "default", "grpc", "OK", 0.5)
    log.flush()
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert lines[0]["model"] == 'q"c\\\n' and lines[0]["latency_ms"] == 1.234 and lines[0]["status"] == 200
    assert lines[1] == {**lines[1], "version": "", "status": "OK", "protocol": "grpc"}


def test_a_full_buffer_drops_and_counts_instead_of_growing() -> None:
    buffer = io.StringIO()
    log = AccessLog(buffer, max_pending=3)
    for _ in range(5):
        log("qc", "2", "weighted", "http", 200, 0.001)
    assert log.dropped == 2
    log.flush()
    assert len(buffer.getvalue().splitlines()) == 3


def test_a_client_chosen_version_cannot_forge_a_line() -> None:
    """Issue 22: a version sent as ``1%22%0A{...}`` (decoded by the server) was written raw."""
    buffer = io.StringIO()
    log = AccessLog(buffer)
    forged = '1","route":"x"}\n{"ts":0,"type":"access","model":"admin","version":"9'
    log("qc", forged, "pinned", "http", 200, 0.001)
    log.flush()
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert len(lines) == 1 and lines[0]["version"] == forged and lines[0]["route"] == "pinned"


class _ThreadRecordingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writers: list[int] = []

    def write(self, text: str) -> int:
        self.writers.append(threading.get_ident())
        return super().write(text)


async def test_lines_are_written_off_the_event_loop() -> None:
    """A slow stdout must not stall the loop: the background flush writes from a worker thread."""
    stream = _ThreadRecordingStream()
    log = AccessLog(stream, flush_s=0.01)
    log.start()
    log("qc", "2", "weighted", "http", 200, 0.001)
    for _ in range(200):
        if stream.writers:
            break
        await asyncio.sleep(0.01)
    await log.stop()
    assert stream.writers and threading.get_ident() not in stream.writers[:1], "written on the loop's thread"
    assert json.loads(stream.getvalue().splitlines()[0])["version"] == "2"


def test_a_line_names_the_server_that_answered() -> None:
    """The fleet notes the server it chose on the exchange; the line says it ("" when none was chosen)."""
    buffer = io.StringIO()
    log = AccessLog(buffer)
    log("qc", "2", "weighted", "http", 200, 0.001, "10.0.0.2:8000")
    log("qc", "2", "weighted", "grpc", "UNAVAILABLE", 0.001)
    log("qc", "2", "weighted", "http", 200, 0.001, 'odd"\nname')  # escaped like everything else
    log.flush()
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [line["server"] for line in lines] == ["10.0.0.2:8000", "", 'odd"\nname']
