"""How a :class:`~asyncconn.transfer.saver.SaveTracker` snapshots: one strategy, chosen when it is built.

The tracker keeps the bookkeeping every mode shares (requests, duplicates, staging buffers and the queue
waiting for them, put batches, completion); a :class:`SaveDevice` does what differs between modes: how a
save is snapshotted once it has a buffer, how the step's saves reach the loop, and what a caller waits on
before the sources may be reused. The implementations, one module each:

* :class:`~asyncconn.transfer.saves_events.EventSaves` -- the device copies at ``submit`` (CUDA: a D2H on
  the side stream; a ``CpuDevice`` without a copy thread: a synchronous copy), ``flush`` hands the saves
  whose event fired to the loop;
* :class:`~asyncconn.transfer.saves_thread.ThreadSaves` -- a CPU device's copy thread does the copies and
  the hand-off, one job per ``flush``.

A strategy belongs to its tracker and runs on the tracker's thread; it reaches the shared bookkeeping
through the tracker it is bound to.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncconn.transfer.copythread import CopyThread
from asyncconn.transfer.lazy import LazyTensor
from asyncconn.transfer.staging import Save, Source

if TYPE_CHECKING:
    from asyncconn.transfer.saver import SaveTracker

__all__ = ["SaveDevice"]


class SaveDevice(abc.ABC):
    """One save mode of a :class:`SaveTracker`; see the module docstring."""

    #: The copy thread the snapshots run on (None when the device copies by itself).
    copy_thread: CopyThread | None = None

    def __init__(self, tracker: SaveTracker) -> None:
        self.tracker = tracker

    @abc.abstractmethod
    def new_save(self, request_id: str, key: str, tensor: torch.Tensor | LazyTensor) -> Save:
        """The save of one ``submit`` (a lazy source evaluated now or on the copy thread)."""

    def waiting(self, save: Save) -> None:
        """``save`` is queued for a staging buffer (a copy thread still reads its lazy source now)."""
        return None

    @abc.abstractmethod
    def snapshot(self, save: Save) -> None:
        """``save`` has its staging buffer: copy into it now, or stage the copy."""

    @abc.abstractmethod
    def submit_many(
        self,
        request_id: str,
        keys: Sequence[Hashable],
        values: Sequence[Source],
        name: Callable[[Any], str] | None,
    ) -> int:
        """:meth:`SaveTracker.submit_many` (arguments checked)."""

    @abc.abstractmethod
    def submit_stacked(
        self,
        items: Sequence[tuple[str, str]],
        stacked: torch.Tensor,
        idents: Sequence[Hashable],
        taken: list[int],
    ) -> list[int]:
        """:meth:`SaveTracker.submit_stacked` (arguments checked; ``taken``: the rows that are no
        duplicates)."""

    @abc.abstractmethod
    def handoff(self) -> None:
        """Hand the staged saves on towards the loop (``flush``)."""

    def job_done(self, job: object) -> None:
        """A report this mode's copy thread put on the tracker's done deque."""
        raise AssertionError(f"unexpected report {job!r}")

    def wait_copies(self, wanted: set[str], timeout: float) -> bool:
        """Block up to ``timeout`` on a copy reading ``wanted``'s sources; False when there is none."""
        return False

    def copying(self, wanted: set[str]) -> bool:
        """Whether a snapshot of ``wanted`` was issued and has not completed (an event to re-check)."""
        return False

    @abc.abstractmethod
    def wait_snapshots(self, wanted: set[str], deadline: float) -> bool:
        """:meth:`SaveTracker.wait_snapshots`: True once nothing reads ``wanted``'s sources any more."""

    @property
    def copy_jobs(self) -> int:
        """Copy jobs posted and not reported back yet."""
        return 0

    def cancel(self) -> None:
        """``close``'s grace period is over: start no more puts, forget the lazy sources of queued saves."""
        return None

    def close(self, timeout: float) -> bool:
        """Stop what this mode runs (its copy thread); True when it ended within ``timeout``."""
        return True
