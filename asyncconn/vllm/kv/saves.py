"""How a step's saves reach the save tracker: one mode per device, chosen once when the caches are registered.

Every mode saves the same thing -- the step's values gathered value-major by
:meth:`~asyncconn.vllm.kv.layout.CacheLayout.gather`, nothing copied or sent to the store on vLLM's thread --
and differs only in where the gather and the snapshot run, and in what protects a preempted request's blocks
(vLLM reuses them in the very step that reports the preemption):

* :class:`CopyThreadSaves` (CPU, the save tracker's copy thread): the gather is lazy, evaluated on the copy
  thread; vLLM's thread hands each request's values over as one :class:`~asyncconn.transfer.lazy.Pieces`
  range named by value hash (store keys are derived on the copy thread). Preemption waits for the copies
  still reading those requests' blocks.
* :class:`StreamSaves` (CUDA): gathered on the current stream (kernel launches), snapshotted by one D2H on
  the tracker's side stream into one staging span. Preemption waits for those requests' saves.
* :class:`InlineSaves` (CPU without a copy thread): gathered and copied inside ``submit``; nothing to wait for
  at preemption.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncconn.transfer import SaveTracker
from asyncconn.transfer.lazy import Pieces, Shared
from asyncconn.vllm.kv.keys import KeySpace
from asyncconn.vllm.kv.layout import CacheLayout
from asyncconn.vllm.kv.metadata import SaveSpec
from asyncconn.vllm.kv.parts import part_ident

__all__ = ["CopyThreadSaves", "InlineSaves", "StepSaves", "StreamSaves", "step_saves"]

log = logging.getLogger(__name__)


class StepSaves(ABC):
    """Hands a step's values to the save tracker (``submit``) and guards preempted requests' blocks."""

    def __init__(self, saver: SaveTracker, layout: CacheLayout, *, part: int = 0) -> None:
        self.saver = saver
        self.layout = layout
        self.part = part  # which part of a value ``layout`` holds (``ValueRef.part``)

    @abstractmethod
    def submit(self, specs: Sequence[SaveSpec], keys: KeySpace, rank: int) -> tuple[dict[str, int], int]:
        """Hand the values of ``specs`` over; returns (values accepted per request that has values, values
        offered). Duplicates of values saved or being saved are not accepted."""

    @abstractmethod
    def protect(self, preempted: set[str], timeout: float) -> set[str]:
        """Return once no save reads the blocks of ``preempted`` any more (bounded by ``timeout``); the
        requests whose saves ended meanwhile."""


class CopyThreadSaves(StepSaves):
    """CPU with the tracker's copy thread: the step's gather is one lazy :class:`Shared`, each request a
    :class:`Pieces` range of it. Duplicates are detected by value hash; the store key (a blake2b each) is
    derived on the copy thread -- one worker, one rank, one key space: a hash names its key one way only.

    ``windowed``: some KV cache group frees blocks while the request runs (sliding-window, chunked-local),
    and the next step may zero and write them for another request, so the gather runs here, on vLLM's
    thread, before ``submit`` returns.
    """

    def __init__(self, saver: SaveTracker, layout: CacheLayout, *, windowed: bool, part: int = 0) -> None:
        super().__init__(saver, layout, part=part)
        self.windowed = windowed
        self._namer: tuple[KeySpace, int, Callable[[Any], str]] | None = None

    def _name(self, keys: KeySpace, rank: int) -> Callable[[Any], str]:
        if self._namer is None or self._namer[0] is not keys or self._namer[1] != rank:
            namer = keys.namer(rank)
            # Another part's idents are ``(part, hash)`` (``part_ident``): named by the hash.
            self._namer = (keys, rank, namer if self.part == 0 else (lambda ident: namer(ident[1])))
        return self._namer[2]

    def submit(self, specs: Sequence[SaveSpec], keys: KeySpace, rank: int) -> tuple[dict[str, int], int]:
        layout = self.layout
        specs = tuple(specs)  # the copy thread reads their block ids later: a private, immutable copy
        shape = layout.value_shape
        # One value is ``num_layers`` consecutive rows of the step's gather (value-major, flattened).
        shared = Shared(functools.partial(_gather_rows, layout, specs))
        if self.windowed:
            shared.get()  # a private copy of the step's blocks before vLLM may reuse them
        name = self._name(keys, rank)
        submit_many = self.saver.submit_many
        accepted: dict[str, int] = {}
        start = 0
        for spec in specs:
            refs = spec.values
            n = len(refs)
            if not n:
                continue
            values = Pieces(shared, 0, shape[0], n, shape, layout.dtype, start)
            idents = [part_ident(self.part, ref.value_hash) for ref in refs]
            got = submit_many(spec.request_id, idents, values, name=name)
            accepted[spec.request_id] = accepted.get(spec.request_id, 0) + got
            start += n
        return accepted, start

    def protect(self, preempted: set[str], timeout: float) -> set[str]:
        """Only the copies still pending for those requests are waited for: their puts read staging, not
        the blocks."""
        if not self.saver.wait_snapshots(preempted, timeout):
            log.warning("KV snapshots of preempted requests %s still running", sorted(preempted))
        return set()


class InlineSaves(StepSaves):
    """Synchronous snapshots: the step is gathered here, value-major, and handed to the tracker as one stack
    (one staging span and one snapshot copy for the step)."""

    def submit(self, specs: Sequence[SaveSpec], keys: KeySpace, rank: int) -> tuple[dict[str, int], int]:
        refs = [(spec.request_id, ref) for spec in specs for ref in spec.values]
        if not refs:
            return {}, 0
        stacked = self.layout.gather([ref for _, ref in refs])
        names = keys.store_keys([ref.value_hash for _, ref in refs], rank)
        items = [(rid, key) for (rid, _), key in zip(refs, names, strict=True)]
        accepted = dict.fromkeys((rid for rid, _ in refs), 0)
        # As CopyThreadSaves: a value is known by its hash (another part by ``(part, hash)``).
        idents = [part_ident(self.part, ref.value_hash) for _, ref in refs]
        for row in self.saver.submit_stacked(items, stacked, idents):
            accepted[items[row][0]] += 1
        return accepted, len(refs)

    def protect(self, preempted: set[str], timeout: float) -> set[str]:
        """The snapshot was taken inside ``submit``: nothing reads the blocks any more."""
        return set()


class StreamSaves(InlineSaves):
    """CUDA: the snapshot is an asynchronous D2H on the tracker's side stream, and the tracker tells only
    when a request's saves are done, so preemption waits for those saves, bounded."""

    def protect(self, preempted: set[str], timeout: float) -> set[str]:
        busy = [rid for rid in preempted if self.saver.pending(rid)]
        if not busy:
            return set()
        done = self.saver.wait(busy, timeout)
        if len(done) < len(busy):
            log.warning("KV saves of preempted requests %s still running", sorted(set(busy) - done))
        return done


def step_saves(saver: SaveTracker, layout: CacheLayout, *, windowed: bool, part: int = 0) -> StepSaves:
    """The mode for this tracker's device (see the module docstring), for values' part ``part``."""
    if saver.copy_thread is not None:
        return CopyThreadSaves(saver, layout, windowed=windowed, part=part)
    if saver.device.synchronous:
        return InlineSaves(saver, layout, part=part)
    return StreamSaves(saver, layout, part=part)


def _gather_rows(layout: CacheLayout, specs: Sequence[SaveSpec]) -> torch.Tensor:
    """The step's values gathered value-major, flattened to ``[values * num_layers, *layer_shape]`` (run by
    the copy thread)."""
    return layout.gather([ref for spec in specs for ref in spec.values]).flatten(0, 1)
