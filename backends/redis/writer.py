"""The chunked write fast path: one hand-built ``MULTI ... EXEC`` per value, sent un-joined, on a raw socket.

Why it exists: through redis-py a chunked ``put`` of a few MiB stayed behind ``redis-benchmark``'s ``SET``
of the same size. Here the whole transaction is a handful of small RESP header ``bytes`` around memoryviews
of the caller's tensor, written with one ``writelines`` on one of
``reader.ChunkReader``'s connections; its replies are parsed by the same protocol. The figures are in
docs/benchmarks.md.

The transaction replaces the value's one key (see ``layout``): ``UNLINK`` (the server
frees the old value off its main thread), ``HSET`` of the manifest and every chunk, ``PEXPIRE`` when the
store has a TTL. Nothing is left behind to reap, and sending it twice (a retry after a dropped connection)
writes the same version again.

Pure request building, no I/O: :meth:`ChunkReader.execute` sends what is built here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import MANIFEST_FIELD

__all__ = ["Transaction", "chunked_write"]

#: Arguments up to this size are copied into the small header buffers (a frame header, a manifest);
#: larger ones are sent from the caller's memory as they are.
_INLINE_ARG = 4096


@dataclass(frozen=True, slots=True)
class Transaction:
    """A chunked write ready to send: the buffers, how many replies to read, how many items they hold."""

    payload: list[bytes | memoryview]
    #: top-level replies: MULTI's OK, a QUEUED per command, EXEC's array
    replies: int
    #: items once EXEC's array is flattened (one integer per command): what a committed write returns
    items: int


class _Resp:
    """Accumulates RESP commands as few small ``bytes`` around the large arguments, which are not copied."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self._small = bytearray()

    def command(self, *args: bytes | memoryview) -> None:
        small = self._small
        small += b"*%d\r\n" % len(args)
        for arg in args:
            size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            small += b"$%d\r\n" % size
            if size > _INLINE_ARG:
                self.parts.append(bytes(small))
                self.parts.append(arg)
                small.clear()
            else:
                small += arg
            small += b"\r\n"

    def finish(self) -> list[bytes | memoryview]:
        if self._small:
            self.parts.append(bytes(self._small))
            self._small.clear()
        return self.parts


def chunked_write(
    head: str,
    manifest: bytes,
    fields: Sequence[str],
    chunks: Sequence[memoryview],
    *,
    px: int | None,
) -> Transaction:
    """``MULTI``, ``UNLINK head``, ``HSET head m <manifest> <field> <chunk>...``, ``PEXPIRE``, ``EXEC``.

    ``PEXPIRE`` only when ``px`` is given (the store's TTL).
    """
    out = _Resp()
    out.command(b"MULTI")
    out.command(b"UNLINK", head.encode())
    pairs: list[bytes | memoryview] = [MANIFEST_FIELD.encode(), manifest]
    for name, chunk in zip(fields, chunks, strict=True):
        pairs += (name.encode(), chunk)
    out.command(b"HSET", head.encode(), *pairs)
    queued = 2
    if px is not None:
        out.command(b"PEXPIRE", head.encode(), b"%d" % px)
        queued += 1
    out.command(b"EXEC")
    # MULTI's +OK, a +QUEUED per command, then EXEC's array (one integer per command)
    return Transaction(out.finish(), replies=queued + 2, items=1 + 2 * queued)
