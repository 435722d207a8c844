"""``file:///path``: a shared directory as a store, for processes on one host (or a shared filesystem).

The embedded default of ``asyncconn demo``: no server to run. Blocking file I/O runs on a small bounded
thread pool, never on the loop thread. Each value is one file written to a temporary name and renamed into
place (``os.replace`` is atomic on POSIX), so two producers racing on one key leave one whole value and a
reader never sees a torn file. Reads can land straight in caller memory (``preadv``), which is how a 16 MiB
frame goes from the page cache into a pinned staging tensor with a single copy.

Key -> path: ``<root>/<2 hex of blake2b(key)>/<percent-encoded key>`` (a hash when that name is too long),
so any key string is a safe file name and no directory grows without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, TypeVar
from urllib.parse import quote

from asyncconn.backend import Buffer, Sink, StorageBackend, Value, checked_dests, checked_items, checked_keys
from asyncconn.exceptions import BackendError, BackendUnavailable, ConfigError
from asyncconn.url import Param, StoreURL

__all__ = ["FileBackend"]

T = TypeVar("T")
_MAX_NAME = 200
_TMP_PREFIX = ".tmp."
_PARALLEL_MIN = 4 << 20
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


def _split_ranges(size: int, parts: int) -> list[tuple[int, int]]:
    if size <= 0:
        return [(0, 0)]
    step = -(-size // max(parts, 1))
    return [(a, min(a + step, size)) for a in range(0, size, step)] or [(0, 0)]


def _slice_views(views: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The byte range [start, end) of the concatenation of ``views``, as views."""
    out: list[memoryview] = []
    pos = 0
    for view in views:
        lo, hi = max(start, pos), min(end, pos + view.nbytes)
        if lo < hi:
            out.append(view[lo - pos : hi - pos])
        pos += view.nbytes
    return out


def _pread_exact(fd: int, views: list[memoryview], offset: int, flags: int = 0) -> int:
    """preadv until ``views`` are full or the file ends; return the bytes read.

    With ``flags=RWF_NOWAIT`` a read that would wait for the disk raises BlockingIOError instead.
    """
    done = 0
    views = [v for v in views if v.nbytes]
    while views:
        n = os.preadv(fd, views, offset + done, flags) if flags else os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return done


def _parts(value: Value) -> list[memoryview]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [memoryview(value).cast("B")]
    return [memoryview(v).cast("B") for v in value]


