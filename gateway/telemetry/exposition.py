"""Rendering ``/metrics`` off the loop that serves inference.

Measured at 1,000 models (bench/scale.py), a scrape rendered on the event loop stopped every
request on it for the whole scrape: 2.3 s at 1,000 models, 18 s at 5,000. Here the loop only
copies the numbers (:meth:`SnapshotRegistry.freeze`: each collector's ``snapshot()``, O(label
sets), no formatting), and a thread of the registry's own formats the text. The copy is one
moment's state, so a histogram's buckets, sum and count always agree, whatever is recorded
while the text is built.

The thread shares the interpreter's lock with the loop, and a thread that only computes keeps it
for the switch interval (5 ms) each time the loop lets go of it, which the loop does at every
system call: a loop turn waited ~5 ms per call, a few turns a second went by while a 5,000-model
exposition was built (~150 loop turns/s, ~900 without a scrape). So the rendering thread paces
itself (:func:`pace`): every ``PACE_EVERY`` samples built or written it sleeps ``PACE_S``, which
hands the lock to the loop at once; the loop waits at most that many samples' work.

The big families (a few series per model with a policy: ~85,000 lines at 5,000 models) come as
:class:`Keyed` rows, each row's text kept between scrapes (:class:`Lines`): a scrape writes again
only the rows whose numbers changed since the one before, and joins the rest as they were.
Writing every line with prometheus-client's encoders held the interpreter's lock (shared with the
loop) for ~3 s of a 5,000-model scrape under load; the lines are the encoders' to the byte
(tests/unit/test_exposition_lines.py compares them, in both formats).

Collectors with a ``snapshot()`` (returning something with ``collect()``) are copied this way;
any other collector (the process, fleet and worker collectors: a few series, plain fields) is
collected on the loop as it is. Scrapes that arrive while one is rendered in the same format
share its answer: a burst of scrapes costs one rendering.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _go_float

Metric = Any  # prometheus_client.core.Metric, whose families are built off the loop
PACE_EVERY = 200  # samples built or written by the rendering thread between two pauses (~0.3 ms of work)
PACE_S = 0.0002
_rendering = threading.local()  # .count on the thread while it renders for render(): it paces itself


def pace() -> None:
    """One sample built or written; on the rendering thread every ``PACE_EVERY``-th pauses, so
    the loop takes the interpreter's lock at once (anywhere else: nothing)."""
    count = getattr(_rendering, "count", None)
    if count is not None:
        if count >= PACE_EVERY:
            count = 0
            time.sleep(PACE_S)
        _rendering.count = count + 1


class _Paced(list[Any]):
    """A family's samples, written at the rendering thread's pace."""

    def __iter__(self) -> Iterator[Any]:
        for sample in super().__iter__():
            pace()
            yield sample


floatToGoString = cast(Callable[[Any], str], _go_float)  # the encoders' own spelling of a value
Row = tuple[Hashable, Hashable]  # (key: the row's labels, signature: its numbers)


class Keyed:
    """A family as rows: ``rows()`` gives (key, signature) pairs, ``add(family, key, signature)``
    adds a row's samples, and equal signatures make equal samples, so a row's text can be kept
    while its signature stays. Rows are made as they are read: a list of them lived through a
    whole rendering, was promoted into the collector's oldest generation (~75,000 objects a
    scrape at 5,000 models) and set off full collections that stopped the loop for 20-100 ms."""

    def __init__(self, name: str, make: Callable[[], Metric], rows: Callable[[], Iterator[Row]],
                 add: Callable[[Any, Any, Any], None]) -> None:
        self.name = name
        self.make = make
        self.rows = rows
        self.add = add

    def metric(self) -> Metric:
        family = self.make()
        for key, signature in self.rows():
            self.add(family, key, signature)
        return family


class Lines:
    """Each :class:`Keyed` row's text as last written, by format and family; used by the
    rendering thread alone. ``rendered``: the rows and sample lines the last render wrote anew.
    A row that did not change allocates nothing that outlives the render."""

    def __init__(self) -> None:
        self._rows: dict[tuple[bool, str], dict[Hashable, tuple[Hashable, bytes]]] = {}
        self._headers: dict[tuple[bool, str], bytes] = {}
        self.rendered = (0, 0)

    def render(self, families: Iterable[Keyed], openmetrics: bool) -> list[bytes]:
        """The families' text, in pieces (joined once, with the rest, by the caller)."""
        out: list[bytes] = []
        rows = lines = 0
        for keyed in families:
            kept = self._rows.setdefault((openmetrics, keyed.name), {})
            family = keyed.make()
            header = self._headers.get((openmetrics, keyed.name))
            if header is None:
                header = self._headers[(openmetrics, keyed.name)] = _header(family, openmetrics).encode()
            out.append(header)
            seen = 0
            for key, signature in keyed.rows():
                pace()
                seen += 1
                hit = kept.get(key)
                if hit is None or hit[0] != signature:
                    del family.samples[:]
                    keyed.add(family, key, signature)
                    hit = kept[key] = (signature, "".join([_line(sample) for sample in family.samples]).encode())
                    rows += 1
                    lines += len(family.samples)
                out.append(hit[1])
            if len(kept) > seen:  # rows gone since the last scrape: keep only this one's
                self._rows[(openmetrics, keyed.name)] = {key: kept[key] for key, _ in keyed.rows() if key in kept}
        self.rendered = (rows, lines)
        return out


