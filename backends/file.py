"""``file:///path``: a shared directory as a store, for processes on one host (or a shared filesystem).

The embedded default of ``asyncconn demo``: no server to run. Blocking file I/O runs on a small bounded
thread pool, never on the loop thread. Each value is one file written to a temporary name and renamed into
place (``os.replace`` is atomic on POSIX), so two producers racing on one key leave one whole value and a
reader never sees a torn file. Reads can land straight in caller memory (``preadv``), which is how a 16 MiB
frame goes from the page cache into a pinned staging tensor with a single copy.

Key -> path: ``<root>/<2 hex of blake2b(key)>/<percent-encoded key>`` (a hash when that name is too long),
so any key string is a safe file name and no directory grows without bound.

Bounded store (``max_bytes``, ``max_age``): a value's file keeps two times. Its modification time is when it
was written; its access time is its *last use*, which a write sets and a read sets again (``utime`` of the
access time only, at most once a second per value; the kernel may move it too, on any read). A sweep lists
the directory, deletes values older than ``max_age`` -- counted from the write, or from the last use with
``refresh_on_hit`` -- and then, when the values add up to more than ``max_bytes``, the least recently used
ones until they fit in 90% of it. Everything it goes by is in the directory itself, so processes sharing it
(E and PD instances) agree on what was used last, and a lock file lets one of them sweep at a time. A value
past ``max_age`` is a miss at once, whether or not a sweep has deleted it yet. Keys the sweep removed are
handed to ``on_removed`` (on the loop thread) when their names can be read back from the file names; after
:meth:`FileBackend.watch_removals`, every key removed from the directory by any process on this host is
(:mod:`backends.dirwatch`).

Temporary files: a writer holds an exclusive ``flock`` on its temporary file until it has been renamed into
place, and the kernel drops that lock when the writer dies. A sweep removes every temporary file whose lock
it can take: a killed writer's leftovers go at the next sweep (one runs when the store is opened, then every
``sweep_interval``), a live writer's are never touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import logging
import operator
import os
import re
import stat
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar
from urllib.parse import quote, unquote

from asyncconn.backend import (
    NOT_CACHED,
    Buffer,
    IntoRead,
    RemovedHook,
    Sink,
    StorageBackend,
    Value,
    checked_dests,
    checked_items,
    checked_keys,
    feed_sink,
    value_nbytes,
)
from asyncconn.exceptions import BackendError, BackendUnavailable, ConfigError
from asyncconn.url import Param, StoreURL

from .dirwatch import DirectoryWatch

__all__ = ["FileBackend", "SweepReport"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_NAME = 200
_TMP_PREFIX = ".tmp."
#: At the root, next to the 256 key directories; its flock lets one process sweep at a time.
_SWEEP_LOCK = ".sweep.lock"
#: A sweep that finds the store over ``max_bytes`` evicts down to this fraction of it, so that the next
#: writes do not each start another sweep.
_LOW_WATER = 0.9
#: A read records a use only when the last one recorded is older than this (one ``utime`` per second at most).
_TOUCH_NS = 1_000_000_000
_PARALLEL_MIN = 4 << 20
#: Values written by one pool job, in bytes (see ``_groups``).
_GROUP_BYTES = 1 << 20
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)
#: Keys whose paths a backend remembers (see ``FileBackend._path``): ~200 bytes each.
_PATH_MEMO = 1 << 16
#: The file name of a key whose quoted name is too long or starts with a dot (see ``_make_path``).
_HASHED = re.compile(r"h-[0-9a-f]{32}")


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


def _pread_exact(fd: int, views: list[memoryview], offset: int, flags: int = 0, total: int = -1) -> int:
    """preadv until ``views`` are full or the file ends; return the bytes read.

    With ``flags=RWF_NOWAIT`` a read that would wait for the disk raises BlockingIOError instead.
    ``total``: the views' bytes, when the caller has them.
    """
    if total < 0:
        total = sum(v.nbytes for v in views)
    done = 0
    while done < total:  # once, for a page-cached read
        rest = _slice_views(views, done, total) if done else views
        n = os.preadv(fd, rest, offset + done, flags) if flags else os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
    return done


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep found and did (``None`` from :meth:`FileBackend.sweep` when another process held it)."""

    #: bytes of value files (and of temporary files still being written) left under the root
    stored_bytes: int
    #: values deleted to bring the store under ``max_bytes``, least recently used first
    evicted: int
    #: temporary files of dead writers removed
    temp_removed: int
    #: values deleted because they were older than ``max_age``
    expired: int = 0
    #: keys of the values evicted or expired (those whose key is known: see ``_keys_of``)
    removed: tuple[str, ...] = ()