class FileBackend(StorageBackend):
    """One file per key under a root directory; atomic renames; reads straight into caller buffers."""

    params: ClassVar[dict[str, Param]] = {
        "workers": Param.count(4, "threads doing blocking file I/O"),
        "fsync": Param.boolean(False, "fsync each file before renaming it into place (durability vs speed)"),
        "create": Param.boolean(True, "create the root directory if it does not exist"),
        "read_threads": Param.count(2, "threads that split one large (>= 4 MiB) read between them"),
        "inline_reads": Param.boolean(
            True, "read page-cached values on the loop (preadv RWF_NOWAIT); false on network filesystems"
        ),
    }
    reads_into: ClassVar[bool] = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        workers: int = 4,
        fsync: bool = False,
        create: bool = True,
        read_threads: int = 2,
        inline_reads: bool = True,
    ) -> None:
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise ConfigError(f"file:// root {str(self.root)!r} is not a directory")
        self.fsync = fsync
        self.read_threads = read_threads
        self.inline_reads = inline_reads
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="asyncconn-file")
        # Helpers of split reads live in their own pool so a read never waits behind another read's job.
        self._aux = ThreadPoolExecutor(
            max_workers=max(read_threads - 1, 1) * workers, thread_name_prefix="asyncconn-file-aux"
        )
        self._closed = False

    @classmethod
    async def from_url(cls, url: StoreURL) -> FileBackend:
        opts = url.options(cls.params)
        if url.host not in (None, "", "localhost"):
            raise ConfigError(f"file:// URL names host {url.host!r}; use file:///absolute/path")
        if not url.path or url.path == "/":
            raise ConfigError("file:// URL needs a directory path, e.g. file:///var/cache/asyncconn")
        try:
            return cls(
                url.path,
                workers=opts["workers"],
                fsync=opts["fsync"],
                create=opts["create"],
                read_threads=opts["read_threads"],
                inline_reads=opts["inline_reads"],
            )
        except OSError as exc:
            raise BackendUnavailable(f"file:// root {url.path!r} is not usable: {exc.strerror}") from exc

    # -- key layout ------------------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        name = quote(key, safe="")
        if len(name) > _MAX_NAME or name.startswith("."):
            name = "h-" + digest
        return self.root / digest[:2] / name

    # -- blocking halves (pool threads) ----------------------------------------------------------------
    def _write(self, key: str, value: Value) -> None:
        path = self.path_for(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in _parts(value):
                rest = part
                while rest.nbytes:
                    rest = rest[os.write(fd, rest) :]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _read(self, key: str) -> bytearray | None:
        try:
            fd = os.open(self.path_for(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            return buf if got == size else None  # shrank under us: only possible if replaced mid-read
        finally:
            os.close(fd)

    def _read_into(
        self, key: str, dests: Sequence[memoryview], sink: Sink | None, nowait: bool = False
    ) -> int | None:
        try:
            fd = os.open(self.path_for(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size != sum(d.nbytes for d in dests):
                return size
            views = [d.cast("B") for d in dests]
            got = self._read_split(fd, views, size, _RWF_NOWAIT if nowait else 0)
            if got != size:
                return got  # short only if the file was truncated while open
            if sink is not None:
                # Checksumming here, on the pool thread right after the read, keeps the pass off the loop
                # and runs it while the bytes are still warm in cache. (Overlapping it with the read on a
                # second thread measured slower: xxhash holds the GIL and the hand-offs cost more.)
                for view in views:
                    sink(view)
            return size
        finally:
            os.close(fd)

    def _read_split(self, fd: int, views: list[memoryview], size: int, flags: int = 0) -> int:
        """Split one large read over threads: the page-cache copy is the cost and preadv drops the GIL.

        The calling thread reads the first range itself. With ``flags=RWF_NOWAIT`` every range either comes
        from the page cache or raises BlockingIOError (after all helpers have stopped).
        """
        ranges = _split_ranges(size, self.read_threads if size >= _PARALLEL_MIN else 1)
        helpers = [
            self._aux.submit(_pread_exact, fd, _slice_views(views, a, b), a, flags) for a, b in ranges[1:]
        ]
        try:
            a, b = ranges[0]
            got = _pread_exact(fd, _slice_views(views, a, b), a, flags)
        finally:
            concurrent.futures.wait(helpers)  # never let fd close under a running helper
        return got + sum(h.result() for h in helpers)

    def _delete(self, key: str) -> bool:
        try:
            os.unlink(self.path_for(key))
        except FileNotFoundError:
            return False
        return True

    # -- async contract --------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed:
            raise BackendUnavailable("file backend is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except OSError as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: OSError) -> BackendError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            return BackendUnavailable(f"file store {str(self.root)!r}: {exc.strerror}")
        return BackendError(f"file store {str(self.root)!r}: {exc}")

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        checked_items(items)
        await asyncio.gather(*(self._run(self._write, k, v) for k, v in items))

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        found = await asyncio.gather(*(self._run(self._read, k) for k in keys))
        return [(b,) if b is not None else None for b in found]

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        checked_dests(key, dests)
        if self.inline_reads and _RWF_NOWAIT:
            # A value already in the page cache is read right here: preadv(RWF_NOWAIT) never waits for the
            # disk (it raises instead), and skipping the round trip through a pool thread is most of the cost
            # of a cached read. Anything not cached goes to the pool below.
            try:
                return self._read_into(key, dests, sink, nowait=True)
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # e.g. a filesystem without NOWAIT
                    raise self._translate(exc) from exc
                self.inline_reads = False
        # A pool thread cannot be stopped mid-read. If the caller is cancelled (a timeout), wait for the
        # read to finish before letting the cancellation through, so the caller never recycles a buffer
        # that a thread is still writing into. Local reads are bounded; the wait is short.
        job = asyncio.ensure_future(self._run(self._read_into, key, dests, sink))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])
            raise

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        checked_keys(keys)
        return await self._run(lambda: [self.path_for(k).is_file() for k in keys])

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        return await self._run(lambda: sum(self._delete(k) for k in keys))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._aux.shutdown(wait=False, cancel_futures=True)
