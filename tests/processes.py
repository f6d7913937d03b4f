"""The process tree, read from /proc: what a test or an interrupted run started, and what is left."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks after boot) of a process, None when it is gone."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def state(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...), None when it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[0]


def started_at(pid: int) -> int | None:
    """When the process started: with its pid, who it is (pids are reused within minutes here)."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def alive(pid: int, started: int | None = None) -> bool:
    """Running (a zombie has ended; its parent just has not reaped it yet), and when ``started``
    is given, the same process that started then, not another that got its pid since."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (started is None or stat[2] == started)


def children(pid: int) -> list[int]:
    return sorted(int(entry.name) for entry in Path("/proc").iterdir()
                  if entry.name.isdigit() and (stat := _stat(entry.name)) and stat[0] != "Z" and stat[1] == pid)


def descendants(pid: int) -> set[int]:
    parents = {int(entry.name): stat[1] for entry in Path("/proc").iterdir()
               if entry.name.isdigit() and (stat := _stat(entry.name)) and stat[0] != "Z"}
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def command_lines(pids: set[int], width: int = 100) -> list[str]:
    """``pid command`` of each one still there (its first ``width`` characters), for a failure message."""
    out = []
    for pid in sorted(pids):
        try:
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        out.append(f"{pid} {command[:width].decode(errors='replace')}")
    return out


def stub_regions(server: int) -> set[str]:
    """The /dev/shm regions of a tritonserver's Python-backend stubs (each stub's third argument)."""
    regions = set()
    for stub in children(server):
        try:
            args = (Path("/proc") / str(stub) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(args) > 2 and args[0].endswith(b"triton_python_backend_stub"):
            regions.add(args[2].decode())
    return regions