def _groups(items: Sequence[tuple[str, Value]], sizes: Sequence[int]) -> list[list[tuple[str, Value]]]:
    """``items`` cut into consecutive groups of about ``_GROUP_BYTES``, one pool job each.

    A job per value costs a thread hand-off each way (two GIL hand-offs and wake-ups, several times the
    write of a small value); one job for a whole batch would write large values one after another. Groups
    keep small values together and still spread large ones over the pool's threads.
    """
    groups: list[list[tuple[str, Value]]] = []
    size = 0
    for item, nbytes in zip(items, sizes, strict=True):
        if not groups or size + nbytes > _GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def _last_use(st: os.stat_result) -> int:
    """When the value was last written or read (ns): the later of its access and modification times."""
    return max(st.st_atime_ns, st.st_mtime_ns)


def _touch(fd: int, st: os.stat_result) -> None:
    """Record a read of the open file as its last use: its access time (see the module docstring).

    The modification time is left alone: it is the write time ``max_age`` counts from.
    """
    now = time.time_ns()
    if now - _last_use(st) >= _TOUCH_NS:
        # Another user's file (no write permission) cannot be touched: that read is not recorded.
        with contextlib.suppress(OSError):
            os.utime(fd, ns=(now, st.st_mtime_ns))


def _reap_temp(path: str) -> bool:
    """Remove a temporary file whose writer is gone (its flock is free); False when it is alive or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is alive and still writing
        try:
            os.unlink(path)  # gone already when the writer renamed it into place meanwhile
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


#: A destination as flat bytes (a byte view's ``len`` is its size).
_as_bytes = operator.methodcaller("cast", "B")


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
        "read_threads": Param.count(
            2, "threads that split one large (>= 4 MiB) read, or share one batch of reads, between them"
        ),
        "inline_reads": Param.boolean(
            True, "read page-cached values on the loop (preadv RWF_NOWAIT); false on network filesystems"
        ),
        "max_bytes": Param.size(
            0, "bound on the stored values; the least recently used (read or written) go first (0: none)"
        ),
        "max_age": Param.duration(
            0.0, "values written longer ago than this are misses, deleted by the next sweep (0: none)"
        ),
        "refresh_on_hit": Param.boolean(False, "max_age counts from a value's last read, not its write"),
        "sweep_interval": Param.duration(
            30.0, "how often dead writers' temporary files are removed and max_bytes and max_age enforced"
        ),
    }
    reads_into: ClassVar[bool] = True
    batch_reads: ClassVar[bool] = True
    cached_reads: ClassVar[bool] = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        workers: int = 4,
        fsync: bool = False,
        create: bool = True,
        read_threads: int = 2,
        inline_reads: bool = True,
        max_bytes: int = 0,
        max_age: float = 0.0,
        refresh_on_hit: bool = False,
        sweep_interval: float = 30.0,
        on_removed: RemovedHook | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ConfigError("file:// URL: parameter 'max_bytes' must be >= 0")
        if max_age < 0:
            raise ConfigError("file:// URL: parameter 'max_age' must be >= 0")
        if not sweep_interval > 0:
            raise ConfigError("file:// URL: parameter 'sweep_interval' must be > 0")
        self.root = Path(root)
        self._root = str(self.root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise ConfigError(f"file:// root {str(self.root)!r} is not a directory")
        self.fsync = fsync
        self._paths: dict[str, str] = {}  # key -> path; read and written from any thread (single dict ops)
        self.read_threads = read_threads
        self.inline_reads = inline_reads
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.refresh_on_hit = refresh_on_hit
        self._max_age_ns = round(max_age * 1e9)
        self.sweep_interval = sweep_interval
        self.on_removed = on_removed
        # Loop-thread counts of what this process's sweeps removed, since the store was opened.
        self.evicted = 0
        self.expired = 0
        # Loop-thread state: the store's size at the last sweep plus what this process wrote since.
        self._estimate = 0
        self._wake: asyncio.Event | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._watch: DirectoryWatch | None = None  # loop-owned, see watch_removals
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
            backend = cls(
                url.path,
                workers=opts["workers"],
                fsync=opts["fsync"],
                create=opts["create"],
                read_threads=opts["read_threads"],
                inline_reads=opts["inline_reads"],
                max_bytes=opts["max_bytes"],
                max_age=opts["max_age"],
                refresh_on_hit=opts["refresh_on_hit"],
                sweep_interval=opts["sweep_interval"],
            )
        except OSError as exc:
            raise BackendUnavailable(f"file:// root {url.path!r} is not usable: {exc.strerror}") from exc
        try:
            await backend.sweep()  # leftovers of writers killed while no process had the store open
        except BaseException:
            await backend.close()
            raise
        backend._start_sweeper()
        return backend

    # -- key layout ------------------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        """Where ``key``'s value lives (see the module docstring)."""
        return Path(self._path(key))

    def _path(self, key: str) -> str:
        """``path_for`` as a string, remembered for the last ``_PATH_MEMO`` keys: a prefix's lookup, its
        load and the next request's lookup ask for the same keys, and building a path (a hash and a quote)
        was a visible share of each value's Python on a pool thread."""
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) >= _PATH_MEMO:
                self._paths.clear()  # a bound, not an LRU: a dict's get stays the whole cost of a hit
            path = self._paths[key] = self._make_path(key)
        return path

    def _make_path(self, key: str) -> str:
        """The path, built without pathlib: a step's saves and loads ask for hundreds, and pathlib's joins
        cost more than the write of a small value (a third of the pool's CPU in a decode)."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        name = quote(key, safe="")
        if len(name) > _MAX_NAME or name.startswith("."):
            name = "h-" + digest
        return f"{self._root}/{digest[:2]}/{name}"

    # -- blocking halves (pool threads) ----------------------------------------------------------------
    def _write(self, key: str, value: Value) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        try:
            tmp, fd = self._open_temp(directory)
        except FileNotFoundError:  # the key's directory, made on first use (not a mkdir per write)
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory)
            tmp, fd = self._open_temp(directory)
        try:
            for part in _parts(value):
                rest = part
                while rest.nbytes:
                    rest = rest[os.write(fd, rest) :]
            if self.fsync:
                os.fsync(fd)
            os.replace(tmp, path)  # still locked: a sweep never takes a file being renamed
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)  # drops the lock

    def _write_all(self, items: Sequence[tuple[str, Value]]) -> None:
        for key, value in items:
            self._write(key, value)

    @staticmethod
    def _open_temp(directory: str) -> tuple[str, int]:
        """A new temporary file, created and flock'ed: the lock tells sweeps its writer is alive.

        A sweep may take the lock in the instant between creation and ``flock`` and remove the file; the
        writer then holds the lock of a file with no name (``st_nlink == 0``) and starts again.
        """
        while True:
            tmp = f"{directory}/{_TMP_PREFIX}{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweep checks this very file
                if os.fstat(fd).st_nlink:
                    return tmp, fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _read(self, key: str) -> bytearray | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if self._expired(st):
                return None
            size = st.st_size
            _touch(fd, st)
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
        self,
        key: str,
        dests: Sequence[memoryview],
        sink: Sink | None,
        nowait: bool = False,
        split: bool = True,
    ) -> int | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if self._expired(st):
                return None
            size = st.st_size
            views = list(map(_as_bytes, dests))  # map, not a loop: a value read in place has ~15 pieces
            if size != sum(map(len, views)):
                return size
            _touch(fd, st)
            flags = _RWF_NOWAIT if nowait else 0
            if split:
                got = self._read_split(fd, views, size, flags)
            else:
                got = _pread_exact(fd, views, 0, flags, size)
            if got != size:
                return got  # short only if the file was truncated while open
            if sink is not None:
                # Checksumming here, on the pool thread right after the read, keeps the pass off the loop
                # and runs it while the bytes are still warm in cache. (Overlapping it with the read on a
                # second thread measured slower: xxhash holds the GIL and the hand-offs cost more.)
                feed_sink(sink, views)
            return size
        finally:
            os.close(fd)

    def _read_one(self, read: IntoRead, cached_only: bool, split: bool) -> int | None:
        key, dests, sink = read
        if not cached_only:
            return self._read_into(key, dests, sink, split=split)
        if not (self.inline_reads and _RWF_NOWAIT):  # this filesystem (or platform) cannot say
            return NOT_CACHED
        try:
            return self._read_into(key, dests, sink, nowait=True, split=split)
        except BlockingIOError:
            return NOT_CACHED
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self.inline_reads = False
            return NOT_CACHED

    def _read_many(self, reads: Sequence[IntoRead], cached_only: bool = False) -> list[int | None]:
        """Read a batch on this pool thread and ``read_threads - 1`` helpers, each taking the next value.

        Why one batch shared, not one batch per thread: the page-cache copies drop the GIL but the checksum
        of a value's pieces holds it, so two threads given half the values each ended milliseconds apart on
        a 2-core engine (whichever got the GIL less), and the load lasts as long as the later one. Taking
        the next value ends them within one value of each other. Values are not split here (``split``):
        the threads already run side by side, and a helper must never wait for another helper.
        """
        out: list[int | None] = [None] * len(reads)
        if len(reads) < 2 or self.read_threads <= 1:
            for i, read in enumerate(reads):
                out[i] = self._read_one(read, cached_only, split=True)
            return out
        order = iter(range(len(reads)))  # shared: each next() hands one index to one thread (the GIL)
        failed: list[BaseException] = []

        def work() -> None:
            for i in order:
                if failed:
                    return
                try:
                    out[i] = self._read_one(reads[i], cached_only, split=False)
                except BaseException as exc:
                    failed.append(exc)
                    return

        helpers = [self._aux.submit(work) for _ in range(min(self.read_threads, len(reads)) - 1)]
        try:
            work()
        finally:
            concurrent.futures.wait(helpers)  # never return while a helper still writes a destination
        if failed:
            raise failed[0]
        return out

    def _read_split(self, fd: int, views: list[memoryview], size: int, flags: int = 0) -> int:
        """Split one large read over threads: the page-cache copy is the cost and preadv drops the GIL.

        The calling thread reads the first range itself. With ``flags=RWF_NOWAIT`` every range either comes
        from the page cache or raises BlockingIOError (after all helpers have stopped).
        """
        if size < _PARALLEL_MIN or self.read_threads <= 1:
            return _pread_exact(fd, views, 0, flags, size)
        ranges = _split_ranges(size, self.read_threads)
        helpers = [
            self._aux.submit(_pread_exact, fd, _slice_views(views, a, b), a, flags) for a, b in ranges[1:]
        ]
        try:
            a, b = ranges[0]
            got = _pread_exact(fd, _slice_views(views, a, b), a, flags)
        finally:
            concurrent.futures.wait(helpers)  # never let fd close under a running helper
        return got + sum(h.result() for h in helpers)

    def _expired(self, st: os.stat_result, now: int = 0) -> bool:
        """Whether a value is past ``max_age``: since its write, or its last use with ``refresh_on_hit``."""
        if not self._max_age_ns:
            return False
        since = _last_use(st) if self.refresh_on_hit else st.st_mtime_ns
        return (now or time.time_ns()) - since > self._max_age_ns

    def _exists(self, key: str) -> bool:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and not self._expired(st)

    def _key_of(self, path: str) -> str | None:
        """The key whose value lives at ``path`` when the file name gives it back; None for a hashed name
        (a digest: only a key this process has built the path of names it, see ``_keys_of``)."""
        name = os.path.basename(path)
        if _HASHED.fullmatch(name):
            return None
        key = unquote(name)
        return key if self._make_path(key) == path else None

    def _delete(self, key: str) -> bool:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def _sweep(self) -> SweepReport | None:
        """(pool thread) Remove dead writers' temporary files; evict down to the bound. None: locked."""
        lock = os.open(self.root / _SWEEP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # another process (or this one) is sweeping right now
            return self._sweep_locked()
        finally:
            os.close(lock)

    def _sweep_locked(self) -> SweepReport:
        stored = temp_removed = 0
        values: list[tuple[int, int, str, int]] = []  # last use, size, path, inode
        expired: list[tuple[int, str, int]] = []  # size, path, inode
        now = time.time_ns()
        with os.scandir(self.root) as top:
            subdirs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            try:
                with os.scandir(subdir) as entries:
                    listed = list(entries)
            except FileNotFoundError:
                continue
            for entry in listed:
                if entry.name.startswith(_TMP_PREFIX) and _reap_temp(entry.path):
                    temp_removed += 1
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                stored += st.st_size
                if not entry.name.startswith(_TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                    if self._expired(st, now):
                        expired.append((st.st_size, entry.path, st.st_ino))
                    else:
                        values.append((_last_use(st), st.st_size, entry.path, st.st_ino))
        removed: list[str] = []
        for size, path, inode in expired:
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                stored -= size
                continue
            if st.st_ino != inode or not self._expired(st):
                continue  # rewritten (or, with refresh_on_hit, read) since the listing: keep it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
            stored -= size
        n_expired = len(removed)
        if self.max_bytes and stored > self.max_bytes:
            target = int(self.max_bytes * _LOW_WATER)
            values.sort()
            for used, size, path, inode in values:
                if stored <= target:
                    break
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    stored -= size
                    continue
                if st.st_ino != inode or _last_use(st) != used:
                    continue  # rewritten or read since the listing: used now, keep it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
                stored -= size
        keys = self._keys_of(removed)
        return SweepReport(stored, len(removed) - n_expired, temp_removed, n_expired, keys)

    def _keys_of(self, paths: list[str]) -> tuple[str, ...]:
        """The keys of removed values: read back from the file names, else from the paths this process
        has built (the memo, reversed only when a name does not give its key back: up to 65,536 entries,
        too many to reverse for every removal a watch hears)."""
        keys: list[str] = []
        known: dict[str, str] | None = None
        for path in paths:
            key = self._key_of(path)
            if key is None:
                if known is None:  # a copy in one C call: other threads add to the memo meanwhile
                    known = {path: key for key, path in self._paths.copy().items()}
                key = known.get(path)
            if key is not None:
                keys.append(key)
        return tuple(keys)

    async def sweep(self) -> SweepReport | None:
        """Run one sweep now (see the module docstring); ``None`` when another one held the lock."""
        written = self._estimate
        report = await self._run(self._sweep)
        if report is not None:
            # What this process wrote while the sweep ran may or may not be in its count: assume not.
            self._estimate = report.stored_bytes + max(0, self._estimate - written)
            self.evicted += report.evicted
            self.expired += report.expired
            if report.removed and self._watch is None:  # watched: the watch hears them too
                self._removed(report.removed)
        return report

    def watch_removals(self) -> bool:
        """(loop) From now on ``on_removed`` hears every value removed from the directory by any process on
        this host (swept, deleted, unlinked by hand), not only this process's sweeps; False where it
        cannot be watched (:mod:`backends.dirwatch`), and then it hears what it heard before."""
        if self._watch is None and not self._closed:
            watch = DirectoryWatch(self._root, lambda paths: self._removed(self._keys_of(paths)))
            if watch.start():
                self._watch = watch
        return self._watch is not None

    def unwatch_removals(self) -> None:
        """(loop) Back to hearing this process's sweeps only."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _removed(self, keys: Sequence[str]) -> None:
        if keys and self.on_removed is not None:
            try:
                self.on_removed(keys)
            except Exception:  # someone else's bug must not stop the sweeps
                log.exception("file store %r: on_removed hook failed", str(self.root))

    def _start_sweeper(self) -> None:
        self._wake = asyncio.Event()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        assert self._wake is not None
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.sweep_interval)
            self._wake.clear()
            try:
                report = await self.sweep()
            except BackendError as exc:
                log.warning("file store %r: sweep failed: %s", str(self.root), exc)
                continue
            if report is not None and (report.evicted or report.expired or report.temp_removed):
                log.info(
                    "file store %r: %d values evicted, %d expired, %d dead writers' temporary files "
                    "removed, %d bytes",
                    str(self.root), report.evicted, report.expired, report.temp_removed,
                    report.stored_bytes,
                )  # fmt: skip

    def _wrote(self, nbytes: int) -> None:
        """(loop) Count a write against the bound; past it, wake the sweeper at once."""
        self._estimate += nbytes
        if self.max_bytes and self._estimate > self.max_bytes and self._wake is not None:
            self._wake.set()

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
        sizes = [value_nbytes(v) for _, v in items]
        if self.max_bytes and any(size > self.max_bytes for size in sizes):
            raise BackendError(
                f"file store {str(self.root)!r}: a value of {max(sizes)} bytes is over max_bytes"
            )
        try:
            await asyncio.gather(*(self._run(self._write_all, group) for group in _groups(items, sizes)))
        finally:
            self._wrote(sum(sizes))

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
        return await self._until_done(self._run(self._read_into, key, dests, sink))

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """The whole batch in one pool job: its reads and checksums run on a pool thread (``preadv`` and
        xxh3 of large buffers drop the GIL), the loop pays one hand-off, and a caller that sends several
        batches at once gets them read in parallel by the pool's threads. ``cached_only`` reads with
        ``preadv(RWF_NOWAIT)``, which copies from the page cache or refuses (``inline_reads=false`` refuses
        every value)."""
        for key, dests, _ in reads:
            checked_dests(key, dests)
        if not reads:
            return []
        return await self._until_done(self._run(self._read_many, reads, cached_only))

    @staticmethod
    async def _until_done(read: Awaitable[T]) -> T:
        """Await a pool read; if cancelled (a timeout), wait for it to finish before letting the
        cancellation through. A pool thread cannot be stopped mid-read, and the caller must never recycle a
        buffer that a thread is still writing into. Local reads are bounded; the wait is short."""
        job = asyncio.ensure_future(read)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])
            raise

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        checked_keys(keys)
        return await self._run(lambda: [self._exists(k) for k in keys])

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        return await self._run(lambda: sum(self._delete(k) for k in keys))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.unwatch_removals()
            if self._sweeper is not None:
                self._sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._sweeper
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._aux.shutdown(wait=False, cancel_futures=True)
