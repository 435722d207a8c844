"""A byte-bounded pool of host staging buffers (pinned when a GPU is present), reused by size class.

Pinning memory is slow (a page-locking syscall per allocation, milliseconds for large buffers) and pinned
memory is a scarce host resource, so staging buffers are allocated once and reused. Requests are rounded up
to a power-of-two size class; a released buffer goes back on its class's free list. The pool never holds more
than ``capacity`` bytes: when a new buffer does not fit, idle buffers of other classes are dropped to make
room, and if the bytes are still taken by buffers in use :meth:`PinnedPool.acquire` answers ``None`` --
"not now" -- and the caller keeps its work queued until a later poll (back-pressure, never an unbounded
allocation). A request larger than the whole capacity can never be served and raises :class:`PoolTooSmall`.

The pool belongs to the worker thread that owns the transfer engines (one pool may serve a loader and a save
tracker on that thread); it has no locks. Buffers written by the runtime loop (fetches) are only returned by
the worker after the loop is provably done with them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from asyncconn.exceptions import PoolTooSmall, TransferError
from asyncconn.transfer._device import CpuDevice, TransferDevice

__all__ = ["DEFAULT_CAPACITY", "MIN_CLASS", "PinnedBuffer", "PinnedPool"]

DEFAULT_CAPACITY = 1 << 30  # 1 GiB of staging: a few hundred embeddings or KV chunks in flight
MIN_CLASS = 1 << 12  # one page: smaller requests share the 4 KiB class


class PinnedBuffer:
    """One staging buffer on loan from a :class:`PinnedPool`. Give it back with :meth:`PinnedPool.release`.

    Its memory may be allocated on first use (``storage``) rather than by the pool: see ``lazy`` in
    :meth:`PinnedPool.acquire`.
    """

    __slots__ = ("_make", "_out", "_storage", "_view", "nbytes", "size_class")

    def __init__(
        self, storage: torch.Tensor | None, size_class: int, make: Callable[[], torch.Tensor] | None = None
    ) -> None:
        if storage is None and make is None:
            raise TransferError("a PinnedBuffer needs its storage or a way to make it")
        self._storage = storage  # 1-D uint8 of ``size_class`` bytes
        self._make = make
        self.size_class = size_class
        self.nbytes = 0  # bytes the current borrower asked for
        self._out = False
        # The last view made, by (dtype, shape): a loader views the same buffer as the same value shape on
        # the loop (the read) and on the worker (the hand-over), load after load; three tensor ops each time
        # otherwise. Either thread may replace it; any entry is a correct view of its key.
        self._view: tuple[torch.dtype, tuple[int, ...], torch.Tensor] | None = None

    @property
    def storage(self) -> torch.Tensor:
        """The buffer's bytes, allocated now if nobody has used them yet."""
        storage = self._storage
        if storage is None:
            assert self._make is not None
            storage = self._storage = self._make()
            self._make = None
        return storage

    @property
    def allocated(self) -> bool:
        return self._storage is not None

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The first bytes of the buffer as a contiguous tensor of ``dtype`` and ``shape`` (no copy).

        The same tensor object may be returned again for the same dtype and shape: callers must not change
        its metadata in place (``resize_``, ``as_strided_``, ``set_``)."""
        shape = tuple(shape)
        last = self._view
        if last is not None and last[0] is dtype and last[1] == shape:
            return last[2]
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        if nbytes > self.size_class:
            raise TransferError(
                f"{dtype}{list(shape)} needs {nbytes} bytes; the buffer has {self.size_class}"
            )
        view = self.storage[:nbytes].view(dtype).view(shape)
        self._view = (dtype, shape, view)
        return view

    def __repr__(self) -> str:
        return f"PinnedBuffer(class={self.size_class}, nbytes={self.nbytes}, out={self._out})"


def size_class(nbytes: int, minimum: int = MIN_CLASS) -> int:
    """The power-of-two class that serves a request of ``nbytes``."""
    return max(minimum, 1 << max(nbytes - 1, 0).bit_length())


class PinnedPool:
    """Staging buffers bounded by ``capacity`` bytes, reused by power-of-two size class.

    ``acquire`` returns ``None`` when the bytes are all on loan (try again on a later poll); ``release``
    returns a buffer (twice is an error, caught). Counters: :attr:`buffers_out` (on loan now, must come back
    to 0), :attr:`bytes_reserved` (allocated, in use or idle), :attr:`allocations` (fresh allocations so far:
    a steady state reuses instead), :attr:`refusals` ("not now" answers).
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        device: TransferDevice | None = None,
        min_class: int = MIN_CLASS,
    ) -> None:
        if capacity <= 0:
            raise TransferError(f"pool capacity must be > 0 bytes, got {capacity}")
        if min_class <= 0 or min_class & (min_class - 1):
            raise TransferError(f"min_class must be a power of two, got {min_class}")
        self.capacity = capacity
        self.min_class = min_class
        self.device = device if device is not None else CpuDevice()
        # Idle buffers per class; the OrderedDict of classes remembers which class was used least recently,
        # which is the one whose idle buffers are dropped first when another class needs the room.
        self._free: OrderedDict[int, list[PinnedBuffer]] = OrderedDict()
        self.bytes_reserved = 0
        self.bytes_out = 0
        self.buffers_out = 0
        self.allocations = 0
        self.refusals = 0

    @property
    def pinned(self) -> bool:
        return self.device.pinned

    def acquire(self, nbytes: int, *, lazy: bool = False) -> PinnedBuffer | None:
        """A buffer of at least ``nbytes``, or ``None`` when the pool is full right now.

        ``lazy``: when no idle buffer fits, the new one's memory is allocated by whoever first touches
        ``storage``, not here. Why: the save tracker hands the step's staging span straight to its copy
        thread, and allocating (pinning) a fresh span of a few MiB is a cost vLLM's thread should not pay.
        Only one thread may touch a lazy buffer first (the borrower's ownership rule); a buffer left
        unallocated by its borrower is allocated by the next non-lazy :meth:`acquire`.
        """
        if nbytes < 0:
            raise TransferError(f"cannot acquire {nbytes} bytes")
        cls = size_class(nbytes, self.min_class)
        if cls > self.capacity:
            raise PoolTooSmall(
                f"a {nbytes}-byte staging buffer (class {cls}) exceeds the pool's whole capacity of "
                f"{self.capacity} bytes; raise the pool size"
            )
        idle = self._free.get(cls)
        if idle:
            buf = idle.pop()
            self._free.move_to_end(cls)
        else:
            if not self._make_room(cls):
                self.refusals += 1
                return None
            if lazy:
                buf = PinnedBuffer(None, cls, functools.partial(self.device.alloc_host, cls))
            else:
                buf = PinnedBuffer(self.device.alloc_host(cls), cls)
            self.bytes_reserved += cls
            self.allocations += 1
        if not lazy and not buf.allocated:
            buf.storage  # noqa: B018  (allocated here, on the borrower's thread)
        buf.nbytes = nbytes
        buf._out = True
        self.buffers_out += 1
        self.bytes_out += cls
        return buf

    def release(self, buf: PinnedBuffer) -> None:
        """Return a buffer; after this the caller must not touch it (the next borrower owns its bytes)."""
        if not buf._out:
            raise TransferError(f"{buf!r} released twice (or not from this pool)")
        buf._out = False
        buf.nbytes = 0
        self.buffers_out -= 1
        self.bytes_out -= buf.size_class
        self._free.setdefault(buf.size_class, []).append(buf)
        self._free.move_to_end(buf.size_class)

    def prefill(self, nbytes: int, count: int) -> int:
        """Allocate and touch up to ``count`` idle buffers for requests of ``nbytes``; return how many.

        Pinning (``cudaHostAlloc``) takes milliseconds and first-touch page faults tens of microseconds per
        buffer: an operator pays both at start-up instead of on the first steps' forward path. Stops at
        the capacity.
        """
        cls = size_class(nbytes, self.min_class)
        made = 0
        while made < count and self.bytes_reserved + cls <= self.capacity:
            storage = self.device.alloc_host(cls)
            storage.zero_()  # fault the pages in now
            self._free.setdefault(cls, []).append(PinnedBuffer(storage, cls))
            self.bytes_reserved += cls
            self.allocations += 1
            made += 1
        return made

    def trim(self) -> int:
        """Drop every idle buffer (give pinned memory back to the OS); return the bytes freed."""
        freed = sum(b.size_class for bufs in self._free.values() for b in bufs)
        self._free.clear()
        self.bytes_reserved -= freed
        return freed

    def _make_room(self, cls: int) -> bool:
        if self.bytes_reserved + cls <= self.capacity:
            return True
        if self.bytes_out + cls > self.capacity:
            return False  # idle buffers could not make enough room: do not drop them for nothing
        for other in list(self._free):
            idle = self._free[other]
            while idle and self.bytes_reserved + cls > self.capacity:
                idle.pop()
                self.bytes_reserved -= other
            if not idle:
                del self._free[other]
            if self.bytes_reserved + cls <= self.capacity:
                return True
        return self.bytes_reserved + cls <= self.capacity

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "bytes_reserved": self.bytes_reserved,
            "bytes_out": self.bytes_out,
            "buffers_out": self.buffers_out,
            "allocations": self.allocations,
            "refusals": self.refusals,
        }
