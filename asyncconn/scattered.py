"""A read destination in pieces: :class:`Scattered`, one value landing in several buffers one after another.

Why its own module: it is what :meth:`asyncconn.store.TensorStore.read_into_many` takes besides a tensor, and
what the in-place loads (:mod:`asyncconn.transfer.in_place`, :mod:`asyncconn.vllm.kv.in_place`) build; the
store only reads into it, the in-place path alone decides where the pieces are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncconn.exceptions import InvalidInput

__all__ = ["RemoteScattered", "Scattered"]


@dataclass(frozen=True, slots=True)
class Scattered:
    """A destination in pieces: the value (``dtype``, ``shape``) lands in ``views``, one after another.

    Why: a host KV cache keeps a value's blocks apart (a piece per layer); reading straight into them saves
    the staging buffer and the copy out of it. The pieces are written before the frame is checked: on any
    outcome but a hit their contents are unspecified. The loader takes it as an *in-place* destination
    (``StreamLoader``: a host device only, and only values the store holds in memory, so that a read
    writing the caller's memory always ends within a memory copy).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    views: tuple[memoryview, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        nbytes = sum(v.nbytes for v in self.views)
        if nbytes != self.nbytes:
            raise InvalidInput(
                f"Scattered: pieces hold {nbytes} bytes, a {self.dtype}{list(self.shape)} value is "
                f"{self.nbytes}"
            )
        if any(v.readonly for v in self.views):
            raise InvalidInput("Scattered: a piece is read-only")

    @classmethod
    def trusted(cls, dtype: torch.dtype, shape: tuple[int, ...], views: tuple[memoryview, ...]) -> Scattered:
        """A destination whose pieces the caller has sized and made writable itself: built without checks.

        Why: the KV worker builds one per loaded value on vLLM's thread, from views of the cache it checked
        once at registration, and the checks were a large part of that cost. A piece
        of the wrong size still cannot be misread: the store checks the value's length against the pieces'
        before it reads, and the frame's dtype and shape against ``dtype`` and ``shape`` after.
        """
        self = object.__new__(cls)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "views", views)
        return self

    @property
    def nbytes(self) -> int:
        """The value's bytes: the pieces' total."""
        return math.prod(self.shape) * self.dtype.itemsize


class RemoteScattered(Scattered):
    """A :class:`Scattered` destination read from a store whose reads can be abandoned
    (``TensorStore.cancellable_reads``: ``redis://``) rather than from memory: the loader reads each one
    with a store call of its own, in a call slot, and can stop it (``StreamLoader.interrupt``).

    Why a kind of its own: one step of a CPU engine behind a host tier reads both -- the values the tier
    holds, as memory copies in groups, and the others from the store behind it -- and the loader picks how
    to read a destination by its type.
    """

    __slots__ = ()
