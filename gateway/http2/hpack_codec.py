"""HPACK (RFC 7541) for the lean gRPC upstream client: a full decoder, a literal-only encoder.

The decoder keeps the dynamic table the server's encoder builds; after the first response
Triton's header blocks are a few indexed bytes, so decoding one is a handful of dict and list
lookups. Huffman-coded strings are decoded by the ``hpack`` package and cached, because the
same few values (``application/grpc``, ``0``) arrive on every call; only short strings are
cached, and only so many, so a hostile peer cannot grow the cache. The decoder stops building
the header list once it passes ``max_list_size`` (SETTINGS_MAX_HEADER_LIST_SIZE) but still
reads the rest of the block to keep its table in step with the peer's encoder: one entry
referenced 100,000 times costs a loop over the block, never 100,000 copies. The encoder never adds to
the server's table: every field is a literal without indexing, so there is no encoder state
to keep in step and a request's header block can be built from cached pieces.
"""

from __future__ import annotations

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

_STATIC: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(_STATIC)
_HUFFMAN_CACHE_LIMIT = 256  # entries per connection
_HUFFMAN_CACHE_STRING = 64  # longer strings are decoded every time: the cache stays under ~40 KB
_ENTRY_OVERHEAD = 32  # RFC 7541 4.1: what one entry costs on top of its name and value
_BLOCK_CACHE_LIMIT = 64  # decoded header blocks remembered per connection
_BLOCK_CACHE_BYTES = 256  # longer blocks are decoded every time: the cache stays under ~20 KB of keys


class HpackError(ValueError):
    """A header block this decoder cannot read: the connection has to be dropped (COMPRESSION_ERROR)."""


class HeaderListTooLarge(Exception):
    """The block decoded (the table is in step) but its header list is above ``max_list_size``."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a header list of at least {size} bytes is above the limit of {limit}")
        self.size = size


def _integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("truncated integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("integer too large")


class Decoder:
    def __init__(self, max_table_size: int = 4096, max_list_size: int = 1 << 62) -> None:
        self.max_table_size = max_table_size  # what we advertised in SETTINGS_HEADER_TABLE_SIZE
        self.max_list_size = max_list_size  # what we advertised in SETTINGS_MAX_HEADER_LIST_SIZE
        self._table_limit = max_table_size
        self._dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self._size = 0
        self._huffman: dict[bytes, bytes] = {}
        # Blocks that left the table as it was, decoded: once a peer's encoder has indexed its fields,
        # every call's block is the same few bytes (a lookup instead of a parse). Any change to the
        # table (an insertion shifts every dynamic index, a size update may evict) forgets them all.
        self._blocks: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}
        self._changes = 0  # table changes so far

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        known = self._blocks.get(block)
        if known is not None:
            return list(known)
        changes = self._changes
        try:
            headers = self._decode(block)
        finally:
            if self._changes != changes:
                self._blocks.clear()
        if self._changes == changes and len(block) <= _BLOCK_CACHE_BYTES \
                and len(self._blocks) < _BLOCK_CACHE_LIMIT:
            self._blocks[block] = tuple(headers)
        return headers

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos, end = 0, len(block)
        size, limit = 0, self.max_list_size
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                name, value = self._entry(index)
            elif byte & 0x40:  # literal with incremental indexing
                name, value, pos = self._literal(block, pos, 6)
                self._add(name, value)
            elif byte & 0x20:  # dynamic table size update: only before the first field (RFC 7541 4.2)
                if size:
                    raise HpackError("a dynamic table size update after a header field")
                table_size, pos = _integer(block, pos, 5)
                if table_size > self.max_table_size:
                    raise HpackError(f"table size {table_size} above the advertised {self.max_table_size}")
                self._table_limit = table_size
                self._changes += 1
                self._evict()
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                name, value, pos = self._literal(block, pos, 4)
            size += len(name) + len(value) + _ENTRY_OVERHEAD
            if size <= limit:
                headers.append((name, value))
        if size > limit:
            raise HeaderListTooLarge(size, limit)
        return headers

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        dynamic = index - _STATIC_LEN - 1
        if 0 <= dynamic < len(self._dynamic):
            return self._dynamic[dynamic]
        raise HpackError(f"header index {index} out of range")

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[bytes, bytes, int]:
        index, pos = _integer(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return name, value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HpackError("truncated string")
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        raw = block[pos:pos + length]
        if len(raw) != length:
            raise HpackError("truncated string")
        pos += length
        if not huffman:
            return raw, pos
        decoded = self._huffman.get(raw)
        if decoded is None:
            try:
                decoded = decode_huffman(raw)
            except Exception as exc:  # hpack raises its own error type
                raise HpackError(f"bad huffman string: {exc}") from exc
            if length <= _HUFFMAN_CACHE_STRING and len(self._huffman) < _HUFFMAN_CACHE_LIMIT:
                self._huffman[raw] = decoded
        return decoded, pos

    def _add(self, name: bytes, value: bytes) -> None:
        self._changes += 1
        self._dynamic.insert(0, (name, value))
        self._size += len(name) + len(value) + _ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        while self._size > self._table_limit and self._dynamic:
            name, value = self._dynamic.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD


def encode_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One field as 'literal without indexing, new name', strings not Huffman-coded."""
    return b"\x00" + encode_integer(len(name), 7) + name + encode_integer(len(value), 7) + value


def literal_indexed_name(index: int, value: bytes) -> bytes:
    """'Literal without indexing' whose name is static table entry ``index``."""
    return encode_integer(index, 4) + encode_integer(len(value), 7) + value
