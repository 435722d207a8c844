"""Names removed from a ``file://`` store's directories, by any process on this host (Linux inotify).

Why it exists: a ``file://`` store shared by several processes (the engines of one host, or an engine's
scheduler and its workers) is swept by each of them in turn, and values are deleted by hand or by tools.
A process hears what its own sweeps remove; without this, what the others removed was found only when a
value was next asked for (a lookup, a recheck). The kernel reports every removal from a watched directory
at once: the store's root and its 256 key directories are watched (a key directory made later is watched
when it appears), and each name deleted is handed to the callback on the loop thread.

What it cannot see: removals made on another host of a network filesystem (inotify reports what this
kernel does), a value renamed out of its directory (every write renames its temporary file into place:
watching renames would cost an event per save), and names removed while the kernel's queue was full
(``IN_Q_OVERFLOW``: counted in ``overflows``; a recheck of what is still there covers them). Where inotify
is missing or refuses (no Linux, the per-user watch limit reached), :meth:`DirectoryWatch.start` answers
False and nothing is heard.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Callable

__all__ = ["DirectoryWatch"]

log = logging.getLogger(__name__)

# <sys/inotify.h>
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_ONLYDIR = 0x1000000
_IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
# Deletions only: a rename out of a key directory is every write's temporary file (an event per save, for
# nothing); a value renamed away by hand is left to a recheck.
_KEY_DIR_MASK = _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR
_ROOT_MASK = _IN_CREATE | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR
_READ = 64 * 1024


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1, libc.inotify_add_watch  # noqa: B018 -- present, or AttributeError
    except (OSError, AttributeError):
        return None
    return libc


class DirectoryWatch:
    """The removals from ``root``'s key directories (its two-hex-digit subdirectories), as paths."""

    def __init__(self, root: str, on_gone: Callable[[list[str]], None]) -> None:
        self.root = root
        self._on_gone = on_gone
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._libc: ctypes.CDLL | None = None
        self._dirs: dict[int, str] = {}  # watch descriptor -> the directory it watches
        self._root_wd = -1
        self.overflows = 0  # times the kernel's queue was full and removals were lost

    # -- loop thread --------------------------------------------------------------------------------
    def start(self) -> bool:
        """Watch from now on (on the loop thread); False where inotify is missing or refuses."""
        libc = _libc()
        if libc is None:
            return False
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.warning("file store %r: cannot watch for removals: %s", self.root, _errno_text())
            return False
        self._libc, self._fd = libc, fd
        self._root_wd = self._add(self.root, _ROOT_MASK)
        if self._root_wd < 0:
            self.close()
            return False
        try:
            with os.scandir(self.root) as entries:
                names = [e.name for e in entries if _is_key_dir(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("file store %r: cannot watch for removals: %s", self.root, exc)
            self.close()
            return False
        for name in names:
            if self._add(f"{self.root}/{name}", _KEY_DIR_MASK) < 0:
                self.close()
                return False
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._readable)
        return True

    def close(self) -> None:
        """Stop watching (the kernel drops every watch with the descriptor)."""
        if self._fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd, self._loop = -1, None
        self._dirs.clear()

    def _add(self, path: str, mask: int) -> int:
        assert self._libc is not None
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))
        if wd < 0:
            log.warning("file store %r: cannot watch %r for removals: %s", self.root, path, _errno_text())
            return wd
        self._dirs[wd] = path
        return wd

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, _READ)
        except (BlockingIOError, InterruptedError):
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Act on one read's events (whole ones: the kernel never splits an event across reads)."""
        gone: list[str] = []
        pos = 0
        while pos + _EVENT.size <= len(data):
            wd, mask, _, size = _EVENT.unpack_from(data, pos)
            name = os.fsdecode(data[pos + _EVENT.size : pos + _EVENT.size + size].rstrip(b"\0"))
            pos += _EVENT.size + size
            if mask & _IN_Q_OVERFLOW:
                self.overflows += 1
                log.warning(
                    "file store %r: the kernel's queue of removals overflowed; some were missed", self.root
                )
                continue
            if mask & _IN_IGNORED:  # the directory itself went away, and its watch with it
                self._dirs.pop(wd, None)
                continue
            where = self._dirs.get(wd)
            if where is None or not name:
                continue
            if wd == self._root_wd:
                if mask & _IN_ISDIR and _is_key_dir(name):
                    self._add(f"{where}/{name}", _KEY_DIR_MASK)  # a key directory made since the start
                continue
            if mask & _IN_DELETE and not mask & _IN_ISDIR and not name.startswith("."):
                gone.append(f"{where}/{name}")  # dot names are writers' temporary files, not values
        if gone:
            try:
                self._on_gone(gone)
            except Exception:  # someone else's bug must not stop the watch
                log.exception("file store %r: removal callback failed", self.root)


def _is_key_dir(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _errno_text() -> str:
    code = ctypes.get_errno()
    return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"
