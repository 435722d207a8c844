"""The lookup wire format: vLLM's Mooncake store lookup framing, a pipelined envelope, two query kinds.

Every message is a ZMQ multipart message. A plain REQ client (vLLM's Mooncake store client, unchanged)
sends a *body*; a pipelined DEALER client sends the same body behind an empty delimiter and one id frame,
so that the ROUTER server can answer out of order and the client can match replies to requests::

    REQ     -> [tag, *fields]                       <- [reply]
    DEALER  -> [b"", MAGIC + u64 BE id, tag, *fields] <- [b"", MAGIC + u64 BE id, reply]

Bodies (integers big-endian):

========== ==================================================== =======================================
tag        fields                                               reply
========== ==================================================== =======================================
``lookup`` u32 token count, u16 hash size, hashes concatenated  u32 hit tokens (Mooncake framing)
``reset``  (none)                                               ``b"\\x01"`` wiped / ``ERROR`` not
``prefix`` 1-byte key encoding, u16 key size, keys              u32 number of leading keys present
``exists`` 1-byte key encoding, u16 key size, keys              ``b"\\x01"`` + one byte (0/1) per key
========== ==================================================== =======================================

Any malformed or oversized body, an unknown tag, or a store failure is answered with ``ERROR``
(``b"\\x00"``): one byte, which no valid reply can be confused with (``lookup``/``prefix`` replies are 4
bytes, ``exists`` replies start with ``b"\\x01"``).

Keys. ``lookup`` hashes are raw bytes (vLLM block hashes). ``prefix``/``exists`` keys are bytes
(encoding ``b"x"``) or UTF-8 text such as multimodal hashes (encoding ``b"t"``). A key size of 0 means the
keys vary in length and each is preceded by its u16 length. The store key of a lookup key is
:func:`store_key`: ``prefix + key.hex()`` for bytes and ``prefix + key`` for text -- the same function on
the client (direct transport) and the server, so both agree with whatever wrote the values.

MAGIC starts with a non-ASCII byte, so an id frame can never be mistaken for a tag. Nothing received is
ever unpickled or evaluated: every field is a fixed-width integer or an opaque byte string.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from asyncconn.exceptions import LookupProtocolError

__all__ = [
    "DEFAULT_MAX_KEYS",
    "ERROR",
    "MAGIC",
    "OK",
    "Key",
    "Kind",
    "Query",
    "decode_u32",
    "encode_id",
    "encode_mooncake_lookup",
    "encode_query",
    "encode_u32",
    "pack_keys",
    "parse_body",
    "parse_id",
    "store_key",
    "unpack_keys",
]

Key = bytes | str

MAGIC = b"\xacLK1"
OK = b"\x01"
ERROR = b"\x00"
#: Keys accepted in one request (a 128k-token prompt in 16-token blocks is 8192 hashes).
DEFAULT_MAX_KEYS = 65536

TAG_LOOKUP = b"lookup"
TAG_RESET = b"reset"
TAG_PREFIX = b"prefix"
TAG_EXISTS = b"exists"
ENC_BYTES = b"x"
ENC_TEXT = b"t"

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_ID = struct.Struct(">Q")
_ID_SIZE = len(MAGIC) + _ID.size


class Kind(enum.Enum):
    """What a query asks for."""

    LOOKUP = "lookup"  # Mooncake: hit tokens of the leading present blocks
    RESET = "reset"
    PREFIX = "prefix"  # KV: how many leading keys are present
    EXISTS = "exists"  # EC: which keys are present


_TAGS = {TAG_LOOKUP: Kind.LOOKUP, TAG_RESET: Kind.RESET, TAG_PREFIX: Kind.PREFIX, TAG_EXISTS: Kind.EXISTS}


@dataclass(frozen=True, slots=True)
class Query:
    """A parsed request body."""

    kind: Kind
    keys: Sequence[Key] = ()
    token_count: int = 0


def store_key(prefix: str, key: Key) -> str:
    """The store key of a lookup key: ``prefix + hex`` for bytes (block hashes), ``prefix + key`` for text."""
    if isinstance(key, str):
        return prefix + key
    return prefix + key.hex()


# -- encoding (clients) --------------------------------------------------------------------------------
def encode_id(request_id: int) -> bytes:
    return MAGIC + _ID.pack(request_id)


def parse_id(frame: bytes) -> int | None:
    """The request id of an id frame, or ``None`` if the frame is not one."""
    if len(frame) != _ID_SIZE or not frame.startswith(MAGIC):
        return None
    value: int = _ID.unpack_from(frame, len(MAGIC))[0]
    return value


def pack_keys(keys: Sequence[Key]) -> tuple[bytes, bytes, bytes]:
    """(encoding, u16 key size, concatenated keys) for ``prefix``/``exists`` bodies."""
    if not keys:
        return ENC_BYTES, _U16.pack(0), b""
    if all(isinstance(k, str) for k in keys):
        enc, raw = ENC_TEXT, [k.encode() if isinstance(k, str) else k for k in keys]
    elif all(isinstance(k, bytes) for k in keys):
        enc, raw = ENC_BYTES, [k for k in keys if isinstance(k, bytes)]
    else:
        raise LookupProtocolError("lookup keys must be all bytes (block hashes) or all str (mm hashes)")
    size = len(raw[0])
    if 0 < size <= 0xFFFF and all(len(k) == size for k in raw):
        return enc, _U16.pack(size), b"".join(raw)
    if any(len(k) > 0xFFFF for k in raw):
        raise LookupProtocolError("a lookup key is longer than 65535 bytes")
    return enc, _U16.pack(0), b"".join(_U16.pack(len(k)) + k for k in raw)


def encode_query(kind: Kind, keys: Sequence[Key]) -> list[bytes]:
    """Body frames of a ``prefix`` or ``exists`` query."""
    tag = TAG_PREFIX if kind is Kind.PREFIX else TAG_EXISTS
    return [tag, *pack_keys(keys)]


def encode_mooncake_lookup(token_count: int, hashes: Sequence[bytes]) -> list[bytes]:
    """Body frames of a Mooncake ``lookup`` (what vLLM's MooncakeStoreConnector client sends)."""
    size = len(hashes[0]) if hashes else 0
    return [TAG_LOOKUP, _U32.pack(token_count), _U16.pack(size), b"".join(hashes)]


# -- decoding (server) ---------------------------------------------------------------------------------
def unpack_keys(enc: bytes, size: int, blob: bytes, max_keys: int) -> list[Key]:
    """Split a key blob; raise :class:`LookupProtocolError` if it is inconsistent or over ``max_keys``."""
    if enc not in (ENC_BYTES, ENC_TEXT):
        raise LookupProtocolError(f"unknown key encoding {enc!r}")
    raw: list[bytes]
    if size:
        if len(blob) % size:
            raise LookupProtocolError(f"{len(blob)} bytes of keys is not a multiple of the key size {size}")
        if len(blob) // size > max_keys:
            raise LookupProtocolError(f"{len(blob) // size} keys in one request (cap {max_keys})")
        raw = [blob[i : i + size] for i in range(0, len(blob), size)]
    else:
        raw = []
        view, pos = memoryview(blob), 0
        while pos < len(blob):
            if pos + 2 > len(blob):
                raise LookupProtocolError("truncated key length")
            (n,) = _U16.unpack_from(view, pos)
            if pos + 2 + n > len(blob):
                raise LookupProtocolError("a key runs past the end of the message")
            raw.append(blob[pos + 2 : pos + 2 + n])
            pos += 2 + n
            if len(raw) > max_keys:
                raise LookupProtocolError(f"more than {max_keys} keys in one request")
    if enc == ENC_BYTES:
        return list(raw)
    try:
        return [k.decode() for k in raw]
    except UnicodeDecodeError:
        raise LookupProtocolError("a text key is not valid UTF-8") from None


def _field(frame: bytes, st: struct.Struct, name: str) -> int:
    if len(frame) != st.size:
        raise LookupProtocolError(f"{name} must be {st.size} bytes, got {len(frame)}")
    value: int = st.unpack(frame)[0]
    return value


def parse_body(body: Sequence[bytes], *, max_keys: int = DEFAULT_MAX_KEYS) -> Query:
    """Parse a request body; raise :class:`LookupProtocolError` for anything malformed or oversized."""
    if not body:
        raise LookupProtocolError("empty request")
    kind = _TAGS.get(bytes(body[0]))
    if kind is None:
        raise LookupProtocolError(f"unknown tag {bytes(body[0][:16])!r}")
    if kind is Kind.RESET:
        if len(body) != 1:
            raise LookupProtocolError("reset takes no fields")
        return Query(kind)
    if kind is Kind.LOOKUP:
        if len(body) != 4:
            raise LookupProtocolError(f"lookup needs 4 frames, got {len(body)}")
        tokens = _field(body[1], _U32, "token count")
        size = _field(body[2], _U16, "hash size")
        blob = bytes(body[3])
        if size == 0:
            if blob:
                raise LookupProtocolError("hash size 0 with a non-empty hash payload")
            return Query(kind, (), tokens)
        return Query(kind, unpack_keys(ENC_BYTES, size, blob, max_keys), tokens)
    if len(body) != 4:
        raise LookupProtocolError(f"{kind.value} needs 4 frames, got {len(body)}")
    size = _field(body[2], _U16, "key size")
    return Query(kind, unpack_keys(bytes(body[1]), size, bytes(body[3]), max_keys))


def encode_u32(value: int) -> bytes:
    return _U32.pack(value)


def decode_u32(frame: bytes) -> int | None:
    """A 4-byte reply as an int; ``None`` for anything else (an error reply)."""
    if len(frame) != 4:
        return None
    value: int = _U32.unpack(frame)[0]
    return value
