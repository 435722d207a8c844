"""Where a loaded value goes: a new device tensor (an embedding) or existing KV blocks (a scatter).

Both descriptions are validated when they are built, on the caller's thread, so a wrong shape or block id is
a :class:`ConfigError` at ``submit`` time rather than a failed copy later. A stored KV value holds the blocks
of one layer stacked along the cache's block dimension, in the order of ``block_ids``; vLLM's layouts put
that dimension first (``[num_blocks, ...]``) or second (``[2, num_blocks, ...]`` for K and V), hence ``dim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncconn.exceptions import ConfigError

__all__ = ["BlockDest", "Destination", "NewTensor"]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * dtype.itemsize


@dataclass(frozen=True, slots=True)
class NewTensor:
    """Load into a new tensor on the loader's device.

    Give ``shape`` and ``dtype`` when they are known (vLLM knows an embedding's tokens x hidden size): the
    value is then read straight into a staging buffer of exactly that size and checked against them. Without
    them the frame's own dtype and shape are used; ``max_nbytes`` then bounds the staging buffer and costs one
    extra host copy (the value is decoded before its size is known).
    """

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    max_nbytes: int = 0

    def __post_init__(self) -> None:
        if (self.shape is None) != (self.dtype is None):
            raise ConfigError("NewTensor: give both shape and dtype, or neither (then max_nbytes)")
        if self.shape is None and self.max_nbytes <= 0:
            raise ConfigError("NewTensor: without shape/dtype, max_nbytes must bound the staging buffer")
        if self.shape is not None:
            if any(d < 0 for d in self.shape):
                raise ConfigError(f"NewTensor: negative dimension in shape {self.shape}")
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def staging_nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return self.max_nbytes
        return _nbytes(self.shape, self.dtype)


@dataclass(frozen=True, slots=True)
class BlockDest:
    """Scatter a value holding ``len(block_ids)`` blocks into ``cache`` at ``block_ids`` along ``dim``."""

    cache: torch.Tensor
    block_ids: Sequence[int]  # stored as a tuple
    dim: int = 0
    #: ``(value_start, cache_start, length)`` runs of consecutive ids: one copy per run, not per block.
    runs: tuple[tuple[int, int, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ids = tuple(int(b) for b in self.block_ids)
        object.__setattr__(self, "block_ids", ids)
        if not ids:
            raise ConfigError("BlockDest: block_ids is empty")
        ndim = self.cache.dim()
        if not -ndim <= self.dim < ndim:
            raise ConfigError(f"BlockDest: dim {self.dim} is out of range for a {ndim}-d cache")
        dim = self.dim % ndim
        object.__setattr__(self, "dim", dim)
        num_blocks = self.cache.shape[dim]
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise ConfigError(f"BlockDest: block ids {bad[:5]} out of range [0, {num_blocks})")
        if len(set(ids)) != len(ids):
            raise ConfigError("BlockDest: block_ids repeats a block")
        runs: list[tuple[int, int, int]] = []
        for i, block in enumerate(ids):
            if runs and runs[-1][1] + runs[-1][2] == block:
                start, cstart, length = runs[-1]
                runs[-1] = (start, cstart, length + 1)
            else:
                runs.append((i, block, 1))
        object.__setattr__(self, "runs", tuple(runs))

    @property
    def value_shape(self) -> tuple[int, ...]:
        shape = list(self.cache.shape)
        shape[self.dim] = len(self.block_ids)
        return tuple(shape)

    @property
    def staging_nbytes(self) -> int:
        return _nbytes(self.value_shape, self.cache.dtype)

    def pairs(self, value: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(cache slice, value slice)`` copy pairs, one per run of consecutive block ids."""
        return [
            (self.cache.narrow(self.dim, cstart, length), value.narrow(self.dim, start, length))
            for start, cstart, length in self.runs
        ]


Destination = NewTensor | BlockDest
