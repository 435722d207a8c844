"""Where a loaded value goes: a new device tensor (:class:`NewTensor`), or host memory already there
(:class:`InPlace`).

The description is validated when it is built, on the caller's thread, so a wrong shape is a
:class:`ConfigError` at ``submit`` time rather than a failed copy later. KV values are loaded the same way and
scattered into the paged cache by the KV connector's worker side (``KVWorkerSide._scatter``), one value
spanning every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncconn.exceptions import ConfigError

__all__ = ["InPlace", "NewTensor"]


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
class InPlace:
    """Load straight into host memory the caller owns (``views``, filled in order): no staging, no copy.

    Why: on a CPU engine the KV cache is host memory, and reading a value into its blocks directly saves a
    pass over every byte (the staging buffer and the copy out of it). Only for a loader on a host device,
    and only values the store holds in memory (``TensorStore.cached_reads``: every such read ends within a
    memory copy, so it cannot hang holding the caller's memory); a value the store would have to wait for
    comes back as ``Failure.NOT_CACHED`` and the caller loads it another way. The memory may be written
    until the load's result is reported, and on any failure its contents are unspecified. A load that has
    started cannot be cancelled (``StreamLoader.cancel`` says so).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    views: tuple[memoryview, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if sum(v.nbytes for v in self.views) != self.nbytes:
            raise ConfigError(
                f"InPlace: the views hold {sum(v.nbytes for v in self.views)} bytes, a "
                f"{self.dtype}{list(self.shape)} value is {self.nbytes}"
            )

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)
