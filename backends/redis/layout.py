"""How one value is laid out in Redis: one key per value, inline or a hash of chunks. Pure logic, no I/O.

A value of at most ``chunk_size`` bytes is stored inline, as a string under ``<prefix>{<key>}``. A larger
one is a hash under that same key: field ``m`` holds a small :class:`Manifest` and the chunks are fields
``<version>:<i>``. One key per value is what makes Redis evict a value as a unit: under ``maxmemory``
with an ``allkeys-*`` policy, chunks stored under keys of their own were evicted one by one, and a value
missing one chunk is a miss while its other chunks still hold memory, so the hit rate of chunked values
collapsed (the figures are in docs/benchmarks.md).

A write replaces the whole key in one ``MULTI``: ``UNLINK``, then one ``HSET`` of the manifest and every
chunk. Versions are random, so a reader that follows a manifest and asks for its fields either finds exactly
the chunks that manifest describes or finds some missing (the key was replaced or evicted), and then
reports a miss -- it can never assemble a torn value. Chunks follow the caller's parts (a frame's header and
payload are never joined), so the put path sends memoryviews of the tensor itself and copies nothing.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from asyncconn.backend import Value

__all__ = [
    "MANIFEST_MAGIC",
    "Manifest",
    "MANIFEST_FIELD",
    "chunk_fields",
    "fill",
    "fetch_groups",
    "main_key",
    "new_version",
    "split_value",
]

#: Starts with a NUL so no frame (b"ACNF...") and no text value can be mistaken for a manifest.
MANIFEST_MAGIC = b"\x00ACM"
#: 2: chunks are fields of one hash (1, chunks under keys of their own, is read as a foreign value).
_LAYOUT_VERSION = 2
#: The hash field holding the manifest of a chunked value.
MANIFEST_FIELD = "m"
# magic, layout version, reserved, version id, chunk count, total bytes, xxh3 of everything before it
_MANIFEST = struct.Struct("<4sBB2x8sIQ")
_CHECK = struct.Struct("<Q")
MANIFEST_SIZE = _MANIFEST.size + _CHECK.size
#: More chunks than any sane chunk size gives; a manifest claiming more is not ours (or is hostile).
MAX_CHUNKS = 1 << 20


@dataclass(frozen=True, slots=True)
class Manifest:
    """What field ``m`` of a chunked value holds: which version of chunk fields to read, and how much."""

    version: bytes
    count: int
    total: int

    def pack(self) -> bytes:
        body = _MANIFEST.pack(MANIFEST_MAGIC, _LAYOUT_VERSION, 0, self.version, self.count, self.total)
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def parse(cls, data: bytes) -> Manifest | None:
        """The manifest ``data`` encodes, or ``None`` when it is anything else (not ours, or damaged).

        The caller treats a hash whose ``m`` field does not parse as absent: it never follows its fields.
        """
        if len(data) != MANIFEST_SIZE or not data.startswith(MANIFEST_MAGIC):
            return None
        body = data[: _MANIFEST.size]
        (check,) = _CHECK.unpack_from(data, _MANIFEST.size)
        if xxhash.xxh3_64_intdigest(body) != check:
            return None
        _, layout, _, version, count, total = _MANIFEST.unpack(body)
        if layout != _LAYOUT_VERSION or not 0 < count <= min(total, MAX_CHUNKS):
            return None
        return cls(version, count, total)


def new_version() -> bytes:
    """A random chunk-set id: two writers never share one, so chunk keys are write-once."""
    return os.urandom(8)


def main_key(prefix: str, key: str) -> str:
    """The Redis key holding the value: inline, or the hash of its manifest and chunks.

    The braces make ``key`` its Redis Cluster hash tag (one value's key is on one slot whatever the prefix).
    """
    return f"{prefix}{{{key}}}"


def chunk_fields(manifest: Manifest) -> list[str]:
    """Every chunk field a manifest names, in order."""
    base = manifest.version.hex()
    return [f"{base}:{i}" for i in range(manifest.count)]


def _parts(value: Value) -> list[memoryview]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [memoryview(value).cast("B")]
    return [memoryview(v).cast("B") for v in value]


def split_value(
    value: Value, chunk_size: int
) -> tuple[memoryview | bytes, None] | tuple[None, list[memoryview]]:
    """``(inline, None)`` for a value that fits one key, else ``(None, chunks)``.

    An inline value given in several parts is joined (a copy bounded by ``chunk_size``); a larger value is
    cut along its parts' boundaries and then every ``chunk_size`` bytes, as zero-copy views.
    """
    parts = [p for p in _parts(value) if p.nbytes]
    total = sum(p.nbytes for p in parts)
    if total <= chunk_size:
        if len(parts) == 1:
            return parts[0], None
        return b"".join(parts), None
    chunks: list[memoryview] = []
    for part in parts:
        for offset in range(0, part.nbytes, chunk_size):
            chunks.append(part[offset : offset + chunk_size])
    return None, chunks


def fetch_groups(sizes: Sequence[int], groups: int) -> list[int]:
    """Bounds cutting chunks of ``sizes`` into at most ``groups`` contiguous runs of about equal bytes.

    Why bytes and not counts: a frame's first chunk is its few-dozen-byte header, so cutting five chunks
    into four runs by count left one connection with 2 MiB to read and another with 48 bytes.
    """
    total = sum(sizes)
    bounds = [0]
    done = 0
    for index, size in enumerate(sizes[:-1]):
        done += size
        if len(bounds) < groups and done * groups >= total * len(bounds):
            bounds.append(index + 1)
    bounds.append(len(sizes))
    return bounds


def fill(dests: Sequence[memoryview], value: bytes | bytearray | memoryview) -> None:
    """Copy ``value`` across the byte views ``dests`` in order (their sizes must add up to its length)."""
    source = memoryview(value).cast("B")
    offset = 0
    for dest in dests:
        if dest.nbytes:  # an empty view may be read-only; there is nothing to copy into it anyway
            dest[:] = source[offset : offset + dest.nbytes]
        offset += dest.nbytes
    if offset != source.nbytes:
        raise ValueError(f"fill: {source.nbytes} bytes into {offset} bytes of destinations")


def chunks_complete(chunks: Sequence[bytes | bytearray | None], manifest: Manifest) -> bool:
    """True when every chunk is present and together they are exactly the manifest's length."""
    present = [c for c in chunks if c is not None]
    return len(present) == len(chunks) and sum(map(len, present)) == manifest.total
