"""Where a loaded value goes: a new device tensor that the loader allocates, described by a
:class:`TensorSpec` (its shape and dtype, or a bound on its size); or, on a host device, memory the caller
already has (:class:`~asyncconn.scattered.Scattered`, the store's destination in pieces).

The description is validated when it is built, on the caller's thread, so a wrong shape is a
:class:`ConfigError` at ``submit`` time rather than a failed copy later. KV values are loaded the same way and
scattered into the paged cache by the KV connector's worker side (``KVWorkerSide._scatter``), one value
spanning every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncconn._deprecated import renamed_attribute
from asyncconn.exceptions import ConfigError

__all__ = ["TensorSpec"]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Load into a new tensor on the loader's device: what to allocate for it (not a tensor itself).

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
            raise ConfigError("TensorSpec: give both shape and dtype, or neither (then max_nbytes)")
        if self.shape is None and self.max_nbytes <= 0:
            raise ConfigError("TensorSpec: without shape/dtype, max_nbytes must bound the staging buffer")
        if self.shape is not None:
            if any(d < 0 for d in self.shape):
                raise ConfigError(f"TensorSpec: negative dimension in shape {self.shape}")
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def staging_nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return self.max_nbytes
        return _nbytes(self.shape, self.dtype)


def __getattr__(name: str) -> Any:
    """``NewTensor``: the old name of :class:`TensorSpec` (deprecated)."""
    return renamed_attribute(__name__, {"NewTensor": ("TensorSpec", TensorSpec)}, name)
