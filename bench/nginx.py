"""nginx as the reference proxy: the same load through nginx, so the gateway has a yardstick.

Direct-to-Triton says what the gateway costs; nginx says whether that cost is reasonable for a
proxy at all. nginx runs with one worker (the gateway is one process on one event loop), HTTP/1.1
keep-alive to Triton's HTTP port and `grpc_pass` with keep-alive to its gRPC port (without it
nginx opened a connection per call), no access log: the cheapest
configuration a team would put in front of Triton if it only needed to forward.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

CONFIG = """
daemon off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections {worker_connections}; }}
http {{
    access_log off;
    keepalive_requests 1000000;  # the default 1000 closes a client's HTTP/2 connection after 1000 calls: h2load
                                 # does not reconnect, and 2,000 of 10,000 calls were counted as failed
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    client_max_body_size 64m;
    upstream triton_http {{ server {http_upstream}; keepalive 64; }}
    upstream triton_grpc {{ server {grpc_upstream}; keepalive 64; }}  # without it: a connection per call
    server {{
        listen 127.0.0.1:{http_port};
        location / {{
            proxy_pass http://triton_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{grpc_port} http2;
        location / {{ grpc_pass grpc://triton_grpc; }}
    }}
}}
"""


def available() -> bool:
    return shutil.which("nginx") is not None


class Nginx:
    """A throwaway nginx in front of one Triton, on the given loopback ports."""

    def __init__(self, workdir: Path, http_upstream: str, grpc_upstream: str, http_port: int, grpc_port: int,
                 worker_connections: int = 1024) -> None:
        self.workdir = workdir / "nginx"
        self.http_port, self.grpc_port = http_port, grpc_port
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / "nginx.conf"
        self.config.write_text(CONFIG.format(workdir=self.workdir, http_upstream=http_upstream,
                                             grpc_upstream=grpc_upstream, http_port=http_port, grpc_port=grpc_port,
                                             worker_connections=worker_connections,
                                             nofile=min(2 * worker_connections + 64,
                                                        resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Nginx:
        nginx = shutil.which("nginx")
        assert nginx, "nginx is not installed"
        self.process = subprocess.Popen([nginx, "-p", str(self.workdir), "-c", str(self.config)])
        deadline = time.monotonic() + 10
        while not self.worker_pids():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {(self.workdir / 'nginx-error.log').read_text()}")
            time.sleep(0.05)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    def worker_pids(self) -> list[int]:
        """The processes that do the proxying (the master only supervises them)."""
        if self.process is None:
            return []
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except OSError:
            return []
