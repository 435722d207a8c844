"""Tensor <-> bytes frames: a small fixed header, the raw payload, and a checksum over both.

Layout (all integers little-endian)::

    magic      4s   b"ACNF"
    version    u8   FORMAT_VERSION
    dtype      u8   code from _DTYPES (never a free-form string: nothing read is evaluated)
    ndim       u8   <= MAX_NDIM
    flags      u8   bit 0 = FLAG_KEYED (the checksum is seeded with the key); other bits are rejected
    length     u64  payload bytes
    shape      ndim x u64
    padding    zero bytes, so the header ends on a multiple of PAYLOAD_ALIGN (64) bytes
    checksum   u64  xxh3_64 of every header byte before it, then of the payload; seeded with
                    xxh64(key) when the frame is bound to a key
    payload    `length` bytes, C-contiguous, starting PAYLOAD_ALIGN-aligned in the frame

Why the padding: a backend that reads a frame straight into caller memory (``file://``'s ``preadv``) has
the kernel copy each payload byte from the frame's offset to the destination's address. That copy is
fastest when the two are equally aligned and several times slower when the destination sits a few bytes
past the source modulo a page (``asyncconn bench align`` measures it: docs/benchmarks.md). Destinations --
torch tensors, vLLM's KV blocks, staging views -- are 64-byte aligned, so the payload starts 64-byte
aligned in the frame too, whatever the tensor's rank (format 1 had no padding, so some ranks' headers put
the payload in the slow case). A frame of format version 1 is refused with :class:`FrameVersionError`: a
miss.

The checksum covers the header as well as the payload, so a flipped dtype code (float16 <-> bfloat16 have
the same item size) or shape is caught, not decoded into a plausible wrong tensor. Decoding checks every
field and the checksum over the *source* bytes before any byte is copied into a destination tensor, and
accepts the payload as a sequence of chunks (as stores that split large values return it) so values are
never joined into an intermediate ``bytes`` object. There is no pickle anywhere in this path.

Key binding: a frame encoded with ``key=`` sets ``FLAG_KEYED`` and seeds its checksum with a hash of the key,
and decoding with ``key=`` accepts only a frame bound to that same key. A valid frame copied or renamed to
another key (a buggy tool, a restore into the wrong prefix, someone's "cache warming" script) would otherwise
decode cleanly into a plausible tensor of the right shape -- the one failure a checksum alone cannot see. The
seed costs nothing per byte; :class:`~asyncconn.store.TensorStore` always binds.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash

from asyncconn.exceptions import (
    FrameCorrupt,
    FrameMismatch,
    FrameTooLarge,
    FrameTruncated,
    FrameVersionError,
    InvalidInput,
)

__all__ = [
    "FLAG_KEYED",
    "FORMAT_VERSION",
    "MAGIC",
    "PAYLOAD_ALIGN",
    "Chunks",
    "Described",
    "FrameHeader",
    "FrameVerifier",
    "decode",
    "decode_into",
    "encode",
    "encode_parts",
    "header_size",
    "key_seed",
    "parse_header",
    "check_tensor",
    "tensor_bytes",
]

MAGIC = b"ACNF"
FORMAT_VERSION = 2
#: The payload's offset in a frame (its header's length) is a multiple of this (see the module docstring).
PAYLOAD_ALIGN = 64
#: Header flag: the checksum is seeded with :func:`key_seed` of the key the frame was written under.
FLAG_KEYED = 0x01
MAX_NDIM = 16
DEFAULT_MAX_PAYLOAD = 1 << 36  # 64 GiB: far above any embedding or KV value, far below a wrapped u64

_FIXED = struct.Struct("<4sBBBBQ")
_U64 = struct.Struct("<Q")

# Codes are part of the wire format: append only, never renumber.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.uint8,
    6: torch.int8,
    7: torch.int16,
    8: torch.int32,
    9: torch.int64,
    10: torch.bool,
    11: torch.float8_e4m3fn,
    12: torch.float8_e5m2,
}
_CODES: dict[torch.dtype, int] = {v: k for k, v in _DTYPES.items()}
_NUMPY_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]

Buffer = bytes | bytearray | memoryview
Chunks = Sequence[Buffer]


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame's header declares, after validation."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    header_len: int
    flags: int = 0

    @property
    def frame_len(self) -> int:
        return self.header_len + self.payload_len


def _as_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 memoryview over a contiguous CPU tensor's storage (no copy)."""
    if tensor.numel() == 0:  # memoryview.cast refuses shapes holding a zero, e.g. (2, 0)
        return memoryview(bytearray())  # writable: it may be a read's destination
    # numpy arrays export the buffer protocol (their stubs do not say so). Going through numpy directly
    # skips the reshape/view, which only the dtypes numpy lacks (bfloat16, float8) need.
    array: Any = (
        tensor.numpy() if tensor.dtype in _NUMPY_DTYPES else tensor.reshape(-1).view(torch.uint8).numpy()
    )
    return memoryview(array).cast("B")


