"""SaveTracker: snapshot now, put later, report completion per request -- ``wait_for_save`` without the wait.

``submit(request_id, key, tensor)`` returns at once. It copies the tensor into a staging buffer -- on CUDA a
D2H on the tracker's side stream, ordered after an event recorded on the producing stream; on CPU a
synchronous copy -- and stages the save. It does not touch the loop: :meth:`SaveTracker.flush` hands every
staged save to the loop in batches (one ``exists`` and one ``put`` per batch, one loop wake-up per batch), and
``poll_finished``, ``pending`` and ``wait`` flush first. The KV adapter calls ``flush()`` from
``wait_for_save()``, at the end of the step's saves. Waking the loop once per save would hand the GIL to the
loop thread in the middle of the worker's kernel launches, which is what makes a submit's tail slow.

The loop never waits on CUDA: *the worker* notices that a D2H event has fired (``event.query()`` in
``flush``) and only then hands the staged bytes to the loop. The alternative -- the loop polling
``event.query()`` on a timer -- would wake the loop thread for nothing most of the time.

A request is reported by :meth:`SaveTracker.poll_finished` once all of its saves are done, whether they
succeeded or failed (failures are counted and logged: a failed save is a future miss, never a hung request),
and then every trace of it is dropped. :meth:`SaveTracker.wait` blocks for given requests only (preemption).

Duplicates are not re-sent: a key saved recently by this tracker (a bounded LRU set) or being saved right now
is skipped at ``submit``; with ``skip_existing`` the loop asks the store ``exists`` for each batch and puts
only the missing keys. Keys are content addresses (block hashes, mm hashes): the same key, the same bytes.

The caller's tensor: on CPU it may be reused as soon as ``submit`` returns. On CUDA the snapshot itself runs
asynchronously, and when the pool has no staging buffer free the save waits in a queue holding a reference
to the tensor; in both cases the tensor must not be *written* until the request is reported -- exactly the
contract of vLLM's delayed block free (``request_finished`` -> True). Freeing it is always safe.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Iterable

import torch

from asyncconn.exceptions import PoolTooSmall, RuntimeClosed, TransferError
from asyncconn.runtime import LoopFuture, Runtime, get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer._device import Event, TransferDevice, default_device
from asyncconn.transfer.failures import Failure, classify
from asyncconn.transfer.pool import PinnedBuffer, PinnedPool

__all__ = ["SaveTracker"]

log = logging.getLogger(__name__)


class _Save:
    __slots__ = ("buf", "dtype", "event", "key", "producer", "request_id", "shape", "tensor")

    def __init__(self, request_id: str, key: str, tensor: torch.Tensor, producer: Event) -> None:
        self.request_id = request_id
        self.key = key
        self.tensor: torch.Tensor | None = tensor  # the caller's tensor, until snapshotted
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.producer: Event | None = producer  # "the kernels that wrote tensor", recorded at submit
        self.buf: PinnedBuffer | None = None
        self.event: Event | None = None  # the snapshot copy

    def staging(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf.view(self.dtype, self.shape)


class _Batch:
    """Saves handed to the loop together; the worker learns the outcome when ``future`` is done."""

    __slots__ = ("cancel_requested", "future", "saves", "task")

    def __init__(self, saves: list[_Save]) -> None:
        self.saves = saves
        self.future: LoopFuture[list[bool]] | None = None
        self.cancel_requested = False  # loop-owned
        self.task: asyncio.Task[list[bool]] | None = None  # loop-owned


class _Request:
    __slots__ = ("failed", "pending")

    def __init__(self) -> None:
        self.pending = 0
        self.failed = 0


class SaveTracker:
    """Deferred saves to a :class:`TensorStore`, tracked per request. Call every method from one thread.

    ``put_batch`` bounds the saves per loop hand-off (one ``exists`` + one ``put`` each); ``recent_keys``
    bounds the set of keys remembered as saved.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        runtime: Runtime | None = None,
        device: TransferDevice | None = None,
        pool: PinnedPool | None = None,
        skip_existing: bool = True,
        recent_keys: int = 65536,
        put_batch: int = 64,
    ) -> None:
        if recent_keys < 0:
            raise TransferError(f"recent_keys must be >= 0, got {recent_keys}")
        if put_batch <= 0:
            raise TransferError(f"put_batch must be > 0, got {put_batch}")
        self.store = store
        self.runtime = runtime if runtime is not None else get_runtime()
        self.device = device if device is not None else default_device()
        self.pool = pool if pool is not None else PinnedPool(device=self.device)
        self.skip_existing = skip_existing
        self.recent_keys = recent_keys
        self.put_batch = put_batch
        self._requests: dict[str, _Request] = {}
        self._finished: set[str] = set()  # all saves done, not reported yet
        self._queued: collections.deque[_Save] = collections.deque()  # waiting for a staging buffer
        self._copying: collections.deque[_Save] = collections.deque()  # snapshot issued, event not fired
        self._staged: list[_Save] = []  # snapshot complete, not handed to the loop yet
        self._batches: set[_Batch] = set()  # running on the loop
        self._done: collections.deque[_Batch] = collections.deque()  # appended on the loop thread
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._inflight_keys: set[str] = set()
        self._closed = False
        # Leak counters.
        self.buffers_out = 0
        self.events_out = 0
        self.futures_pending = 0
        # Totals.
        self.saved = 0
        self.saved_bytes = 0
        self.skipped = 0  # duplicates caught at submit (recent or in flight)
        self.skipped_existing = 0  # already in the store (exists before put)
        self.requests_failed = 0
        self.failures: collections.Counter[Failure] = collections.Counter()

    # -- public API ------------------------------------------------------------------------------------
    def submit(self, request_id: str, key: str, tensor: torch.Tensor) -> bool:
        """Snapshot ``tensor`` to save it under ``key`` for ``request_id``; never waits, never wakes the loop.

        Returns False when the key is skipped as a duplicate (saved recently or being saved now).
        """
        if self._closed:
            raise TransferError("SaveTracker is closed")
        request = self._requests.get(request_id)
        if request is None:
            request = self._requests[request_id] = _Request()
        if key in self._inflight_keys or key in self._recent:
            self.skipped += 1
            if request.pending == 0:
                self._finished.add(request_id)
            return False
        self._finished.discard(request_id)
        request.pending += 1
        self._inflight_keys.add(key)
        save = _Save(request_id, key, tensor, self.device.mark())
        if self._queued or not self._snapshot(save):
            self._queued.append(save)
        return True

    def flush(self) -> None:
        """Hand every snapshotted save to the loop, in batches; the adapter's ``wait_for_save`` calls this.

        Only the hand-off: completed puts are processed (buffers returned, requests counted) by
        ``poll_finished``, so this stays a few microseconds plus one loop wake-up per batch.
        """
        self._handoff()

    def pending(self, request_id: str) -> int:
        """Saves of ``request_id`` not finished yet (0 for an unknown or fully saved request)."""
        self._progress()
        request = self._requests.get(request_id)
        return request.pending if request is not None else 0

    def poll_finished(self) -> set[str]:
        """Request ids whose saves are all done (ok or failed) since the last call; then forgotten."""
        self._progress()
        return self._report(self._finished)

    def wait(self, request_ids: Iterable[str], timeout: float) -> set[str]:
        """Block until the saves of ``request_ids`` are done or ``timeout`` passes (preemption only).

        Returns the ids that finished; those are forgotten (not reported again by :meth:`poll_finished`).
        The others keep saving and are reported by a later :meth:`poll_finished`.
        """
        wanted = {r for r in request_ids if r in self._requests}
        deadline = time.monotonic() + timeout
        while True:
            self._progress()
            if wanted <= self._finished:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            futures = [
                b.future
                for b in self._batches
                if b.future is not None and any(s.request_id in wanted for s in b.saves)
            ]
            others = any(s.request_id in wanted for s in (*self._queued, *self._copying))
            if futures and not others:
                concurrent.futures.wait(futures, min(remaining, 0.05), concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(min(remaining, 0.0005))  # a D2H event or a staging buffer: re-check soon
        return self._report(wanted & self._finished)

    def counters(self) -> dict[str, int]:
        """Resources and state held right now; all 0 once every request is reported."""
        return {
            "requests": len(self._requests),
            "queued": len(self._queued),
            "buffers_out": self.buffers_out,
            "events_out": self.events_out,
            "futures_pending": self.futures_pending,
            "inflight_keys": len(self._inflight_keys),
        }

    def stats(self) -> dict[str, int]:
        out = {
            "saved": self.saved,
            "saved_bytes": self.saved_bytes,
            "skipped": self.skipped,
            "skipped_existing": self.skipped_existing,
            "requests_failed": self.requests_failed,
        }
        out.update({f"failed_{reason.value}": n for reason, n in self.failures.items()})
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Let running saves finish for up to ``timeout``, then cancel the rest and return their buffers."""
        if self._closed:
            return
        self._closed = True
        self.wait(list(self._requests), timeout)
        for save in self._queued:
            self._complete(save, Failure.STORE_ERROR, "tracker closed before the save started")
        self._queued.clear()
        for batch in self._batches:
            with contextlib.suppress(RuntimeClosed):
                self.runtime.call_soon(_cancel_on_loop, batch)
        deadline = time.monotonic() + timeout
        while (self.futures_pending or self.events_out) and time.monotonic() < deadline:
            self._progress()
            time.sleep(0.001)
        self._progress()
        self._finished.clear()
        self._requests.clear()
        if self.buffers_out:
            log.warning(
                "SaveTracker.close: %d staging buffers still out after %.1fs", self.buffers_out, timeout
            )

    # -- worker side -----------------------------------------------------------------------------------
    def _progress(self) -> None:
        while self._done:
            self._on_batch_done(self._done.popleft())
        while self._queued and self._snapshot(self._queued[0]):
            self._queued.popleft()  # buffers returned by finished batches: snapshot the queued saves
        self._handoff()

    def _handoff(self) -> None:
        while self._copying and self._copying[0].event is not None and self._copying[0].event.query():
            save = self._copying.popleft()
            self.events_out -= 1
            save.event = None
            self._staged.append(save)
        staged, self._staged = self._staged, []
        for start in range(0, len(staged), self.put_batch):
            self._start_batch(staged[start : start + self.put_batch])

    def _snapshot(self, save: _Save) -> bool:
        """Copy the tensor into staging; False when no buffer is free now (the save stays queued)."""
        tensor = save.tensor
        assert tensor is not None
        try:
            buf = self.pool.acquire(tensor.numel() * tensor.element_size())
        except PoolTooSmall as exc:
            self._complete(save, Failure.TOO_LARGE, str(exc))
            return True
        if buf is None:
            return False
        save.buf = buf
        self.buffers_out += 1
        try:
            save.event = self.device.copy([(save.staging(), tensor)], after=save.producer)
        except RuntimeError as exc:  # torch refused the copy (device error)
            self._complete(save, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}")
            return True
        save.tensor = None
        save.producer = None
        self.events_out += 1
        if not self._copying and save.event.query():
            self.events_out -= 1
            save.event = None
            self._staged.append(save)
        else:
            self._copying.append(save)
        return True

    def _start_batch(self, saves: list[_Save]) -> None:
        batch = _Batch(saves)
        try:
            future = self.runtime.submit(self._put_batch(batch))
        except RuntimeClosed as exc:
            for save in saves:
                self._complete(save, Failure.STORE_ERROR, f"runtime closed: {exc}")
            return
        batch.future = future
        self.futures_pending += 1
        self._batches.add(batch)
        future.add_done_callback(functools.partial(_enqueue, self._done, batch))

    def _on_batch_done(self, batch: _Batch) -> None:
        future, batch.future = batch.future, None
        assert future is not None and future.done()
        self.futures_pending -= 1
        self._batches.discard(batch)
        if future.cancelled():
            log.warning("%d saves cancelled (tracker or runtime closed)", len(batch.saves))
            for save in batch.saves:
                self._complete(save, Failure.STORE_ERROR, "put cancelled", quiet=True)
            return
        exc = future.exception()
        if exc is not None:
            reason, detail = classify(exc)
            # One line per failed batch, not per save: a store that is down must not flood the log.
            log.warning("%d saves failed, %s: %s", len(batch.saves), reason, detail)
            for save in batch.saves:
                self._complete(save, reason, detail, quiet=True)
            return
        for save, existed in zip(batch.saves, future.result(), strict=True):
            if existed:
                self.skipped_existing += 1
            else:
                self.saved += 1
                self.saved_bytes += save.buf.nbytes if save.buf is not None else 0
            self._remember(save.key)
            self._complete(save, None, "")

    def _complete(self, save: _Save, failure: Failure | None, detail: str, *, quiet: bool = False) -> None:
        """Release everything the save holds and count it against its request."""
        if save.buf is not None:
            self.pool.release(save.buf)
            save.buf = None
            self.buffers_out -= 1
        save.tensor = None
        self._inflight_keys.discard(save.key)
        if failure is not None:
            self.failures[failure] += 1
        if failure is not None and not quiet:
            log.warning("save of %r (request %r) failed, %s: %s", save.key, save.request_id, failure, detail)
        request = self._requests.get(save.request_id)
        if request is None:
            return  # forgotten by a close() that timed out
        request.pending -= 1
        if failure is not None:
            request.failed += 1
        if request.pending == 0:
            self._finished.add(save.request_id)

    def _report(self, ids: set[str]) -> set[str]:
        out = set(ids)
        for request_id in out:
            request = self._requests.pop(request_id, None)
            if request is not None and request.failed:
                self.requests_failed += 1
            self._finished.discard(request_id)
        return out

    def _remember(self, key: str) -> None:
        if not self.recent_keys:
            return
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > self.recent_keys:
            self._recent.popitem(last=False)

    # -- loop side -------------------------------------------------------------------------------------
    async def _put_batch(self, batch: _Batch) -> list[bool]:
        """Write the staged tensors that the store lacks; per save, True if it was already there.

        Runs on the loop. The staging buffers stay on loan until this has returned (the worker releases them
        when it sees the future done), so nothing can overwrite bytes that a put is still sending.
        """
        if batch.cancel_requested:
            raise asyncio.CancelledError
        batch.task = asyncio.current_task()  # type: ignore[assignment]
        try:
            keys = [s.key for s in batch.saves]
            present = await self.store.exists(keys) if self.skip_existing else [False] * len(keys)
            todo = [(s.key, s.staging()) for s, there in zip(batch.saves, present, strict=True) if not there]
            if todo:
                await self.store.put(todo)
            return list(present)
        finally:
            batch.task = None


def _cancel_on_loop(batch: _Batch) -> None:
    batch.cancel_requested = True
    if batch.task is not None:
        batch.task.cancel()


def _enqueue(queue: collections.deque[_Batch], batch: _Batch, _future: object) -> None:
    """The batch future's done-callback, on the loop thread once the put task has really ended: hand the
    batch to the worker (``deque.append`` is thread-safe), which drains the deque instead of scanning."""
    queue.append(batch)
