"""Where a fetched value lands and how it reaches the requests' blocks: one mode per device, chosen once
when the caches are registered.

* :class:`DeviceLanding` (CUDA): the loader hands over device copies of their own, valid past the poll;
  the values one poll hands over are scattered together (:meth:`CacheLayout.scatter_batch`).
* :class:`HostLanding` (CPU): the loader lends its staging buffer for the call and takes it back after, so
  each value is written out at once, straight from staging.
* :class:`~asyncconn.vllm.kv.in_place.InPlaceLanding` (CPU over a store that serves reads from memory):
  whole values are read into the request's blocks themselves (its own module).

The worker's request bookkeeping (de-duplication, deadlines, load errors) is the same in every mode.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from asyncconn.scattered import Scattered
from asyncconn.store import TensorStore
from asyncconn.transfer import LoadResult, StreamLoader, TensorSpec
from asyncconn.vllm.kv.layout import CacheLayout
from asyncconn.vllm.kv.metadata import ValueRef

__all__ = ["DeviceLanding", "HostLanding", "Landing", "landing_for"]


class Landing:
    """Staged loads: a whole value lands in a staging buffer (``staged``) and is written into the cache."""

    #: Whether a step's loads are issued before its forward (``KVWorkerSide.loads_before_forward``).
    before_forward: ClassVar[bool] = False

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.staged = TensorSpec(layout.value_shape, layout.dtype)

    def destination(self, ref: ValueRef, key: str) -> tuple[TensorSpec | Scattered, bool]:
        """Where a new fetch of ``ref`` (stored under ``key``) lands, and whether that is the requesting
        request's own blocks (the worker then keeps that request's load open until the read has ended,
        whatever happens to it)."""
        return self.staged, False

    def fallback(self, result: LoadResult) -> TensorSpec | None:
        """Where to fetch a value again whose fetch failed in a way another destination avoids (None: it
        failed)."""
        return None

    def deliver(self, value: torch.Tensor | None, ref: ValueRef, landed_in: ValueRef | None) -> None:
        """Write a fetched value into the blocks of ``ref``. ``value`` is None when it was read into the
        blocks of ``landed_in`` (another request's) instead of staging."""
        raise NotImplementedError

    def flush(self) -> None:
        """End of a poll: write what :meth:`deliver` held back."""


class HostLanding(Landing):
    """CPU: each value is written out from the lent staging buffer before the loader takes it back.

    Its loads go out before the forward: a CPU forward runs to its end before returning, so loads issued
    after it would wait a whole step (``KVWorkerSide.loads_before_forward``).
    """

    before_forward = True

    def deliver(self, value: torch.Tensor | None, ref: ValueRef, landed_in: ValueRef | None) -> None:
        assert value is not None
        self.layout.scatter(value, ref)


class DeviceLanding(Landing):
    """CUDA: a device copy of its own per value, batched per poll (one indexed write per layer)."""

    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(layout)
        self.batch: list[tuple[torch.Tensor, ValueRef]] = []

    def deliver(self, value: torch.Tensor | None, ref: ValueRef, landed_in: ValueRef | None) -> None:
        assert value is not None
        self.batch.append((value, ref))

    def flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self.layout.scatter_batch(batch)


def landing_for(layout: CacheLayout, loader: StreamLoader, store: TensorStore) -> Landing:
    """The mode for this loader's device and store (see the module docstring)."""
    if not loader.device.synchronous:
        return DeviceLanding(layout)
    # In place is its own module, and this its one use: delete both and CPU loads go through staging.
    from asyncconn.vllm.kv.in_place import InPlaceLanding

    if InPlaceLanding.possible(layout, store):
        return InPlaceLanding(layout, store)
    return HostLanding(layout)
