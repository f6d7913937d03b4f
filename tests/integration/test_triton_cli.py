"""``gateway triton`` owns the server it starts (issue 33, item 9): SIGTERM or SIGINT stops the
tritonserver and its Python-backend stubs, and a port another server already holds is an error,
not "ready" (a second start once reported ready against a server left running by the first, and a
bad-canary rehearsal ran against that old server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.devtools import local_triton
from gateway.devtools.local_triton import LocalTriton, TritonUnavailable, ended_by_itself, free_port_block, listens_on
from tests.processes import alive, children, started_at
from tests.support import wait_for

pytestmark = pytest.mark.triton


def gateway_triton(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gateway", "triton", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_tritonserver_it_started_and_its_stubs(signum: int) -> None:
    cli = gateway_triton("--http-port", str(free_port_block(3)), "--model", "qc")
    server, stubs, since = 0, [], {}
    try:
        assert cli.stdout is not None
        for line in cli.stdout:
            if line.startswith("ready:"):
                break
        else:
            raise AssertionError(f"gateway triton ended with {cli.wait()} before it was ready")
        [server] = children(cli.pid)
        stubs = children(server)
        since = {pid: started_at(pid) for pid in [server, *stubs]}  # pids are reused within minutes here
        assert len(stubs) == 3, "qc's three versions, one Python-backend stub each"
        cli.send_signal(signum)
        assert cli.wait(60) == 0
        wait_for(lambda: not any(alive(pid, at) for pid, at in since.items()), 30, what="the server and stubs to end")
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait(10)
        for pid, at in since.items():
            if alive(pid, at):
                os.kill(pid, signal.SIGKILL)
        assert cli.stdout is not None
        cli.stdout.close()


def test_a_port_another_server_holds_is_an_error_not_ready(triton: LocalTriton) -> None:
    """The session Triton holds the ports: the second start says so and exits, and that Triton
    serves on untouched."""
    cli = gateway_triton("--http-port", str(triton.http_port), "--model", "qc")
    try:
        output, _ = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait(10)
    assert cli.returncode == 1, output
    assert "\nready:" not in f"\n{output}", output
    assert f"port {triton.http_port}" in output and "already in use" in output, output
    assert triton.is_ready()


def test_readiness_is_that_of_the_process_started(triton: LocalTriton) -> None:
    """What the readiness check asks besides "ready?": is the listener on the port this process's?"""
    assert triton.pid is not None
    assert listens_on(triton.pid, triton.http_port) is True and listens_on(triton.pid, triton.grpc_port) is True
    assert listens_on(os.getpid(), triton.http_port) is False
    assert listens_on(triton.pid, free_port_block(1)) is False


def test_a_server_that_exits_at_start_says_why_from_its_log(tmp_path: Path) -> None:
    """The error carries the log's last lines: the failed server's working directory, its log
    with it, is removed before anyone reads the error."""
    server = LocalTriton.on_free_ports(repository=tmp_path / "no-such-repository", models=("qc",))
    with pytest.raises(TritonUnavailable, match="tritonserver exited with") as raised:
        server.start()
    assert "\n  | " in str(raised.value) and "no-such-repository" in str(raised.value), str(raised.value)
    assert server.pid is None and not server.log_path.exists()


def test_a_server_that_died_by_itself_is_named_with_its_log_until_stopped() -> None:
    """What a failed test's summary reads for a Triton that crashed under it (ci-19: a fleet test's
    second Triton died during a reload, and its log went with its fixture before anyone read it)."""
    server = LocalTriton.on_free_ports(models=("qc",)).start()
    try:
        assert server not in ended_by_itself()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        wait_for(lambda: server.returncode is not None, 10, what="the server to end")
        assert ended_by_itself() == [server] and server.log_path.exists()
    finally:
        server.stop()
    assert ended_by_itself() == []


class AbortsFirst(LocalTriton):
    """A server whose first start aborts at once (SIGABRT), as the wheel's tritonserver did twice
    in ~65 full runs (an EBADF in its own gRPC poller within 50 ms; not to be made on demand, so
    this stand-in's first process is a Python one that aborts itself), then starts for real."""

    commands = 0

    def command(self, backend_dir: Path) -> list[str]:
        self.commands += 1
        if self.commands == 1:
            return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"]
        return super().command(backend_dir)


def test_a_server_killed_by_a_signal_while_starting_is_started_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    retried: list[str] = []
    monkeypatch.setattr(local_triton, "STARTS_RETRIED", retried)
    server = AbortsFirst.on_free_ports(models=("qc",))
    with server:
        assert server.commands == 2 and server.is_ready()
    assert len(retried) == 1 and "tritonserver exited with -6" in retried[0], retried


def test_a_server_that_exits_with_a_status_while_starting_is_not_started_again(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad flag or a model that fails to load exits with a status: a second start would fail the
    same way, and take as long."""
    retried: list[str] = []
    monkeypatch.setattr(local_triton, "STARTS_RETRIED", retried)
    server = AbortsFirst.on_free_ports(repository=tmp_path / "no-such-repository", models=("qc",))
    server.commands = 1  # no abort: straight to the real server, which exits with 1
    with pytest.raises(TritonUnavailable, match="tritonserver exited with 1"):
        server.start()
    assert server.commands == 2 and retried == []
