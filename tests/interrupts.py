"""An interrupted run leaves no server behind.

Ctrl-C raises KeyboardInterrupt in the controller and in every worker (one process group), and
pytest then tears the fixtures down: every Triton, Redis, Prometheus and gateway they started is
stopped. SIGTERM (a time limit: ``timeout``, CI) killed the processes outright, and their
servers outlived them (a `make test` stopped by `timeout` left three Tritons and their stubs
running for over an hour). Here SIGTERM does what Ctrl-C does; the controller also passes it to
its workers, which may not be in its process group, and waits for them to finish tearing down.

Behind that: each server the suite starts gets SIGTERM when the process that started it dies,
even by SIGKILL (``dies_with_parent``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests.processes import children

TEARDOWN_S = 90  # how long the controller waits for its workers to stop what they started (xdist: 10 s)
_controller = False  # this process hands tests to xdist workers (its only children)


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # once: a second one must not cut the teardown short
    if _controller:
        for pid in children(os.getpid()):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    raise KeyboardInterrupt("SIGTERM")


def pytest_configure(config: pytest.Config) -> None:
    global _controller
    _controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    signal.signal(signal.SIGTERM, _on_sigterm)
    if _controller:
        from xdist.workermanage import NodeManager

        NodeManager.EXIT_TIMEOUT = TEARDOWN_S  # then it kills them: a Triton stops in up to 15 s
