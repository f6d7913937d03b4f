"""Each worker of ``--workers N`` takes its share of the node's per-client connection cap
(``workers.worker``), and the whole of ``grpc_max_streams_per_client``: a gRPC client's one
connection reaches one worker, so a share would cut such a client to a fraction of the bound."""

from __future__ import annotations

import socket
from pathlib import Path

from gateway.settings import Settings
from gateway.workers.worker import WorkerGateway


def test_a_worker_takes_its_share_of_the_connection_cap_and_the_whole_stream_bound(tmp_path: Path) -> None:
    settings = Settings(triton_url="http://127.0.0.1:9", triton_grpc_url="grpc://127.0.0.1:9", grpc_enabled=True,
                        max_connections_per_client=10, grpc_max_streams_per_client=10)
    shares = []
    pins = socket.socket(socket.AF_UNIX)  # the control plane's pin table, which a worker connects to
    pins.bind(str(tmp_path / "pins.sock"))
    pins.listen()
    for index in range(3):
        worker = WorkerGateway(settings, 3, str(tmp_path))
        worker.assign(index)
        shares.append((worker.settings.max_connections_per_client, worker.settings.grpc_max_streams_per_client))
        worker.pins._channel.close()  # type: ignore[attr-defined]  # the one descriptor it opened
    pins.close()
    assert shares == [(4, 10), (3, 10), (3, 10)]  # 10 over 3 workers, the remainder to the first
