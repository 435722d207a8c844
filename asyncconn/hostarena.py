"""The host tier's memory: one arena of a fixed size, made once, and the extents values take in it.

Why an arena: the tier used to keep each value as a new ``bytes`` object. Every fill then paid for fresh
memory -- with values of about a MiB, glibc maps each one anew and the kernel faults in and zeroes every
page of it -- on top of the copy itself, several times the copy's own cost, and the engine's first pass
through the tier waited for it. The
arena is mapped and faulted in once when the tier is made (``MAP_POPULATE``), on the tier's copy thread, so
the tier's memory is known from the start (its bound, resident) and a fill is a plain memory copy. On a
CUDA engine the connector hands the tier its device's pinned allocator instead (page-locked memory; see
:class:`~asyncconn.hosttier.HostTier`).

The bookkeeping (:class:`Extents`) is apart from the memory: it runs on the loop thread while the copies run
on the copy thread. Values are placed in runs of ``align``-byte units: a freed value's run coalesces with
free neighbours, a value takes one run of exactly its size when one is free (the common case: the values of
one model are mostly of one size), else the smallest larger run, else several runs (a value may be
scattered: never a failure for lack of a contiguous run, so fragmentation never costs capacity).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ALIGN",
    "Extent",
    "Extents",
    "HostMemory",
    "as_arena",
    "byte_arrays",
    "copy_segments",
    "populated_memory",
]

#: Unit of placement in the arena (a cache line): values start aligned, and a value wastes < one unit.
ALIGN = 64

#: Makes the arena: called once, on the tier's copy thread, with the arena's size in bytes; returns a
#: writable buffer of that size (an ``mmap``, a ``uint8`` tensor, ...).
HostMemory = Callable[[int], Any]


@dataclass(frozen=True)
class Extent:
    """Where a value lives: ``runs`` of (first unit, units) of the arena, holding ``size`` bytes in order."""

    runs: tuple[tuple[int, int], ...]
    size: int

    @property
    def units(self) -> int:
        return sum(n for _, n in self.runs)

    def arrays(self, arena: np.ndarray, align: int) -> list[np.ndarray]:
        """The value's bytes in ``arena``: one ``uint8`` array per run, ``size`` bytes in all."""
        out = []
        left = self.size
        for start, n in self.runs:
            take = min(n * align, left)
            out.append(arena[start * align : start * align + take])
            left -= take
        return out


class Extents:
    """Which units of an arena of ``nbytes`` are free: runs keyed by first unit, last unit and length.

    Owned by one thread (the tier's loop). ``take`` never fails while enough units are free.
    """

    def __init__(self, nbytes: int, align: int = ALIGN) -> None:
        if align <= 0:
            raise ValueError("align must be > 0")
        self.align = align
        self.units = nbytes // align
        self.free_units = 0
        self._by_start: dict[int, int] = {}  # first unit -> length
        self._by_end: dict[int, int] = {}  # one past the last unit -> first unit
        self._by_length: dict[int, set[int]] = {}  # length -> first units
        if self.units:
            self._add(0, self.units)

    @property
    def nbytes(self) -> int:
        """The arena's size: the bound rounded down to whole units."""
        return self.units * self.align

    @property
    def used_bytes(self) -> int:
        return (self.units - self.free_units) * self.align

    def units_for(self, nbytes: int) -> int:
        return -(-nbytes // self.align)

    def take(self, nbytes: int) -> Extent | None:
        """Room for ``nbytes``: an exact free run, else the smallest larger one, else the largest runs in
        turn; ``None`` when fewer units are free."""
        need = self.units_for(nbytes)
        if need > self.free_units:
            return None
        runs: list[tuple[int, int]] = []
        left = need
        while left:
            exact = self._by_length.get(left)
            if exact:
                length = left
            else:
                larger = [n for n in self._by_length if n > left]
                length = min(larger) if larger else max(self._by_length)
            start = next(iter(self._by_length[length]))
            self._remove(start, length)
            used = min(length, left)
            if length > used:
                self._add(start + used, length - used)
            runs.append((start, used))
            left -= used
        return Extent(tuple(runs), nbytes)

    def give(self, extent: Extent) -> None:
        """``extent``'s units are free again (merged with free neighbours)."""
        for first, units in extent.runs:
            if first in self._by_start:
                raise AssertionError(f"units {first}..{first + units} freed twice")
            start, n = first, units
            before = self._by_end.get(start)
            if before is not None:
                length = self._by_start[before]
                self._remove(before, length)
                start, n = before, n + length
            after = self._by_start.get(start + n)
            if after is not None:
                self._remove(start + n, after)
                n += after
            self._add(start, n)

    def _add(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._by_length.setdefault(n, set()).add(start)
        self.free_units += n

    def _remove(self, start: int, n: int) -> None:
        del self._by_start[start]
        del self._by_end[start + n]
        starts = self._by_length[n]
        starts.discard(start)
        if not starts:
            del self._by_length[n]
        self.free_units -= n


def populated_memory(nbytes: int) -> mmap.mmap:
    """Anonymous memory of ``nbytes``, every page faulted in now (so its first use pays no faults, and the
    process's resident size includes it from the start)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    if not populate:  # a platform without it: touch a byte of every page
        np.frombuffer(memory, np.uint8)[:: mmap.PAGESIZE] = 0
    return memory


def as_arena(memory: Any, nbytes: int) -> np.ndarray:
    """``memory`` (a buffer or a CPU tensor) as a writable ``uint8`` array of its first ``nbytes``."""
    numpy = getattr(memory, "numpy", None)  # a torch tensor: its own numpy view shares its memory
    array = numpy() if callable(numpy) else np.frombuffer(memory, np.uint8)
    array = array.reshape(-1).view(np.uint8)
    if array.nbytes < nbytes or not array.flags.writeable:
        raise ValueError(f"host tier memory must be {nbytes} writable bytes, got {array.nbytes}")
    return array[:nbytes]


def copy_segments(sources: Sequence[np.ndarray], dests: Sequence[np.ndarray]) -> None:
    """The concatenation of ``sources`` into the concatenation of ``dests`` (equal total sizes). numpy
    copies large arrays without the GIL, so the loop and vLLM's threads run meanwhile."""
    si = di = soff = doff = 0
    while si < len(sources) and di < len(dests):
        src, dst = sources[si], dests[di]
        n = min(src.size - soff, dst.size - doff)
        if n:
            np.copyto(dst[doff : doff + n], src[soff : soff + n])
        soff += n
        doff += n
        if soff == src.size:
            si, soff = si + 1, 0
        if doff == dst.size:
            di, doff = di + 1, 0


def byte_arrays(buffers: Sequence[Any]) -> list[np.ndarray]:
    """Each buffer (bytes-like, any format) as a flat ``uint8`` array over the same memory."""
    return [np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) else b for b in buffers]
