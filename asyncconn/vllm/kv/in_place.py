"""In-place loads: on a CPU engine over a store that serves reads from memory (``file://``'s page cache) or
whose reads can be abandoned (``redis://``: ``StorageBackend.cancellable_reads``), a whole value is read
straight into the request's blocks -- no staging buffer and no copy out of one on vLLM's thread.

The destination is a :class:`~asyncconn.scattered.Scattered`: the value's bytes, layer by layer, are the
blocks ``ref.block_ids`` of each layer in order (a run of consecutive ids is one piece). From a page cache
the loader groups such reads into ``cached_only`` store calls (memory copies, never a disk wait); a value
the store would have had to wait for comes back ``NOT_CACHED`` and is fetched again through staging
(:meth:`InPlaceLanding.fallback`). From a remote store -- alone, or behind a host tier that does not hold
the value -- each value is a read of its own (a ``RemoteScattered`` destination,
:mod:`asyncconn.transfer.in_place`).
Another request wanting the same value copies it from the blocks it was read into. The worker keeps the
reading request's load open until the read has ended, also when it was aborted or timed out meanwhile:
vLLM frees or recomputes a request's blocks only after it is reported. A remote read is stopped then
(``StreamLoader.interrupt``), so that wait is one cancellation, not the store's timeout.

This is the one CPU-only load path; :func:`asyncconn.vllm.kv.loads.landing_for` is its one use.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from asyncconn import codec
from asyncconn.scattered import RemoteScattered, Scattered
from asyncconn.store import TensorStore
from asyncconn.transfer import Failure, LoadResult, TensorSpec
from asyncconn.transfer.runs import runs
from asyncconn.vllm.kv.layout import CacheLayout
from asyncconn.vllm.kv.loads import HostLanding
from asyncconn.vllm.kv.metadata import ValueRef

__all__ = ["InPlaceLanding"]


class InPlaceLanding(HostLanding):
    """Whole values read into the request's blocks; partial ones, and fallbacks, through staging."""

    @staticmethod
    def possible(layout: CacheLayout, store: TensorStore) -> bool:
        """A host cache whose layers are contiguous, over a store that serves reads from memory or whose
        reads can be abandoned."""
        return (store.cached_reads or store.cancellable_reads) and all(
            c.device.type == "cpu" and c.is_contiguous() for c, _ in layout.caches
        )

    def __init__(self, layout: CacheLayout, store: TensorStore) -> None:
        super().__init__(layout)
        self.in_memory = _in_memory(store)
        self.remote = store.cancellable_reads  # what is not in memory is read from the store, in place
        # Flat byte views of the layers' caches, the bytes of one block, and the number of block runs per
        # layer (the outer dims before the block dim).
        self.cache_bytes = [codec.tensor_bytes(c) for c, _ in layout.caches]
        shape, dim = layout.layer.layer_shape, layout.block_dim
        self.outer = math.prod(shape[:dim])
        self.block_bytes = self.cache_bytes[0].nbytes // (self.outer * shape[dim])
        # Why each destination can be built unchecked (Scattered.trusted): the layers share one shape
        # (LayerLayout.detect), so every layer's pieces of a whole value add up to the value.
        per_layer = self.outer * layout.blocks_per_value * self.block_bytes
        assert per_layer * len(self.cache_bytes) == self.staged.staging_nbytes

    def destination(self, ref: ValueRef, key: str) -> tuple[TensorSpec | Scattered, bool]:
        if ref.positions != self.layout.whole or self.layout.has_null(ref):
            return self.staged, False
        kind: type[Scattered] = Scattered
        if not self.in_memory(key):
            if not self.remote:
                return self.staged, False
            kind = RemoteScattered
        per_block = self.block_bytes
        blocks = self.layout.layer.layer_shape[self.layout.block_dim]
        # Byte ranges of one layer, the same in every layer of a group: runs of consecutive ids, per outer
        # index (computed once per group, not once per layer: this runs on vLLM's thread for every value).
        ranges = []
        for ids in ref.block_ids:
            id_runs = runs(ids)
            ranges.append(
                [
                    ((o * blocks + first) * per_block, (o * blocks + first + count) * per_block)
                    for o in range(self.outer)
                    for first, count in id_runs
                ]
            )
        views = [
            flat[a:b]
            for (_, group), flat in zip(self.layout.caches, self.cache_bytes, strict=True)
            for a, b in ranges[group]
        ]
        return kind.trusted(self.layout.dtype, self.staged.shape or (), tuple(views)), True

    def fallback(self, result: LoadResult) -> TensorSpec | None:
        """A value the store would have had to wait for: read it through staging."""
        return self.staged if result.failure is Failure.NOT_CACHED else None

    def deliver(self, value: torch.Tensor | None, ref: ValueRef, landed_in: ValueRef | None) -> None:
        if value is None:  # read into another request's blocks: copy it from there
            assert landed_in is not None
            value = self.layout.gather_blocks([list(g) for g in landed_in.block_ids])
        self.layout.scatter(value, ref)


def _in_memory(store: TensorStore) -> Callable[[str], bool]:
    """Whether a value is read in place from memory (a ``Scattered`` destination): always over a store whose
    every read can be a memory copy (``file://``); over a host tier in front of a remote store, only when
    the tier holds it now; never over a remote store alone (its values are ``RemoteScattered``, or staged).

    Why ask: a value the tier does not hold comes back ``NOT_CACHED`` from a memory read and is fetched
    again a poll later -- a cold prefix over redis paid that round trip for every value. The tier's index
    belongs to the loop thread; this reads one dict membership from vLLM's thread, and a stale answer
    costs only that round trip (or a per-value read of a held value), never a wrong value.
    """
    if not store.cached_reads:
        return lambda key: False
    tier = store.host_tier
    if tier is None or tier.inner.cached_reads:
        return lambda key: True
    return lambda key: key in tier.lru
