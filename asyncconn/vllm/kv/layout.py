"""Where a value's blocks sit in the registered KV cache: scatter loaded values in, gather values to save.

A stored value holds ``blocks_per_value`` consecutive blocks of *every* layer, for this rank's heads:
``[num_layers, *layer_shape]`` with the cache's block dimension cut to ``blocks_per_value``. Each layer
belongs to a KV cache group, and a value's blocks are at that group's ids (``ValueRef.block_ids[group]``);
a group with vLLM's null block at a position (a sliding-window group, outside the window at the cut) is
never read or written there.

One layout for a step's saves, whatever the device: :meth:`CacheLayout.gather` stacks the values
value-major, ``[values, num_layers, *layer_shape]``, so each value is one contiguous row (one snapshot copy
for the whole step on CUDA, one contiguous copy per value into staging on CPU). The save modes
(:mod:`asyncconn.vllm.kv.saves`) only choose *when* and on which thread the gather runs.

Nothing here waits for the device: index tensors reach a GPU from pinned memory (:func:`index`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from asyncconn.exceptions import ConfigError
from asyncconn.vllm.kv.groups import NULL_BLOCK_ID, has_null
from asyncconn.vllm.kv.metadata import ValueRef

__all__ = ["CacheLayout", "LayerLayout", "index", "rows_of_one"]


@dataclass(frozen=True)
class LayerLayout:
    """Where the blocks are in the registered per-layer KV tensors (all layers alike)."""

    block_dim: int
    layer_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def detect(cls, caches: dict[str, torch.Tensor], layers: Iterable[str], num_blocks: int) -> LayerLayout:
        """The block dimension is the first of dims 0 and 1 whose size is ``num_blocks`` (vLLM's layouts
        are ``[num_blocks, ...]`` or ``[2, num_blocks, ...]``); every layer must share shape and dtype,
        because one value stacks them all."""
        names = list(layers)
        missing = [n for n in names if n not in caches]
        if missing:
            raise ConfigError(
                f"KV connector: layers {missing[:3]} of the KV cache config were not registered"
            )
        first = caches[names[0]]
        for name in names[1:]:
            t = caches[name]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ConfigError(
                    f"KV connector: layer {name} is {t.dtype}{list(t.shape)}, {names[0]} is "
                    f"{first.dtype}{list(first.shape)}; one value stacks layers, so they must match"
                )
        dims = [d for d in (0, 1) if d < first.dim() and first.shape[d] == num_blocks]
        if not dims:
            raise ConfigError(
                f"KV connector: no block dimension of size {num_blocks} in a KV tensor of shape "
                f"{list(first.shape)}"
            )
        return cls(dims[0], tuple(first.shape), first.dtype)

    def value_shape(self, num_layers: int, blocks_per_value: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_dim] = blocks_per_value
        return (num_layers, *shape)


class CacheLayout:
    """The registered caches, in layer order, each with its KV cache group: scatter and gather values."""

    def __init__(
        self,
        caches: dict[str, torch.Tensor],
        layers: list[str],
        group_of_layer: dict[str, int],
        num_blocks: int,
        blocks_per_value: int,
    ) -> None:
        self.layer = LayerLayout.detect(caches, layers, num_blocks)
        self.caches: list[tuple[torch.Tensor, int]] = [(caches[n], group_of_layer[n]) for n in layers]
        self.blocks_per_value = blocks_per_value
        self.whole = tuple(range(blocks_per_value))  # every block position of a value
        self.value_shape = self.layer.value_shape(len(layers), blocks_per_value)
        self.dtype = self.layer.dtype
        self.device = self.caches[0][0].device
        self.groups = sorted({group for _, group in self.caches})  # the KV cache groups these layers are in

    def has_null(self, ref: ValueRef) -> bool:
        """Whether one of this layout's groups has the null block at a position of ``ref`` (a group whose
        layers another part of the value holds does not count)."""
        return has_null([ref.block_ids[g] for g in self.groups])

    @property
    def block_dim(self) -> int:
        return self.layer.block_dim

    # -- loads -----------------------------------------------------------------------------------------
    def scatter(self, value: torch.Tensor, ref: ValueRef) -> None:
        """Write the value's blocks at ``ref.positions`` into every layer, at the request's block ids.

        A group with the null block at a position is not written there: vLLM never reads it, and the null
        block belongs to no request.
        """
        dim = self.layer.block_dim
        device = value.device
        plans = [_group_plan(g, ref.positions, self.whole, device) for g in ref.block_ids]
        for layer, (cache, group) in enumerate(self.caches):
            plan = plans[group]
            if plan is None:
                continue
            where, positions, n = plan
            src = value[layer] if positions is None else value[layer].index_select(dim, positions)
            if isinstance(where, int):
                cache.narrow(dim, where, n).copy_(src)
            else:
                cache.index_copy_(dim, where, src)

    def scatter_batch(self, batch: Sequence[tuple[torch.Tensor, ValueRef]]) -> None:
        """Write device values one poll handed over with one stack and one indexed write per layer.

        Why: :meth:`scatter` launches one copy per value and layer from vLLM's thread, so its host cost
        grows with values x layers (``asyncconn bench gpu``, ``kv_scatter``, measures both ways). The values
        are stacked once (one device-to-device pass, usually none: the loader lands a poll's values as rows
        of one tensor) and each layer gets one indexed write at all their block ids. Partial values and
        values touching the null block go through :meth:`scatter`.
        """
        whole = [(v, ref) for v, ref in batch if ref.positions == self.whole and not self.has_null(ref)]
        for value, ref in batch:
            if ref.positions != self.whole or self.has_null(ref):
                self.scatter(value, ref)
        if len(whole) == 1:
            self.scatter(*whole[0])
        if len(whole) <= 1:
            return
        dim, bpv = self.layer.block_dim, self.blocks_per_value
        device = whole[0][0].device
        stacked = rows_of_one([value for value, _ in whole])  # [values, layers, *layer_shape]
        ids = [
            index([b for _, ref in whole for b in ref.block_ids[g]], device).view(len(whole), bpv)
            for g in range(len(whole[0][1].block_ids))
        ]
        lead: tuple[slice, ...] = (slice(None),) * dim  # the dims before the block dim are written whole
        for layer, (cache, group) in enumerate(self.caches):
            # cache[..., ids] has shape [*lead, values, bpv, *rest]: the stacked layer with values moved in
            where: tuple[slice | torch.Tensor, ...] = (*lead, ids[group])
            cache[where] = stacked[:, layer].movedim(0, dim)

    # -- saves -----------------------------------------------------------------------------------------
    def gather(self, refs: Sequence[ValueRef]) -> torch.Tensor:
        """``[values, num_layers, *layer_shape]``: the values' blocks, value-major, each value contiguous."""
        dim, bpv = self.layer.block_dim, self.blocks_per_value
        ids = [index(group, self.device) for group in _block_ids(refs)]
        per_layer = []
        for cache, group in self.caches:
            picked = cache.index_select(dim, ids[group])  # [..., values * bpv, ...]
            split = (*picked.shape[:dim], len(refs), bpv, *picked.shape[dim + 1 :])
            per_layer.append(picked.view(split).movedim(dim, 0))
        return torch.stack(per_layer, dim=1)

    def gather_blocks(self, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[num_layers, *layer_shape]`` with the block dimension holding ``block_ids`` (per group)."""
        ids = [index(group, self.device) for group in block_ids]
        return torch.stack([cache.index_select(self.layer.block_dim, ids[g]) for cache, g in self.caches])


def _block_ids(refs: Sequence[ValueRef]) -> list[list[int]]:
    """The block ids per KV cache group, value after value."""
    return [[b for ref in refs for b in ref.block_ids[g]] for g in range(len(refs[0].block_ids))]


def _group_plan(
    ids: Sequence[int], positions: tuple[int, ...], whole: tuple[int, ...], device: torch.device
) -> tuple[int | torch.Tensor, torch.Tensor | None, int] | None:
    """Where one group's layers take a value's blocks: (block ids -- the first one when they are a run of
    consecutive ids, a plain slice of the cache with no index tensor to build --, the value positions to
    take or None for the whole value in order, the count); None when every position is the null block."""
    if NULL_BLOCK_ID in ids:
        keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK_ID]
        if not keep:
            return None
        ids = [ids[i] for i in keep]
        positions = tuple(positions[i] for i in keep)
    first = ids[0]
    run = tuple(ids) == tuple(range(first, first + len(ids)))
    where: int | torch.Tensor = first if run else index(ids, device)
    return where, (None if positions == whole else index(positions, device)), len(ids)


def rows_of_one(values: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(values)``, without the copy when the values are already the consecutive rows of one
    tensor (the loader lands the values a poll hands over so, on CUDA)."""
    first = values[0]
    size, offset = first.numel(), first.storage_offset()
    base = first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(
        v.is_contiguous()
        and v.shape == first.shape
        and v.untyped_storage().data_ptr() == base
        and v.storage_offset() == offset + i * size
        for i, v in enumerate(values)
    ):
        return first.as_strided((len(values), *first.shape), (size, *first.stride()), offset)
    return torch.stack(values)


def index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 index tensor on ``device``, made without waiting for the device.

    Why: ``torch.tensor(ids, device="cuda")`` copies from pageable memory, and such a copy waits for every
    kernel queued on the current stream -- on vLLM's thread, a stall until the GPU has caught up with the
    forward. From pinned memory (torch's caching host allocator keeps it until the copy has run) the copy is
    queued like any kernel.
    """
    host = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
