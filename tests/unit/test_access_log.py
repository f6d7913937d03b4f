from __future__ import annotations

import io
import json

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
