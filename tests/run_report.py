"""What a run prints at its end, gathered from every parallel worker: its wall time, the tests
over 30 s whose docstring does not say why, the modules that left the session Triton changed or
descriptors open, and the abuse invariants' worst values.

Under pytest-xdist the tests run in worker processes and only the controller prints: each worker
ships its findings in ``workeroutput`` when it ends, and the controller merges them. In a run
without workers the same findings are printed from the one process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.devtools import local_triton
from tests import schedule

SLOW_S = 30.0  # a test slower than this says why in its docstring (issue 31)
BUDGET_S = 600.0  # `make test` on the 2-core machine

# section title -> [(sort key, line)]; filled in the process that ran the tests
_findings: dict[str, list[tuple[float, str]]] = defaultdict(list)
_busy_s: dict[str, float] = defaultdict(float)  # worker -> summed test time
_started = time.monotonic()

LEFT_CHANGED = "modules that left the session Triton changed or dead (put back)"
TRITON_DIED = "session Tritons that died: the end of their logs"
SIGNALS_AT_START = ("test processes that started with SIGINT ignored, or SIGINT or SIGTERM blocked, inherited from "
                    "whoever started the run (put back at their start)")
SIGNALS_CHANGED = "tests that left SIGINT ignored, or SIGINT or SIGTERM blocked, in their process (put back)"
TRITON_AT_FAILURE = "the Tritons a failed test's process ran when it failed: their stubs and the end of their logs"
DESCRIPTORS = "modules that left descriptors open (5 or more; the 15 worst)"
SLOW_UNSAID = f"tests over {SLOW_S:.0f} s whose docstring does not say why"
UNSCHEDULED_S = 20.0
UNSCHEDULED = f"tests over {UNSCHEDULED_S:.0f} s that tests/schedule.py does not know (add them to EXPECTED_S)"
OPEN_NOW = "descriptors open at the end, per test process"
STARTS_RETRIED = "Tritons killed by a signal while starting, and started again (local_triton.STARTS_RETRIED)"


def note(section: str, line: str, key: float = 0.0) -> None:
    """A line for ``section`` of the summary; lines are printed by descending ``key``."""
    _findings[section].append((key, line))


def _worker_id(config: pytest.Config) -> str:
    return str(getattr(config, "workerinput", {}).get("workerid", "main"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    if took > SLOW_S and not (getattr(getattr(item, "obj", None), "__doc__", None) or "").strip():
        note(SLOW_UNSAID, f"{took:5.0f} s  {item.nodeid}", took)
    if took > UNSCHEDULED_S and schedule.expected_s(item.nodeid) < UNSCHEDULED_S / 2:
        note(UNSCHEDULED, f"{took:5.0f} s  {item.nodeid}", took)


def _put_back_signals() -> list[str]:
    """SIGINT's handler and SIGINT/SIGTERM's mask as a shell gives them; what was not, named."""
    changed = sorted(signal.Signals(s).name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])
                     if s in (signal.SIGINT, signal.SIGTERM))
    if changed:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
        changed = [f"{name} blocked" for name in changed]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        changed.append("SIGINT ignored")
    return changed


def pytest_sessionstart(session: pytest.Session) -> None:
    """A run started as a background job of a shell without job control (`make test &`, as a CI
    harness may) has SIGINT ignored, and every test process inherits it: the first test of each
    worker was then named below for what it had not done (the judge's four longest, scheduled
    first, in every fresh-clone run). The processes that run tests start as from an interactive
    shell instead (a test's Ctrl-C to a server it started must reach it); xdist's controller,
    which runs none, keeps what it was given."""
    controller = getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput")
    if not controller and threading.current_thread() is threading.main_thread() and (changed := _put_back_signals()):
        note(SIGNALS_AT_START, f"{_worker_id(session.config)}: {', '.join(changed)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A process started after a test that left SIGINT ignored or blocked inherits it: the
    interrupted-run test's nested run then never saw its Ctrl-C (its tests slept on, three full
    runs in a row). Whoever did it is named, and the signals are put back."""
    yield
    if threading.current_thread() is threading.main_thread() and (changed := _put_back_signals()):
        note(SIGNALS_CHANGED, f"{item.nodeid}: {', '.join(changed)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when == "call":
        for line in _tritons_now():
            note(TRITON_AT_FAILURE, f"{item.nodeid}: {line}")


def _tritons_now(lines: int = 12) -> list[str]:
    """What a stalled Triton looked like (two loads once went unanswered for 300 s under load):
    each tritonserver this process started, its stubs' states and its log's last lines; and
    each that exited by itself, with its log's last lines (a second Triton of a fleet test died
    during a reload under load in ci-19, and its log went with its fixture)."""
    from gateway.devtools.local_triton import ended_by_itself, log_tail
    from tests.processes import children, descendants, state

    # a crashed server's log ends in its stack (~27 lines): what it said before that is the cause
    found = [f"tritonserver {server.pid} exited by itself with {server.returncode}:"
             + "".join(f"\n    {line}" for line in (log_tail(server.log_path, 5 * lines) or ["(no log)"]))
             for server in ended_by_itself()]
    for pid in sorted(descendants(os.getpid())):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args[0].endswith(b"/tritonserver"):
            continue
        states = [letter for stub in children(pid) if (letter := state(stub))]
        backends = next((a.split(b"=", 1)[1] for a in args if a.startswith(b"--backend-directory=")), b"")
        tail = log_tail(os.path.join(os.path.dirname(backends.decode()), "tritonserver.log"), lines) or ["(no log)"]
        found.append(f"tritonserver {pid}, stubs {' '.join(states) or 'none'}:\n" + "\n".join(f"    {t}" for t in tail))
    return found


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a worker: hand the findings to the controller (which runs no test itself)."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    note(OPEN_NOW, f"{_worker_id(session.config)}: {len(os.listdir('/proc/self/fd'))}")
    for start in local_triton.STARTS_RETRIED:
        note(STARTS_RETRIED, f"{_worker_id(session.config)}: {start}")
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        from tests.abuse import worst

        output["run_report"] = json.dumps({"findings": _findings, "worst": worst.worst()})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the controller: merge what a worker found."""
    shipped = getattr(node, "workeroutput", {}).get("run_report")
    if not shipped:
        return
    from tests.abuse import worst

    data = json.loads(shipped)
    for section, lines in data["findings"].items():
        _findings[section].extend((key, line) for key, line in lines)
    for name, (value, detail) in data["worst"].items():
        worst.merge(name, value, detail)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the controller
    worker = str(getattr(getattr(node, "gateway", None), "id", "main"))
    _busy_s[worker] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.abuse import worst

    limits = {DESCRIPTORS: 15}
    for section in (LEFT_CHANGED, SIGNALS_AT_START, SIGNALS_CHANGED, TRITON_DIED, STARTS_RETRIED, TRITON_AT_FAILURE,
                    DESCRIPTORS, SLOW_UNSAID, UNSCHEDULED, OPEN_NOW):
        lines = sorted(_findings.get(section, []), key=lambda entry: -entry[0])[:limits.get(section)]
        if lines:
            terminalreporter.section(section)
            for _, line in lines:
                terminalreporter.write_line(line)
    worst_lines = worst.summary_lines()
    if worst_lines:
        terminalreporter.section("worst values of the abuse invariants")
        for line in worst_lines:
            terminalreporter.write_line(line)
    wall = time.monotonic() - _started
    terminalreporter.section("wall time")
    busy = ", ".join(f"{worker} {seconds / 60:.1f} min" for worker, seconds in sorted(_busy_s.items()))
    terminalreporter.write_line(f"{wall / 60:.1f} min wall ({wall:.0f} s; make test's budget is "
                                f"{BUDGET_S / 60:.0f} min on 2 cores); tests busy: {busy or 'none'}")
