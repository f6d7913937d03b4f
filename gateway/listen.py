"""Binding the gateway's ports before anything starts: a port that cannot be bound is one
line naming it and its setting (``gateway serve`` prints it and exits 1)."""

from __future__ import annotations

import errno
import socket


class PortTaken(Exception):
    """A port the gateway is to listen on cannot be bound (taken, or not allowed)."""


def bind(host: str, port: int, setting: str, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket, not yet listening (uvicorn / asyncio call listen() when ready)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise PortTaken(f"cannot listen on {host}:{port} ({setting}, GATEWAY_{setting.upper()}): {why}") from None
    sock.setblocking(False)
    return sock
