"""Sequence pins shared by every worker: one table per node, in the control plane.

An HTTP sequence's requests come on different connections, so the kernel hands them to
different workers. A pin (model, sequence id) -> version (the policy's table) or -> server
(each fleet's table) must therefore be the same for all of them, at once: the next request
of a sequence may reach another worker as soon as the client has the previous answer.

So a worker keeps no pins of its own. Its :class:`RemotePins` asks the control plane's
table synchronously, over a Unix socket of its own (:class:`~gateway.workers.channel.BlockingChannel`),
and the control plane has applied a ``pin`` before the worker forwards the request, so the
answer to the client comes after it: whatever worker the next request lands on finds it.
The cost is one local round trip (tens of µs) per request *that carries a sequence id*,
on a policy with sequence affinity or a fleet of several servers; other requests never
touch it. The control plane's tables are the ones a single gateway has (persisted by
``Replicas``, shared with other replicas through the store, read by the drain), so restarts,
drains and replicas on other nodes behave as with one process per node.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from typing import Any

from gateway.sequences import SequencePins
from gateway.workers.channel import _HEADER, BlockingChannel

VERSION_TABLE = "version"  # the policy's pins; a fleet's pins are "fleet:<name>"


class RemotePins(SequencePins):
    """A worker's view of one of the control plane's pin tables."""

    def __init__(self, channel: BlockingChannel, table: str) -> None:
        super().__init__()
        self._channel = channel
        self._table = table

    def lookup(self, model: str, sequence_id: object) -> str | None:
        answer: str | None = self._channel.call("lookup", self._table, model, sequence_id)
        return answer

    def pin(self, model: str, sequence_id: object, version: str, client: str | None = None) -> None:
        self._channel.call("pin", self._table, model, sequence_id, version, client)

    def repin(self, model: str, sequence_id: object, version: str, client: str | None = None) -> None:
        self._channel.call("repin", self._table, model, sequence_id, version, client)

    def release(self, model: str, sequence_id: object) -> None:
        self._channel.call("release", self._table, model, sequence_id)


class PinService:
    """The control plane's side: answers every worker's pin calls from the node's tables."""

    def __init__(self, tables: Callable[[str], SequencePins | None]) -> None:
        self._tables = tables
        self.calls = 0

    async def answer(self, verb: str, table: str, model: Any, sequence_id: object,
                     version: str | None = None, client: str | None = None) -> Any:
        pins = self._tables(table)
        if pins is None:
            return None
        self.calls += 1
        if isinstance(model, bytes):
            model = model.decode("utf-8", "replace")
        if verb == "lookup":
            # the node's table, and past it the pins other replicas share (the store), as one
            # gateway process does (gateway.sequences: recent, then resolve)
            found = pins.recent(model, sequence_id)
            return found if found is not None else await pins.resolve(model, sequence_id, False)
        if verb == "pin" and version is not None:
            pins.pin(model, sequence_id, version, client)  # held against the client's quota, node-wide
        elif verb == "repin" and version is not None:
            pins.repin(model, sequence_id, version, client)  # keeps the owner it has
        elif verb == "release":
            pins.release(model, sequence_id)
        await pins.share(model, sequence_id)  # written through to the store before the worker forwards
        return None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)
                message = pickle.loads(await reader.readexactly(_HEADER.unpack(header)[0]))
                writer.write(_reply(await self.answer(*message)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _reply(value: Any) -> bytes:
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body
