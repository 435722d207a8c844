"""Saves snapshotted by the device itself: a CUDA D2H on the side stream, or a synchronous CPU copy.

``submit`` issues the copy -- on CUDA ordered after an event recorded on the producing stream -- and
``flush`` notices fired events (``event.query()``) and hands the staged saves to the loop in batches (one
``exists`` and one ``put`` per batch, one loop wake-up per batch). The loop never waits on CUDA; the
alternative -- the loop polling events on a timer -- would wake it for nothing most of the time.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncconn.exceptions import PoolTooSmall
from asyncconn.transfer.failures import Failure
from asyncconn.transfer.lazy import LazyTensor
from asyncconn.transfer.runs import runs
from asyncconn.transfer.savedevice import SaveDevice
from asyncconn.transfer.staging import Save, Source, Span, aligned

if TYPE_CHECKING:
    from asyncconn.transfer.saver import SaveTracker

__all__ = ["EventSaves"]


class EventSaves(SaveDevice):
    """The device copies at ``submit``; ``flush`` hands the saves whose copy is done to the loop."""

    def __init__(self, tracker: SaveTracker) -> None:
        super().__init__(tracker)
        self._copying: collections.deque[Save] = collections.deque()  # snapshot issued, event not fired
        self._staged: list[Save] = []  # snapshot complete, not handed to the loop yet

    def new_save(self, request_id: str, key: str, tensor: torch.Tensor | LazyTensor) -> Save:
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor()
        return Save(request_id, key, tensor, self.tracker.device.mark())

    def snapshot(self, save: Save) -> None:
        tracker = self.tracker
        tensor = save.source
        assert isinstance(tensor, torch.Tensor)
        try:
            save.event = tracker.device.copy([(save.staging(), tensor)], after=save.producer)
        except RuntimeError as exc:  # torch refused the copy (device error)
            tracker._complete(save, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}")
            return
        save.source = None
        save.producer = None
        tracker.events_out += 1
        if not self._copying and save.event.query():
            tracker.events_out -= 1
            save.event = None
            self._staged.append(save)
        else:
            self._copying.append(save)

    def submit_many(
        self,
        request_id: str,
        keys: Sequence[Hashable],
        values: Sequence[Source],
        name: Callable[[Any], str] | None,
    ) -> int:
        return self.tracker._submit_each(request_id, keys, values, name)

    def submit_stacked(
        self,
        items: Sequence[tuple[str, str]],
        stacked: torch.Tensor,
        idents: Sequence[Hashable],
        taken: list[int],
    ) -> list[int]:
        """One staging span and one copy (a copy per run of consecutive rows), one event for the rows of
        ``taken``; one by one (``submit``) when saves are queued already or the pool cannot give the span."""
        tracker = self.tracker
        nbytes = stacked[0].numel() * stacked.element_size() if len(items) else 0
        stride = aligned(nbytes)
        buf = None
        if taken and not tracker._queued:
            with contextlib.suppress(PoolTooSmall):  # one by one below: each value may still fit
                buf = tracker.pool.acquire(stride * len(taken))
        if buf is None:
            return tracker._submit_rows(items, stacked, idents)
        tracker.buffers_out += 1
        span = Span(buf, len(taken))
        producer = tracker.device.mark()
        saves: list[Save] = []
        for i, (rid, key) in enumerate(items):
            if not tracker._admit(rid, idents[i]):  # the rows of ``taken``: the same test, in the same order
                continue
            save = Save(rid, key, stacked[i], None)
            save.ident = idents[i]
            save.source = None
            save.span, save.offset = span, len(saves) * stride
            saves.append(save)
        try:
            event = tracker.device.copy(_span_pairs(buf.storage, stacked, taken, stride), after=producer)
        except RuntimeError as exc:  # torch refused the copy (device error)
            for save in saves:
                tracker._complete(save, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}")
            return taken
        if not self._copying and event.query():
            self._staged.extend(saves)
            return taken
        for save in saves:
            save.event = event
        tracker.events_out += len(saves)
        self._copying.extend(saves)
        return taken

    def handoff(self) -> None:
        tracker = self.tracker
        while self._copying and self._copying[0].event is not None and self._copying[0].event.query():
            save = self._copying.popleft()
            tracker.events_out -= 1
            save.event = None
            self._staged.append(save)
        staged, self._staged = self._staged, []
        for start in range(0, len(staged), tracker.put_batch):
            tracker._start_batch(staged[start : start + tracker.put_batch])

    def copying(self, wanted: set[str]) -> bool:
        return any(s.request_id in wanted for s in self._copying)

    def wait_snapshots(self, wanted: set[str], deadline: float) -> bool:
        """A CPU snapshot happened in ``submit``; a CUDA one is followed through its event, queued saves
        included."""
        tracker = self.tracker
        while any(s.request_id in wanted for s in tracker._queued) or self.copying(wanted):
            if time.monotonic() >= deadline:
                return False
            tracker._progress()
            time.sleep(0.0005)
        return True


def _span_pairs(
    storage: torch.Tensor, stacked: torch.Tensor, rows: list[int], stride: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy pairs putting ``stacked[rows]`` one after another into ``storage`` (uint8), ``stride`` bytes
    apart: one pair per run of consecutive rows when the rows are packed with no padding, else one per row."""
    row_bytes = stacked[0].numel() * stacked.element_size()
    shape, dtype = tuple(stacked.shape[1:]), stacked.dtype
    row_runs = runs(rows) if stride == row_bytes else [(row, 1) for row in rows]
    pairs = []
    offset = 0
    for first, count in row_runs:
        dst = storage[offset : offset + count * row_bytes].view(dtype).view(count, *shape)
        pairs.append((dst, stacked[first : first + count]))
        offset += count * stride
    return pairs