def _header(family: Metric, openmetrics: bool) -> str:
    """The family's HELP and TYPE lines as prometheus-client's encoders write them."""
    if openmetrics:
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
        return f"# HELP {family.name} {doc}\n# TYPE {family.name} {family.type}\n"
    name = family.name + "_total" if family.type == "counter" else family.name
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {family.type}\n"


def _line(sample: Any) -> str:
    """One sample's line as both encoders write it (no timestamp, no exemplar, legacy names)."""
    pace()
    if not sample.labels:
        return f"{sample.name} {floatToGoString(sample.value)}\n"
    labels = ",".join([f'{name}="{_escaped(value)}"' for name, value in sorted(sample.labels.items())])
    return f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n"


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


# Name escapings under which the encoders write our (legacy-valid) names as they are, so kept
# lines hold; under another (Prometheus 3 may ask for "dots": each _ written __) the encoder
# writes every line (tests/unit/test_exposition_lines.py compares every format).
KEPT_ESCAPINGS = frozenset(("", "underscores", "allow-utf-8"))


def _escaping(content_type: str) -> str:
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name == "escaping":
            return value
    return ""


def _encode_paced(encoder: Any, frozen: Frozen, lines: Lines, openmetrics: bool, kept: bool = True) -> bytes:
    _rendering.count = 0
    try:
        if not kept:
            return bytes(encoder(frozen))
        keyed, rest = frozen.split()
        pieces = lines.render(keyed, openmetrics)
        pieces.append(bytes(encoder(rest)))  # OpenMetrics' "# EOF" stays last
        return b"".join(pieces)  # one copy of the whole text
    finally:
        del _rendering.count


class Frozen:
    """One moment's metrics, ready to be encoded on any thread (what the encoders call ``registry``).
    A part with ``families()`` gives some of its families as :class:`Keyed` rows."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def split(self) -> tuple[list[Keyed], Frozen]:
        """The :class:`Keyed` families, and the others for an encoder (each part's families built once)."""
        keyed: list[Keyed] = []
        parts: list[Any] = []
        for part in self.parts:
            if hasattr(part, "families"):
                plain: list[Metric] = []
                for family in part.families():
                    if isinstance(family, Keyed):
                        keyed.append(family)
                    else:
                        plain.append(family)
                parts.append(plain)
            else:
                parts.append(part)
        return keyed, Frozen(parts)

    def collect(self) -> Iterator[Metric]:
        paced = getattr(_rendering, "count", None) is not None
        for part in self.parts:
            if hasattr(part, "families"):
                metrics: Iterable[Any] = (family.metric() if isinstance(family, Keyed) else family
                                          for family in part.families())
            else:
                metrics = part.collect() if hasattr(part, "collect") else part
            for metric in metrics:
                if paced:
                    metric.samples = _Paced(metric.samples)
                yield metric


class SnapshotRegistry(CollectorRegistry):
    """A ``CollectorRegistry`` whose :meth:`render` copies on the calling loop and encodes on
    a thread of its own. ``get_sample_value`` and the encoders work on it as on any registry."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self._ordered: list[Collector] = []
        self._executor: ThreadPoolExecutor | None = None
        self._rendering: dict[str, asyncio.Future[bytes]] = {}
        self.lines = Lines()  # the keyed rows' text, kept between scrapes (the rendering thread's)

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self._ordered.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self._ordered.remove(collector)

    def freeze(self) -> Frozen:
        """Every collector's numbers now (on the serving loop: copies only)."""
        parts: list[Iterable[Metric] | Any] = []
        for collector in self._ordered:
            snapshot = getattr(collector, "snapshot", None)
            parts.append(snapshot() if snapshot is not None else list(collector.collect()))
        return Frozen(parts)

    async def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition in the format ``accept`` asks for, encoded off this loop."""
        encoder, content_type = choose_encoder(accept or "")
        pending = self._rendering.get(content_type)
        if pending is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="metrics-render")
            frozen = self.freeze()
            openmetrics = content_type.startswith("application/openmetrics-text")
            pending = asyncio.get_running_loop().run_in_executor(self._executor, _encode_paced, encoder, frozen,
                                                                 self.lines, openmetrics,
                                                                 _escaping(content_type) in KEPT_ESCAPINGS)
            self._rendering[content_type] = pending
            pending.add_done_callback(lambda _: self._rendering.pop(content_type, None))
        return await asyncio.shield(pending), content_type

    def close(self) -> None:
        """Stop the rendering thread (a scrape under way finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

