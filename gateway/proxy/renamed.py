"""HTTP answers of a renamed target: a client that called ``qc`` sees ``qc``, whichever model answered.

A policy of ``qc`` may send a request to another model (``qc_2026_12``, ``qc_2026_12@2``). Only
such requests come here: the exchange tests one attribute per request, so a policy without
renamed targets costs nothing more. What changes, and nothing else:

- the path: ``/v2/models/qc/infer`` goes up as ``/v2/models/qc_2026_12[/versions/2]/infer``
  (query kept);
- the answer's model name: Triton writes it first in its JSON (``{"model_name":"...`` for
  infer and generate, each generate_stream event alike; ``{"name":"...`` for metadata and
  config), so only that field is looked for, near the start, and replaced;
- Triton's error texts, which name a model in single quotes (``'qc_2026_12' version 7 is not
  found``, ``unexpected shape ... for model 'qc_2026_12'``): the quoted name says ``'qc'``;
- the framing that follows: Inference-Header-Content-Length (the JSON header of a binary
  answer changed length) and, for an answer Triton compressed, the same coding again.

The headers ``x-gateway-model-version`` (the target key, ``qc_2026_12@2``) and
``x-gateway-route`` still say which target answered.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import lru_cache

from gateway.proxy.limits import inflate
from gateway.upstream import UpstreamResponse

Headers = list[tuple[bytes, bytes]]
# Triton's JSON starts with the model's name: only this far into an answer is it looked for.
_NAME_WITHIN = 16
_IHCL = b"inference-header-content-length"
_ENCODING = b"content-encoding"
_EVENT_STREAM = b"text/event-stream"


def renamed_path(target: bytes, model: str, version: str | None) -> bytes:
    """``/v2/models/{called}[/{action}][?q]`` -> ``/v2/models/{model}[/versions/{version}][/{action}][?q]``
    (an unversioned call: an inference the policy routed, or a model's metadata, ready or config)."""
    path, sep, query = target.partition(b"?")
    slash = path.find(b"/", 11)  # past "/v2/models/": the end of the called name
    action = b"" if slash < 0 else path[slash:]
    versioned = b"" if version is None else b"/versions/" + version.encode()
    return b"/v2/models/" + model.encode() + versioned + action + sep + query


def _json_text(name: str) -> bytes:
    """A name as it is written inside a JSON string (Triton writes UTF-8, escaping only what JSON must)."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


@dataclass(frozen=True, slots=True)
class Rename:
    """What one (answering model, called name) pair replaces; built once per pair (:func:`rename`)."""

    answer_from: bytes
    answer_to: bytes
    metadata_from: bytes
    metadata_to: bytes
    quoted_from: bytes
    quoted_to: bytes

    def body(self, status: int, body: bytes, header_length: int | None = None) -> bytes:
        """An uncompressed answer with the called name. ``header_length``: a binary answer's JSON
        header length (the name is only looked for in it)."""
        if status >= 400:
            return body.replace(self.quoted_from, self.quoted_to)
        end = min(len(body) if not header_length else header_length, _NAME_WITHIN + len(self.answer_from))
        for old, new in ((self.answer_from, self.answer_to), (self.metadata_from, self.metadata_to)):
            at = body.find(old, 0, end)
            if at >= 0:
                return b"".join((body[:at], new, body[at + len(old):]))
        return body

    def answer(self, status: int, headers: Headers, body: bytes, limit: int) -> tuple[Headers, bytes]:
        """A whole answer (headers end to end, body) with the called name; a compressed one is
        inflated (within ``limit``), renamed and compressed again with its own coding."""
        encoding = _value(headers, _ENCODING)
        coded = encoding is not None and encoding.lower() in (b"gzip", b"deflate")
        plain = inflate(body, encoding.lower(), limit) if coded and encoding is not None else body
        header_length = _header_length(headers)
        if status < 400 and is_event_stream(headers):  # generate_stream that arrived whole: every event
            renamed = plain.replace(self.answer_from, self.answer_to)
        else:
            renamed = self.body(status, plain, header_length)
        if renamed == plain:
            return headers, body
        if header_length:
            headers = _with_value(headers, _IHCL, header_length + len(renamed) - len(plain))
        if coded and encoding is not None:
            renamed = _compressed(renamed, encoding.lower())
        return headers, renamed

    async def events(self, response: UpstreamResponse) -> AsyncIterator[bytes]:
        """A generate_stream answer's events with the called name, however Triton's bytes were
        cut into chunks: the end of a chunk that could begin a name waits for the next one."""
        old, new = self.answer_from, self.answer_to
        keep = len(old) - 1
        carried = b""
        async for chunk in response.chunks():
            data = (carried + chunk if carried else chunk).replace(old, new)
            cut = _partial_tail(data, old, keep)
            carried, data = data[cut:], data[:cut]
            if data:
                yield data
        if carried:
            yield carried


@lru_cache(maxsize=1024)
def rename(answering: str, called: str) -> Rename:
    """The replacements for answers of ``answering`` that a client asked of ``called``."""
    old, new = _json_text(answering), _json_text(called)
    return Rename(b'"model_name":"' + old + b'"', b'"model_name":"' + new + b'"',
                  b'{"name":"' + old + b'"', b'{"name":"' + new + b'"',
                  b"'" + old + b"'", b"'" + new + b"'")


def is_event_stream(headers: Headers) -> bool:
    content_type = _value(headers, b"content-type")
    return content_type is not None and content_type.lower().startswith(_EVENT_STREAM)


def _partial_tail(data: bytes, pattern: bytes, keep: int) -> int:
    """Where the bytes that could be the start of ``pattern`` begin at the end of ``data`` (len(data): none)."""
    start = max(len(data) - keep, 0)
    at = data.find(pattern[:1], start)
    while at >= 0:
        if pattern.startswith(data[at:]):
            return at
        at = data.find(pattern[:1], at + 1)
    return len(data)


def _value(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _header_length(headers: Headers) -> int | None:
    value = _value(headers, _IHCL)
    return int(value) if value is not None and value.isdigit() else None


def _with_value(headers: Headers, name: bytes, value: int) -> Headers:
    return [(key, str(value).encode() if key.lower() == name else old) for key, old in headers]


def _compressed(body: bytes, encoding: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=31 if encoding == b"gzip" else 15)
    return compressor.compress(body) + compressor.flush()
