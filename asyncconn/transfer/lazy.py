"""Lazy save sources: a tensor the save tracker's copy thread computes, so the caller's thread never does.

The KV adapter saves a step's values as slices of one gather over the KV cache (one ``index_select`` per
layer, stacked). On CPU that gather *is* the expensive part of ``wait_for_save``; handing the tracker a
:class:`Slice` of a :class:`Shared` gather instead of a tensor moves it onto the tracker's copy thread, which
evaluates the gather once (on the first slice it copies) and copies each slice into its staging buffer.

The shape and dtype are known up front (the tracker sizes the staging buffer at ``submit``). A source is
evaluated on one thread only: the copy thread when the tracker has one, else the caller's thread inside
``submit`` -- so :class:`Shared` needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

__all__ = ["LazyTensor", "Shared", "Slice"]


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