def check_tensor(tensor: object, what: str = "a stored value") -> torch.Tensor:
    """``tensor`` when it is a dense tensor with data; :class:`InvalidInput` otherwise.

    Why: a sparse, nested or meta tensor has no flat byte payload to frame, and without this check each
    surfaced as a different raw torch error (or, for a meta destination, as a silent miss).
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInput(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise InvalidInput(f"{what} must be a dense (strided) tensor, not a {tensor.layout} one")
    if tensor.device.type == "meta":
        raise InvalidInput(f"{what} is a meta tensor: it has no data")
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor (the destination of a direct read)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise FrameMismatch("a direct read needs a contiguous CPU tensor")
    return _as_bytes_view(tensor)


def header_size(ndim: int) -> int:
    """Header bytes of a frame with ``ndim`` dimensions: fields, zero padding and checksum, a multiple of
    :data:`PAYLOAD_ALIGN`."""
    return -(-(_FIXED.size + 8 * ndim + 8) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def _padding(ndim: int) -> int:
    return header_size(ndim) - (_FIXED.size + 8 * ndim + 8)


Key = str | bytes


def key_seed(key: Key) -> int:
    """The xxh3 seed of a frame bound to ``key`` (xxh64 of its UTF-8 bytes)."""
    return xxhash.xxh64_intdigest(key.encode() if isinstance(key, str) else key)


def _seed(flags: int, key: Key | None) -> int:
    """Checksum seed for a frame with ``flags`` read as ``key``; a binding that does not match is an error."""
    if flags & FLAG_KEYED:
        if key is None:
            raise FrameMismatch("frame is bound to a key; decode it with key=")
        return key_seed(key)
    if key is not None:
        raise FrameCorrupt("frame is not bound to a key, but it was read from one")
    return 0


def _header_prefix(dtype: torch.dtype, shape: Sequence[int], payload_len: int, flags: int = 0) -> bytes:
    code = _CODES.get(dtype)
    if code is None:
        raise InvalidInput(f"dtype {dtype} cannot be encoded (supported: {sorted(map(str, _CODES))})")
    if len(shape) > MAX_NDIM:
        raise InvalidInput(f"tensor has {len(shape)} dims; at most {MAX_NDIM} can be encoded")
    return (
        _FIXED.pack(MAGIC, FORMAT_VERSION, code, len(shape), flags, payload_len)
        + _SHAPES[len(shape)].pack(*shape)
        + bytes(_padding(len(shape)))
    )


def encode_parts(tensor: torch.Tensor, *, key: Key | None = None) -> tuple[bytes, memoryview]:
    """Encode without copying the payload: ``(header, payload_view)``; ``key`` binds the frame to its key.

    The tensor is moved to the CPU and made contiguous if needed; the returned view keeps that CPU copy
    alive, so callers may write the two parts out (``writev``, a pipeline) without joining them.
    """
    t = check_tensor(tensor).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    payload = _as_bytes_view(t)
    flags = 0 if key is None else FLAG_KEYED
    prefix = _header_prefix(t.dtype, tuple(t.shape), payload.nbytes, flags)
    h = xxhash.xxh3_64(prefix, seed=_seed(flags, key))
    h.update(payload)
    return prefix + _U64.pack(h.intdigest()), payload


def encode(tensor: torch.Tensor, *, key: Key | None = None) -> bytes:
    """Encode into one ``bytes`` object (one payload copy; use :func:`encode_parts` to avoid it)."""
    header, payload = encode_parts(tensor, key=key)
    return header + payload.tobytes()


class _ChunkCursor:
    """Reads across a sequence of buffers without joining them."""

    __slots__ = ("_chunks", "_index", "_offset", "total")

    def __init__(self, chunks: Chunks) -> None:
        self._chunks = [c if isinstance(c, memoryview) else memoryview(c) for c in chunks]
        self._chunks = [c.cast("B") if c.format != "B" or c.ndim != 1 else c for c in self._chunks]
        self._index = 0
        self._offset = 0
        self.total = sum(c.nbytes for c in self._chunks)

    def read_small(self, n: int) -> bytes:
        """Copy out ``n`` bytes (header fields only); raises FrameTruncated when they are not there."""
        out = bytearray()
        for view in self.views(n):
            out += view
        if len(out) != n:
            raise FrameTruncated(f"frame truncated: wanted {n} more header bytes, found {len(out)}")
        return bytes(out)

    def views(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes as zero-copy views (fewer if the buffers run out)."""
        out: list[memoryview] = []
        while n > 0 and self._index < len(self._chunks):
            chunk = self._chunks[self._index]
            take = min(n, chunk.nbytes - self._offset)
            out.append(chunk[self._offset : self._offset + take])
            n -= take
            self._offset += take
            if self._offset == chunk.nbytes:
                self._index += 1
                self._offset = 0
        return out


def _as_chunks(data: Buffer | Chunks) -> Chunks:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return (data,)
    return data


def _parse_head(head: Buffer, max_payload: int) -> FrameHeader:
    """Parse and validate a header from ``head`` (at least the header's bytes; the payload may follow)."""
    if len(head) < _FIXED.size:
        raise FrameTruncated(f"frame truncated: {len(head)} bytes, a header needs at least {header_size(0)}")
    magic, version, code, ndim, flags, length = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise FrameCorrupt(f"not an asyncconn frame (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise FrameVersionError(f"frame format version {version}; this build reads {FORMAT_VERSION}")
    if flags & ~FLAG_KEYED:
        raise FrameCorrupt(f"frame has unknown flags {flags:#x}")
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise FrameCorrupt(f"frame has unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise FrameCorrupt(f"frame declares {ndim} dims (max {MAX_NDIM})")
    if length > max_payload:
        raise FrameTooLarge(f"frame declares {length} payload bytes, over the cap of {max_payload}")
    header_len = header_size(ndim)
    if len(head) < header_len:
        raise FrameTruncated(f"frame truncated: {len(head)} bytes, its header needs {header_len}")
    shape = _SHAPES[ndim].unpack_from(head, _FIXED.size)
    pad_at = _FIXED.size + 8 * ndim
    if any(memoryview(head)[pad_at : header_len - 8]):
        raise FrameCorrupt("frame header padding is not zero")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != length:
        raise FrameCorrupt(f"frame shape {shape} x {dtype} does not match its payload length {length}")
    (checksum,) = _U64.unpack_from(head, header_len - 8)
    return FrameHeader(dtype, shape, length, checksum, header_len, flags)


def _check_total(header: FrameHeader, total: int) -> None:
    expected = header.frame_len
    if total != expected:
        if total < expected:
            raise FrameTruncated(f"frame truncated: {total} bytes, header promises {expected}")
        raise FrameCorrupt(f"frame has {total - expected} trailing bytes")


def _cursor_head(cursor: _ChunkCursor) -> bytes:
    """Copy a header out of a chunked value (small; the payload is never copied here)."""
    fixed = cursor.read_small(_FIXED.size)
    ndim = fixed[6]
    if ndim > MAX_NDIM:
        return fixed  # _parse_head reports it
    return fixed + cursor.read_small(header_size(ndim) - _FIXED.size)


def parse_header(data: Buffer | Chunks, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> FrameHeader:
    """Validate a whole frame's header and length (not the checksum) and return what it declares."""
    cursor = _ChunkCursor(_as_chunks(data))
    header = _parse_head(_cursor_head(cursor), max_payload)
    _check_total(header, cursor.total)
    return header


def _verified_payload(
    data: Buffer | Chunks, max_payload: int, key: Key | None
) -> tuple[FrameHeader, list[memoryview]]:
    single = data if isinstance(data, (bytes, bytearray, memoryview)) else data[0] if len(data) == 1 else None
    if single is not None:  # the common case: no cursor, no header copy
        view = memoryview(single)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        header = _parse_head(view, max_payload)
        _check_total(header, view.nbytes)
        prefix: Buffer = view[: header.header_len - 8]
        views = [view[header.header_len :]]
    else:
        cursor = _ChunkCursor(_as_chunks(data))
        head = _cursor_head(cursor)
        header = _parse_head(head, max_payload)
        _check_total(header, cursor.total)
        prefix = head[:-8]
        views = cursor.views(header.payload_len)
    h = xxhash.xxh3_64(prefix, seed=_seed(header.flags, key))
    for v in views:
        h.update(v)
    if h.intdigest() != header.checksum:
        raise FrameCorrupt(_MISMATCH)
    return header, views


_MISMATCH = "frame checksum mismatch (corrupted payload or header, or a frame written under another key)"


def _copy_views(views: list[memoryview], dest: memoryview) -> None:
    offset = 0
    for view in views:
        dest[offset : offset + view.nbytes] = view
        offset += view.nbytes


def decode(
    data: Buffer | Chunks, *, max_payload: int = DEFAULT_MAX_PAYLOAD, key: Key | None = None
) -> torch.Tensor:
    """Validate a frame and return a new CPU tensor holding its payload (one copy).

    ``key``: the key the frame was read from; the frame must be bound to it (and must be unbound without it).
    """
    header, views = _verified_payload(data, max_payload, key)
    out = torch.empty(header.shape, dtype=header.dtype)
    if header.payload_len:
        _copy_views(views, _as_bytes_view(out))
    return out


def decode_into(
    data: Buffer | Chunks,
    out: torch.Tensor,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    key: Key | None = None,
) -> FrameHeader:
    """Validate a frame, then copy its payload into ``out`` (a contiguous CPU tensor, e.g. pinned staging).

    ``out`` must have the frame's dtype and number of elements (a reshaped view is accepted); otherwise
    :class:`FrameMismatch` is raised and ``out`` is untouched, as it is for every other error.
    """
    header, views = _verified_payload(data, max_payload, key)
    if out.dtype != header.dtype or out.numel() * out.element_size() != header.payload_len:
        raise FrameMismatch(
            f"frame holds {header.dtype}{list(header.shape)}, destination is {out.dtype}{list(out.shape)}"
        )
    if out.device.type != "cpu" or not out.is_contiguous():
        raise FrameMismatch("decode_into needs a contiguous CPU destination (stage, then copy to the device)")
    if header.payload_len:
        _copy_views(views, _as_bytes_view(out))
    return header


class Described(Protocol):
    """What a verifier checks a frame against: a tensor, or a destination that only describes one."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> Sequence[int]: ...


class FrameVerifier:
    """Checks a frame fed piece by piece, as a reader lands it in the destination's memory.

    Backends that read straight into caller memory call :meth:`feed` with each consecutive piece while the
    next one is still being read, so the checksum pass overlaps the I/O instead of following it. Nothing
    hands the destination on unless :meth:`finish` returns: until then it is only a staging buffer.
    """

    __slots__ = ("_hash", "_head", "_header", "_key", "_max_payload", "_out", "_seen")

    #: Every byte fed is checked against the frame's checksum (see ``asyncconn.backend.sink_verifies``).
    verifies_value = True

    def __init__(
        self, out: Described, *, max_payload: int = DEFAULT_MAX_PAYLOAD, key: Key | None = None
    ) -> None:
        self._out = out
        self._key = key
        self._max_payload = max_payload
        self._head = bytearray()
        self._header: FrameHeader | None = None
        self._hash: xxhash.xxh3_64 | None = None  # made with the frame's seed once the header is in
        self._seen = 0

    def _header_len(self) -> int:
        if len(self._head) < _FIXED.size:
            return _FIXED.size
        return header_size(self._head[6])

    def feed(self, piece: memoryview) -> None:
        if self._header is None:
            need = self._header_len() - len(self._head)
            take = piece[:need]
            self._head += take
            piece = piece[take.nbytes :]
            if len(self._head) == _FIXED.size and self._head[6] <= MAX_NDIM:
                need = self._header_len() - len(self._head)
                take = piece[:need]
                self._head += take
                piece = piece[take.nbytes :]
            if len(self._head) < self._header_len():
                return
            self._header = header = _parse_head(self._head, self._max_payload)
            self._hash = xxhash.xxh3_64(seed=_seed(header.flags, self._key))
            self._hash.update(memoryview(self._head)[:-8])
        if piece.nbytes:
            assert self._hash is not None
            self._hash.update(piece)
            self._seen += piece.nbytes

    def feed_many(self, pieces: Sequence[memoryview]) -> None:
        """:meth:`feed` each of ``pieces`` in order, in one call.

        Why: a value read in place lands in a piece per layer (15 pieces for a 14-layer model's KV block,
        header included), and a Python call per piece was most of the Python work of such a read
        (``backend.feed_sink``).
        """
        i, n = 0, len(pieces)
        while self._header is None and i < n:
            self.feed(pieces[i])
            i += 1
        if i == n:
            return
        assert self._hash is not None
        update, seen = self._hash.update, 0
        for piece in pieces[i:] if i else pieces:
            update(piece)
            seen += piece.nbytes
        self._seen += seen

    def __call__(self, piece: memoryview) -> None:
        """A verifier is itself a backend ``Sink``."""
        self.feed(piece)

    def finish(self) -> FrameHeader:
        header = self._header
        if header is None:
            raise FrameTruncated(f"frame truncated: {len(self._head)} header bytes")
        if self._seen != header.payload_len:
            raise FrameTruncated(f"frame payload is {self._seen} bytes, header promises {header.payload_len}")
        out = self._out
        numel = 1
        for dim in out.shape:
            numel *= dim
        if out.dtype != header.dtype or numel * out.dtype.itemsize != header.payload_len:
            raise FrameMismatch(
                f"frame holds {header.dtype}{list(header.shape)}, destination is {out.dtype}{list(out.shape)}"
            )
        assert self._hash is not None
        if self._hash.intdigest() != header.checksum:
            raise FrameCorrupt(_MISMATCH)
        return header
