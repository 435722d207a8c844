"""The chunked write fast path: one hand-built ``MULTI ... EXEC`` per value, sent un-joined, on a raw socket.

Why it exists: through redis-py a chunked 4 MiB ``put`` (header + four 1 MiB chunks + manifest in one
transaction) held ~0.77x of ``redis-benchmark``'s ``SET`` of the same size, and the replaced version's
chunks cost one more round trip (an ``UNLINK`` after ``EXEC``). Here the whole transaction is a handful of
small RESP header ``bytes`` around memoryviews of the caller's tensor, written with one ``writelines``
on one of :class:`backends._redis_reader.ChunkReader`'s connections; its replies are parsed by the same
protocol. Measured in docs/redis.md.

The replaced chunks are unlinked *inside* the transaction when this process wrote the key last:
:class:`RecentVersions` remembers the manifest last written per key (bounded). That is only a prediction,
and it is safe either way: a version this process wrote is never referenced again once the key has been
set to another one -- and this very transaction sets it -- so unlinking its chunks can only remove garbage.
When the ``SET ... GET`` shows another version was replaced (another writer's, or one forgotten), the
caller reaps it afterwards, as before.

Pure request building and bookkeeping, no I/O: :meth:`ChunkReader.execute` sends what is built here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backends._redis_layout import Manifest

__all__ = ["RecentVersions", "Transaction", "chunked_write"]

#: Arguments up to this size are copied into the small header buffers (a frame header, a manifest);
#: larger ones are sent from the caller's memory as they are.
_INLINE_ARG = 4096


@dataclass(frozen=True, slots=True)
class Transaction:
    """A chunked write ready to send: the buffers, how many replies to read, where the old value is."""

    payload: list[bytes | memoryview]
    replies: int
    replaced_at: int


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
    names: Sequence[str],
    chunks: Sequence[memoryview],
    *,
    px: int | None,
    stale: Sequence[str] = (),
) -> Transaction:
    """``MULTI``, ``SET`` of every chunk, ``SET head manifest GET``, ``UNLINK stale`` (if any), ``EXEC``.

    The manifest is set after its chunks inside one transaction, so no reader can see it before them;
    ``GET`` hands back the value it replaced (:attr:`Transaction.replaced_at` indexes it in the flattened
    replies: ``OK``, one ``QUEUED`` per command, then ``EXEC``'s array).
    """
    expiry = (b"PX", b"%d" % px) if px is not None else ()
    out = _Resp()
    out.command(b"MULTI")
    for name, chunk in zip(names, chunks, strict=True):
        out.command(b"SET", name.encode(), chunk, *expiry)
    out.command(b"SET", head.encode(), manifest, *expiry, b"GET")
    queued = len(names) + 1
    if stale:
        out.command(b"UNLINK", *(name.encode() for name in stale))
        queued += 1
    out.command(b"EXEC")
    # MULTI's +OK, a +QUEUED per command, then EXEC's array: the chunks' OKs and the manifest's old value
    return Transaction(out.finish(), replies=queued + 2, replaced_at=1 + queued + len(names))


class RecentVersions:
    """The manifest this process last wrote under each key, for the most recent ``capacity`` keys.

    Bounded because vLLM writes many content-hash keys once each; a key that fell out is no loss: the
    replaced version comes back from ``SET ... GET`` and is reaped after the write instead of inside it.
    Owned by the loop thread, like the connections.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._last: dict[str, Manifest] = {}

    def get(self, head: str) -> Manifest | None:
        return self._last.get(head)

    def remember(self, head: str, manifest: Manifest) -> None:
        self._last.pop(head, None)
        if len(self._last) >= self._capacity:
            del self._last[next(iter(self._last))]
        self._last[head] = manifest

    def forget(self, head: str) -> None:
        self._last.pop(head, None)

    def __len__(self) -> int:
        return len(self._last)
