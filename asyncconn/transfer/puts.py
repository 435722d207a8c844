"""Put scheduling for the save tracker: a batch of staged saves becomes one ``exists`` and one ``put`` on the
loop, and comes back to the worker when the put task has really ended.

Why batches: one loop wake-up and one store round trip per ``put_batch`` saves instead of per save.

Threads and hand-over of a :class:`Batch`:

* **Made and submitted** by the thread that has the staged saves: the worker thread (CUDA, or CPU without a
  copy thread) or the copy thread (inside a copy job). That thread sets ``future`` (``Runtime.submit``) or,
  on the copy thread, ``error`` when the batch could not be submitted -- both before the worker can see the
  batch (the worker made it, or it arrives in the copy job's report).
* **The loop** runs :meth:`Putter.put`: it reads the saves' keys, headers and staged bytes and nothing else,
  and owns ``task`` and ``cancel_requested``. The worker asks for cancellation only through
  ``call_soon`` (:meth:`Putter.cancel`), so those two fields are never touched off the loop.
* **Back to the worker**: the future's done-callback runs on the loop once the put task has ended and
  appends the batch to the tracker's done deque (``deque.append`` is thread-safe). Only when the worker
  drains it there does it touch the saves again (release their staging, count them), so nothing overwrites
  bytes a put is still sending. That is why nobody cancels the future itself (a cancelled
  ``concurrent.futures.Future`` is done before its task has stopped): the future is completed from the
  task, so it is done only once the put has ended.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from asyncconn import codec
from asyncconn.runtime import LoopFuture, Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer._device import single_thread_torch
from asyncconn.transfer.failures import Failure
from asyncconn.transfer.staging import Save

__all__ = ["Batch", "Putter"]


class Batch:
    """Saves handed to the loop together; the worker learns the outcome when ``future`` is done."""

    __slots__ = ("cancel_requested", "error", "future", "saves", "task")

    def __init__(self, saves: list[Save]) -> None:
        self.saves = saves
        self.future: LoopFuture[list[bool]] | None = None  # set by the thread that submits the batch
        self.error: tuple[Failure, str] | None = None  # copy thread: the batch could not be submitted
        self.cancel_requested = False  # loop-owned
        self.task: asyncio.Task[list[bool]] | None = None  # loop-owned


class Putter:
    """Submits batches to the loop and hands each back through ``hand_back`` once its put has ended.

    Holds no mutable state of its own: any thread may :meth:`submit` and :meth:`cancel`.
    """

    def __init__(
        self,
        store: TensorStore,
        runtime: Runtime,
        *,
        skip_existing: bool,
        hand_back: Callable[[Batch], object],
    ) -> None:
        self.store = store
        self.runtime = runtime
        self.skip_existing = skip_existing
        self._hand_back = hand_back

    def submit(self, batch: Batch) -> None:
        """Start ``batch``'s put on the loop (sets ``batch.future``); raises ``RuntimeClosed``."""
        batch.future = self.runtime.submit(self.put(batch))

    def hand_back_when_done(self, batch: Batch) -> None:
        """Append ``batch`` to the worker's done deque once its put task has ended (from the loop thread).

        Separate from :meth:`submit` so that the copy thread can report its job before any of the job's
        batches can come back: the worker must register a batch before it sees the batch done.
        """
        assert batch.future is not None
        batch.future.add_done_callback(functools.partial(_hand_back, self._hand_back, batch))

    def cancel(self, batch: Batch) -> None:
        """Ask the loop to cancel ``batch``'s put (before or after it started); raises ``RuntimeClosed``."""
        self.runtime.call_soon(_cancel_on_loop, batch)

    async def put(self, batch: Batch) -> list[bool]:
        """Write the staged tensors that the store lacks; per save, True if it was already there.

        Runs on the loop. The staging buffers stay on loan until this has returned (the worker releases them
        when it drains the batch), so nothing can overwrite bytes that a put is still sending.
        """
        single_thread_torch()  # the loop's own copies must not start an OpenMP team beside the engine's
        if batch.cancel_requested:
            raise asyncio.CancelledError
        batch.task = asyncio.current_task()  # type: ignore[assignment]
        try:
            keys = [s.key for s in batch.saves]
            present = await self.store.exists(keys) if self.skip_existing else [False] * len(keys)
            todo = [s for s, there in zip(batch.saves, present, strict=True) if not there]
            if todo and all(s.header is not None for s in todo):  # framed by the copy thread already
                await self.store.put_frames(
                    [(s.key, s.header, codec.tensor_bytes(s.staging())) for s in todo if s.header is not None]
                )
            elif todo:
                await self.store.put([(s.key, s.staging()) for s in todo])
            return list(present)
        finally:
            batch.task = None


def _cancel_on_loop(batch: Batch) -> None:
    batch.cancel_requested = True
    if batch.task is not None:
        batch.task.cancel()


def _hand_back(hand_back: Callable[[Batch], object], batch: Batch, _future: object) -> None:
    """The batch future's done-callback, on the loop thread once the put task has really ended: hand the
    batch to the worker, which drains its deque instead of scanning its batches."""
    hand_back(batch)
