"""Lazy save sources: a tensor the save tracker's copy thread computes, so the caller's thread never does.

The KV adapter saves a step's values as slices of one gather over the KV cache (one ``index_select`` per
layer, stacked). On CPU that gather *is* the expensive part of ``wait_for_save``; handing the tracker a
:class:`Slice` of a :class:`Shared` gather instead of a tensor moves it onto the tracker's copy thread, which
evaluates the gather once (on the first slice it copies) and copies each slice into its staging buffer.

A whole step's values are one :class:`Pieces`: equal slices of the gather, addressed by index, so naming them
costs no Python object per value (the tracker's ``submit_many`` reads a piece by index on the copy thread;
indexing a :class:`Pieces` makes the equivalent :class:`Slice` for any other consumer).

The shape and dtype are known up front (the tracker sizes the staging buffer at ``submit``). A source is
evaluated on one thread only: the copy thread when the tracker has one, else the caller's thread inside
``submit`` -- so :class:`Shared` needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, overload, runtime_checkable

import torch

__all__ = ["LazyTensor", "Pieces", "Shared", "Slice"]


@runtime_checkable
class LazyTensor(Protocol):
    """A tensor of known shape and dtype, computed when called (on the thread that snapshots it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __call__(self) -> torch.Tensor: ...


class Shared:
    """A tensor computed on first use and kept: the gather that many slices share.

    The function (and whatever it references, e.g. block-id lists) is dropped once evaluated; the result
    lives as long as a :class:`Slice` of it does, i.e. until the last save reading it has been copied.
    """

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self._fn: Callable[[], torch.Tensor] | None = fn
        self._value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._value is None:
            fn, self._fn = self._fn, None
            if fn is None:
                raise RuntimeError("a shared lazy tensor failed before; it is not retried")
            self._value = fn()
        return self._value

    @property
    def evaluated(self) -> bool:
        return self._value is not None


class Slice:
    """``shared.get().narrow(dim, start, length)``, with the shape stated up front (a :class:`LazyTensor`)."""

    __slots__ = ("dim", "dtype", "length", "shape", "shared", "start")

    def __init__(
        self, shared: Shared, dim: int, start: int, length: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self.shared = shared
        self.dim = dim
        self.start = start
        self.length = length
        self.shape = shape
        self.dtype = dtype

    def __call__(self) -> torch.Tensor:
        value = self.shared.get().narrow(self.dim, self.start, self.length)
        if tuple(value.shape) != self.shape or value.dtype != self.dtype:
            raise RuntimeError(
                f"lazy slice is {value.dtype}{list(value.shape)}, promised {self.dtype}{list(self.shape)}"
            )
        return value


class Pieces(Sequence[Slice]):
    """``count`` equal slices of a :class:`Shared` along ``dim``: piece ``i`` is
    ``shared.get().narrow(dim, (first + i) * length, length)``, each of ``shape`` and ``dtype``.

    A sequence of lazy tensors without an object per piece: :meth:`tensor` evaluates piece ``i`` (on the
    thread that snapshots it), :meth:`part` names a sub-range (one request's values of a step's gather),
    ``pieces[i]`` is the equivalent :class:`Slice`.
    """

    __slots__ = ("dim", "dtype", "first", "length", "shape", "shared", "size")

    def __init__(
        self,
        shared: Shared,
        dim: int,
        length: int,
        count: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        first: int = 0,
    ) -> None:
        if count < 0 or first < 0 or length <= 0:
            raise ValueError(f"impossible pieces: first={first}, count={count}, length={length}")
        self.shared = shared
        self.dim = dim
        self.length = length
        self.size = count
        self.shape = shape
        self.dtype = dtype
        self.first = first

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> Slice: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Slice]: ...
    def __getitem__(self, index: int | slice) -> Slice | Sequence[Slice]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(f"piece {index} of {self.size}")
        start = (self.first + index) * self.length
        return Slice(self.shared, self.dim, start, self.length, self.shape, self.dtype)

    def part(self, start: int, count: int) -> Pieces:
        """Pieces ``start .. start + count - 1`` of these (a view, nothing evaluated)."""
        if start < 0 or count < 0 or start + count > self.size:
            raise ValueError(f"pieces {start}..{start + count} of {self.size}")
        return Pieces(self.shared, self.dim, self.length, count, self.shape, self.dtype, self.first + start)

    def tensor(self, index: int) -> torch.Tensor:
        """Piece ``index`` evaluated (the shared gather runs on first use); checked like a :class:`Slice`."""
        value = self.shared.get().narrow(self.dim, (self.first + index) * self.length, self.length)
        if tuple(value.shape) != self.shape or value.dtype != self.dtype:
            raise RuntimeError(
                f"lazy piece is {value.dtype}{list(value.shape)}, promised {self.dtype}{list(self.shape)}"
            )
        return value

    @property
    def nbytes(self) -> int:
        """Bytes of one piece."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize
