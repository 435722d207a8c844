"""How a value is stored in a Mooncake object, and what Mooncake's status codes mean to us. Pure logic.

Each value is one Mooncake object: a 24-byte header, then the value's bytes. Why a header: Mooncake
refuses empty objects, so an empty value needs at least one byte of its own; the length it carries lets a read
that lands straight in the caller's buffers check that it got exactly the value it asked for; and the xxh3
checksum of the value catches a read that raced an ``upsert`` of the same key. The contract suite saw such
torn reads (a reader given bytes of two writes) in about one run in three, so a mismatch is re-read once and
then reported as a miss: a reader sees the old value, the new one or nothing. Bytes that do not start with a
header declaring their length are a miss too, never handed on: Mooncake 0.3.13 serves a read racing an
``upsert`` an object not written yet (all zeros, header included; measured), so such bytes are nobody's value.

A value written as :class:`asyncconn.backend.SelfChecked` (a frame, whose own checksum every reader
verifies) carries :data:`FLAG_SELF_CHECKED` and no checksum of ours: computing it would repeat the frame's
pass over every byte of every put. Such a value is handed to its reader unchecked here; a torn
read of it fails the reader's frame check instead.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

__all__ = [
    "FLAG_SELF_CHECKED",
    "HEADER_SIZE",
    "Outcome",
    "checksum",
    "classify",
    "code_name",
    "pack_header",
    "parse_header",
]

#: Starts with a NUL so no frame (b"ACNF...") or text can be taken for it.
MAGIC = b"\x00ACK"
_LAYOUT_VERSION = 2
_HEADER = struct.Struct("<4sBB2xQQ")
HEADER_SIZE = _HEADER.size
#: The value checks itself (its checksum field is 0 and means nothing); older headers have 0 here.
FLAG_SELF_CHECKED = 1
_KNOWN_FLAGS = FLAG_SELF_CHECKED


def checksum(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


def pack_header(length: int, digest: int = 0, flags: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, _LAYOUT_VERSION, flags, length, digest)


def parse_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int] | None:
    """``(length, checksum, flags)`` a header declares, ``None`` when ``data`` does not start with one of ours
    (or sets a flag this version does not know)."""
    if len(data) < HEADER_SIZE:
        return None
    magic, layout, flags, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC or layout != _LAYOUT_VERSION or flags & ~_KNOWN_FLAGS:
        return None
    return int(length), int(digest), int(flags)


# Mooncake's ErrorCode values (mooncake-store/include/types.h), the ones we treat specially.
OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
OBJECT_HAS_REPLICATION_TASK = -708
REPLICA_NOT_FOUND = -710
REPLICA_IS_GONE = -712
OBJECT_REPLICA_BUSY = -714
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (no space left in any segment)",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    OBJECT_HAS_REPLICATION_TASK: "OBJECT_HAS_REPLICATION_TASK",
    REPLICA_NOT_FOUND: "REPLICA_NOT_FOUND",
    REPLICA_IS_GONE: "REPLICA_IS_GONE",
    OBJECT_REPLICA_BUSY: "OBJECT_REPLICA_BUSY",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}


def code_name(code: int) -> str:
    return f"{_NAMES.get(code, 'error')} ({code})"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a negative status means for the call that got it."""

    miss: bool  # the value is not (or no longer, or not yet wholly) there: report a miss
    retry: bool  # a write met a busy or full moment that may pass: try again until the deadline
    unavailable: bool  # the master or a peer cannot be reached


#: Reads that find the object gone, half-written or evicted under them are misses, never partial values.
_MISS = {
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    LEASE_EXPIRED,
    REPLICA_NOT_FOUND,
    REPLICA_IS_GONE,
}
#: Writes racing another writer of the same key, or a moment with no free space, may succeed later.
_RETRY = {NO_AVAILABLE_HANDLE, OBJECT_HAS_LEASE, OBJECT_REPLICA_BUSY, OBJECT_HAS_REPLICATION_TASK, -1}
_UNAVAILABLE = {RPC_FAIL, RPC_TIMEOUT, -1010, -101, -103}


def classify(code: int) -> Outcome:
    return Outcome(miss=code in _MISS, retry=code in _RETRY, unavailable=code in _UNAVAILABLE)
