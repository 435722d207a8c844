"""StreamLoader: store -> pinned staging (on the loop) -> device (on a side stream), polled from the worker.

A load moves through three states, each owned by one thread (docs/architecture.md, one owner per structure):

1. *queued* (worker): waiting for a staging buffer. When the pool answers "not now" the key stays queued, in
   order, and is retried on the next :meth:`StreamLoader.poll` -- back-pressure instead of an allocation.
   Only the worker gives buffers back (a buffer is free once its value is copied out), so this wait is the
   one part of a load that moves at the worker's pace.
2. *fetching* (loop): ``TensorStore.read_into`` reads and validates the frame straight into the staging
   buffer. The loop never touches CUDA. Every load that has a buffer is handed to the loop at once;
   ``max_inflight`` bounds the store calls running together *on the loop* (a semaphore), so a load waiting
   for a call slot starts the moment another call ends -- not at the worker's next ``poll``, which in a
   serving engine can be a long prefill step away. The loads started by one ``submit``/``poll`` call are
   handed to the loop together (one wake-up, one task per load so each can be cancelled); when a load's
   task ends, its done-callback records the outcome and puts the load on a thread-safe deque that the
   worker drains in ``poll()``; nothing is scanned. On a store that reads batches in one call
   (``TensorStore.batch_reads``: ``file://``), loads of a known shape go in groups of about ``GROUP_BYTES``
   instead, one task and one store call per group: the fixed cost of a call, several times a page-cached
   read of a KV value, is paid once per group, and the reads and checksums run on the store's threads, not
   the loop.
3. *copying* (worker): the worker issues the H2D copy on the side stream, records an event, and hands the
   tensor out from a later ``poll()`` once ``event.query()`` is true. The staging buffer goes back to the pool
   at the same moment (the copy has read it).

Failures -- miss, corrupt, timeout, store error, too large, device error -- come back from ``poll()`` as
:class:`LoadResult` values with a reason; no exception from the store ever reaches the worker thread.

Direct loads (a destination type registered in :mod:`asyncconn.transfer.direct`: the in-place loads of
:mod:`asyncconn.transfer.in_place`) skip state 1's buffer and state 3: the store reads the value straight
into the caller's memory, in groups that kind's :class:`~asyncconn.transfer.direct.DirectLoads` sizes and
reads, and the result is reported as soon as the read has ended.

Cancellation (``cancel(key)``) never frees a buffer that something may still write: a queued load is simply
dropped; a fetching load's task is cancelled *on the loop* (a load in a group is only marked: its group's
read goes on for the others) and its buffer is returned only when the task's done-callback has reported it,
i.e. after the task has really stopped (a cancelled ``concurrent.futures.Future`` would report "done" before
the loop task has run its cancellation); a copying
load keeps its buffer until its event fires, and its device tensor is dropped (it was allocated on the side
stream, so the allocator cannot hand it out before the copy is done).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from asyncconn._deprecated import renamed_method
from asyncconn.exceptions import DuplicateTransfer, PoolTooSmall, RuntimeClosed, TransferError
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import Fetch, TensorStore
from asyncconn.transfer._device import (
    LOAD_PRIORITY,
    Event,
    TransferDevice,
    default_device,
    single_thread_torch,
)
from asyncconn.transfer.dest import TensorSpec
from asyncconn.transfer.direct import DIRECT_LOADS, DirectLoads
from asyncconn.transfer.failures import Failure, classify
from asyncconn.transfer.pool import PinnedBuffer, PinnedPool

__all__ = ["GROUP_BYTES", "LoadResult", "StreamLoader"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Staging bytes read by one store call when the backend serves batches (``TensorStore.batch_reads``).
#: Small enough that the first values land (and the worker copies them out) while later groups are read;
#: large enough that a call's fixed cost is spread over several values.
GROUP_BYTES = 4 << 20

_QUEUED, _FETCHING, _COPYING, _DONE = "queued", "fetching", "copying", "done"


@dataclass(slots=True)
class LoadResult:
    """One finished load: ``tensor`` is ready on the default stream, or ``failure`` says why there is none.

    A direct load (:mod:`asyncconn.transfer.direct`: an in-place load) that succeeded has ``in_place`` set
    and no tensor: its bytes are in the caller's memory.
    """

    key: str
    tensor: torch.Tensor | None
    failure: Failure | None = None
    detail: str = ""
    in_place: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(slots=True)
class _Fetched:
    """What the loop hands back: a failure, or the dtype/shape now in the staging buffer."""

    failure: Failure | None = None
    detail: str = ""
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


class _Load:
    __slots__ = (
        "buf",
        "cancel_requested",
        "cancelled",
        "dest",
        "direct",
        "event",
        "fetched",
        "key",
        "out",
        "started_at",
        "state",
        "task",
    )

    def __init__(self, key: str, dest: Any, direct: DirectLoads | None) -> None:
        self.key = key
        self.dest = dest  # a TensorSpec, or a destination ``direct`` loads
        self.direct = direct
        self.state = _QUEUED
        self.buf: PinnedBuffer | None = None
        self.fetched: _Fetched | None = None  # written on the loop before the load is handed back
        self.event: Event | None = None
        self.out: torch.Tensor | None = None
        self.cancelled = False  # worker-owned
        self.cancel_requested = False  # loop-owned
        self.task: asyncio.Task[None] | None = None  # loop-owned
        self.started_at = 0.0  # loop-owned: when its store call began (0: not begun); read by the worker


class StreamLoader:
    """Loads values from a :class:`TensorStore` onto the device without ever blocking the calling thread.

    All methods are called from one thread (vLLM's worker), which owns the device state. ``max_inflight``
    bounds the store calls running on the loop at once (staged loads; direct reads are not held back); the
    pool bounds the staging bytes. ``rows``: on a device
    that copies asynchronously, the values of one dtype and shape that one ``poll`` copies land as the rows
    of one device tensor (for a consumer that writes them on together and drops them together, like the KV
    connector; not for one that keeps some of them long -- a row keeps the whole tensor's memory).
    ``on_corrupt``: called (from :meth:`poll`) with the key of every value a fetch found damaged, the
    fetches of cancelled loads included -- the owner removes such values from the store (``Purger``), and a
    load cancelled after its read had found the damage would otherwise leave it there for good.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        runtime: Runtime | None = None,
        device: TransferDevice | None = None,
        pool: PinnedPool | None = None,
        max_inflight: int = 64,
        rows: bool = False,
        on_corrupt: Callable[[str], object] | None = None,
    ) -> None:
        if max_inflight <= 0:
            raise TransferError(f"max_inflight must be > 0, got {max_inflight}")
        self.store = store
        self.runtime = runtime if runtime is not None else get_runtime()
        self.device = device if device is not None else default_device(priority=LOAD_PRIORITY)
        self.pool = pool if pool is not None else PinnedPool(device=self.device)
        self.max_inflight = max_inflight
        # How a staged load's fetched value is handed over: the device's mode, chosen once.
        self._staged: _StagedHandOver = _OnHost() if self.device.synchronous else _OnDevice(rows)
        self.on_corrupt = on_corrupt
        # One per registered kind of direct destination (the in-place loads), by destination type.
        self._direct: dict[type, DirectLoads] = {t: make(self) for t, make in DIRECT_LOADS.items()}
        self._loads: dict[str, _Load] = {}  # live (not cancelled, not reported) loads by key
        self._queued: collections.deque[_Load] = collections.deque()
        self._fetched: collections.deque[_Load] = collections.deque()  # appended on the loop thread
        self._copying: collections.deque[_Load] = collections.deque()
        self._results: list[LoadResult] = []  # failures found outside poll(), reported by the next poll()
        self._landed = threading.Event()  # set on the loop when a fetch is handed back; cleared by poll()
        # How many fetches must wait to be polled before a landing wakes ``wait`` (written by the waiting
        # worker, read by the loop; 0 while nobody waits: every landing sets the event).
        self._wake_at = 0
        self._slots: asyncio.Semaphore | None = None  # loop-owned: ``max_inflight`` store calls at once
        # When a load last moved: a store call began or ended (loop) or queued loads got buffers (worker).
        # One clock per thread, each written by its owner only; :attr:`last_progress` reads both.
        self._loop_progress = time.monotonic()
        self._worker_progress = self._loop_progress
        self._closed = False
        # Leak counters: each must come back to 0 once every load is reported or cancelled and polled.
        self.buffers_out = 0
        self.events_out = 0
        self.futures_pending = 0
        # Totals.
        self.loaded = 0
        self.loaded_bytes = 0
        self.cancelled = 0
        self.failures: collections.Counter[Failure] = collections.Counter()

    # -- public API ------------------------------------------------------------------------------------
    def submit(self, key: str, dest: Any) -> None:
        """Start loading ``key`` into ``dest``; its result comes back from a later :meth:`poll`.

        ``dest``: a :class:`TensorSpec`, or a direct destination (:mod:`asyncconn.transfer.direct`).
        Raises :class:`DuplicateTransfer` if ``key`` is already loading (cancel it first), and
        :class:`TransferError` after :meth:`close`. Store problems never raise here: they are poll results.
        """
        self.submit_many([(key, dest)])

    def submit_many(self, items: Iterable[tuple[str, Any]]) -> None:
        """Submit several loads with one hand-off to the loop (one wake-up for a whole step's loads).

        All-or-nothing: every item is checked before any is queued.
        """
        if self._closed:
            raise TransferError("StreamLoader is closed")
        loads: list[_Load] = []
        keys: set[str] = set()
        for key, dest in items:
            if key in self._loads or key in keys:
                raise DuplicateTransfer(f"{key!r} is already being loaded")
            direct = self._direct.get(type(dest))
            if direct is not None:
                direct.check(dest)
            elif not isinstance(dest, TensorSpec):
                kinds = "".join(f" or {t.__name__}" for t in self._direct)
                raise TransferError(f"dest must be a TensorSpec{kinds}, not {type(dest).__name__}")
            keys.add(key)
            loads.append(_Load(key, dest, direct))
        for load in loads:
            self._loads[load.key] = load
            self._queued.append(load)
        self._start_queued()

    def poll(self, consume: Callable[[LoadResult], object] | None = None) -> list[LoadResult]:
        """Results of loads that completed since the last call (ready tensors and failures). Never blocks.

        With ``consume``, every result is handed to it instead (``poll`` then returns ``[]``), and on a host
        device (:attr:`TransferDevice.synchronous`) a loaded tensor is *the staging buffer itself*, valid
        only during the call: no copy into a new tensor, and the buffer goes back to the pool as soon as
        ``consume`` returns (or raises). For a caller that copies the value out at once (the KV connector
        scatters it into the cache). Elsewhere the tensor is the device copy, as without ``consume``.
        """
        if not (self._fetched or self._copying or self._queued or self._results):
            return []  # nothing in hand (every step of an engine that loads nothing)
        if self._landed.is_set():  # before draining: a fetch handed back from here on sets it again
            self._landed.clear()
        results, self._results = self._results, []
        while self._copying and self._copying[0].event is not None and self._copying[0].event.query():
            self._finish_copy(self._copying.popleft(), results)
        while self._fetched:
            load = self._fetched.popleft()
            if load.direct is not None:
                self._landed_direct(load, load.direct, results)
            else:
                self._staged.take(self, load, results, consume)
        self._start_queued()
        if consume is None:
            return results
        for result in results:
            consume(result)
        return []

    def wait(self, timeout: float, *, landed: int = 0) -> bool:
        """Block up to ``timeout`` seconds until every fetch in flight has landed; True if any did.

        For an engine with nothing else to do (a step that scheduled no tokens while loads are in flight):
        vLLM's engine loop steps again at once, and those empty steps hold the GIL that the loop thread needs
        to finish the very reads the engine is waiting for. A blocking wait hands the GIL over; it returns as
        soon as the last fetch is in (collect them with ``poll``), and at once when nothing is being fetched.
        ``landed``: return as soon as that many fetches have landed and are not polled yet, so the caller
        can use them (``poll``) while the others are still being read, and wait again. Only that landing
        wakes the caller: a wake-up per value had vLLM's thread take the GIL from the loop between the
        reads of one prefix, for nothing when the caller needed the whole of a request's values.
        """
        deadline = time.monotonic() + timeout
        try:
            while not self._copying and self.futures_pending > len(self._fetched):
                if landed and len(self._fetched) >= landed:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wake_at = min(landed, self.futures_pending) if landed else self.futures_pending
                self._landed.clear()
                # landed between the test and the clear
                if len(self._fetched) >= self._wake_at:
                    break
                self._landed.wait(remaining)
        finally:
            self._wake_at = 0
        return bool(self._fetched)

    def _wake(self) -> None:
        """On the loop, after a fetch was handed back: wake a waiting worker once the landing it waits for
        has come (see :meth:`wait`). Appending first, then reading ``_wake_at``, against the worker's
        setting it, clearing the event, then counting, loses no wake-up. A set event is left as it is."""
        if len(self._fetched) >= self._wake_at and not self._landed.is_set():
            self._landed.set()

    def cancel(self, key: str) -> bool:
        """Abandon a load (an aborted request): nothing is reported for it. False if it was not in flight.

        Also False for a direct (in-place) load already being read: the read writes the caller's memory
        until it ends, and the caller learns that it has ended from its result, which comes as usual.
        """
        load = self._loads.get(key)
        if load is None or (load.direct is not None and load.state != _QUEUED):
            return False
        del self._loads[key]
        load.cancelled = True
        self.cancelled += 1
        if load.state == _QUEUED:
            self._queued.remove(load)
            load.state = _DONE
        elif load.state == _FETCHING:
            # A closed runtime has cancelled every task already; the future completes on its own.
            with contextlib.suppress(RuntimeClosed):
                self.runtime.call_soon(_cancel_on_loop, load)
        elif load.state == _COPYING:
            load.out = None  # allocated on the side stream: freeing it while the copy runs is safe
        return True

    def interrupt(self, key: str) -> None:
        """Stop a direct load's read now, where its kind's reads can be abandoned (a remote in-place read
        whose request was let go of): its result still comes from :meth:`poll`, a failure unless it had
        landed, and once it has come nothing writes the caller's memory. Anything else reads on to its end.
        """
        load = self._loads.get(key)
        if load is None or load.direct is None or not load.direct.held or load.state != _FETCHING:
            return
        with contextlib.suppress(RuntimeClosed):
            self.runtime.call_soon(_cancel_on_loop, load)

    def pending(self) -> int:
        """Loads submitted and neither reported nor cancelled."""
        return len(self._loads)

    @property
    def last_progress(self) -> float:
        """``time.monotonic()`` when a load last moved: a store call began or ended, or queued loads got
        their buffers. A caller's deadline that runs from here measures a loader that is stuck, not one
        whose work is queued behind other work (which moves this clock as it goes)."""
        return max(self._loop_progress, self._worker_progress)

    def fetching_for(self, key: str, now: float) -> float:
        """Seconds the store call reading ``key`` has been running (0.0: not begun, done, or unknown).

        A value whose call runs past the caller's deadline is stuck (every store call is bounded by the
        store's own timeout, so this is a store that ignores it, or a bug); one waiting for a buffer or a
        call slot reads 0 here.
        """
        load = self._loads.get(key)
        if load is None or load.state != _FETCHING or not load.started_at:
            return 0.0
        return max(now - load.started_at, 0.0)

    def held(self) -> dict[str, int]:
        """Resources held right now (gauges); all are 0 when the loader is idle and fully polled."""
        return {
            "queued": len(self._queued),
            "buffers_out": self.buffers_out,
            "events_out": self.events_out,
            "futures_pending": self.futures_pending,
        }

    def totals(self) -> dict[str, int]:
        """Running totals since start (they only grow): loads, bytes, cancels, failures by reason."""
        direct: collections.Counter[str] = collections.Counter()
        for kind in self._direct.values():  # kinds may count under the same names: in-place reads of both
            direct.update(kind.totals())
        out = {"loaded": self.loaded, **direct}
        out.update(loaded_bytes=self.loaded_bytes, cancelled=self.cancelled)
        out.update({f"failed_{reason.value}": n for reason, n in self.failures.items()})
        return out

    # Old names (deprecated, docs/transfer.md): they warn and call the new ones.
    counters = renamed_method("counters", "held")
    stats = renamed_method("stats", "totals")

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything and wait (up to ``timeout``) until every buffer is back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._loads):
            self.cancel(key)
        deadline = time.monotonic() + timeout
        while self.futures_pending or self.events_out:
            self.poll()
            if not (self.futures_pending or self.events_out) or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        self.poll()
        if self.buffers_out:
            log.warning(
                "StreamLoader.close: %d staging buffers still out after %.1fs", self.buffers_out, timeout
            )

    # -- worker side -----------------------------------------------------------------------------------
    def _start_queued(self) -> None:
        started: list[_Load] = []
        while self._queued:
            load = self._queued[0]
            if load.direct is not None:
                # The caller's memory: no staging buffer taken, and not bounded by ``max_inflight`` (which
                # bounds the staging in use): an in-place read is a memory copy, and holding part
                # of a prefix back for a later poll only stretched the load.
                self._queued.popleft()
                self.futures_pending += 1
                load.direct.started()
                load.state = _FETCHING
                started.append(load)
                continue
            try:
                buf = self.pool.acquire(load.dest.staging_nbytes)
            except PoolTooSmall as exc:
                self._queued.popleft()
                self._fail(load, Failure.TOO_LARGE, str(exc), self._results)
                continue
            if buf is None:
                break  # back-pressure: keep the order, retry on the next poll
            self._queued.popleft()
            self.buffers_out += 1
            self.futures_pending += 1
            load.buf = buf
            load.state = _FETCHING
            started.append(load)
        if not started:
            return
        self._worker_progress = time.monotonic()
        try:
            self.runtime.submit(self._fetch_batch(started))
        except RuntimeClosed as exc:
            for load in started:
                self.futures_pending -= 1
                self._release(load)
                if not load.cancelled:
                    self._fail(load, Failure.STORE_ERROR, f"runtime closed: {exc}", self._results)

    def _on_fetched(self, load: _Load, results: list[LoadResult]) -> None:
        fetched, load.fetched = load.fetched, None
        assert fetched is not None
        self.futures_pending -= 1
        self._seen(load, fetched)
        if load.cancelled:
            self._release(load)
            load.state = _DONE
            return
        if fetched.failure is not None or fetched.dtype is None:
            self._release(load)
            self._fail(load, fetched.failure or Failure.STORE_ERROR, fetched.detail, results)
            return
        assert load.buf is not None
        value = load.buf.view(fetched.dtype, fetched.shape)
        try:
            load.out = self.device.empty(fetched.shape, fetched.dtype)
            load.event = self.device.copy([(load.out, value)])
        except RuntimeError as exc:  # torch's device errors (out of memory included) are RuntimeErrors
            load.out = None
            self._release(load)
            self._fail(load, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}", results)
            return
        load.state = _COPYING
        self.events_out += 1
        if not self._copying and load.event.query():
            self._finish_copy(load, results)  # synchronous device: no need to wait for the next poll
        else:
            self._copying.append(load)

    def _copy_group(self, loads: list[_Load], results: list[LoadResult]) -> None:
        """Fetched loads of one dtype and shape (a device that copies asynchronously): one device tensor for
        them all, each load's tensor a row of it, one copy call and one event. Why: a consumer that writes
        them on together (the KV connector's scatter) then reads one tensor, with no stack of its own -- a
        device pass and a host call per value fewer -- and the allocator gives one block, not one a value."""
        first = loads[0].fetched
        assert first is not None and first.dtype is not None
        shape = first.shape
        self.futures_pending -= len(loads)
        values = []
        for load in loads:
            fetched, load.fetched = load.fetched, None
            assert fetched is not None and fetched.dtype is not None and load.buf is not None
            values.append(load.buf.view(fetched.dtype, fetched.shape))
        try:
            rows = self.device.empty((len(loads), *shape), first.dtype)
            event = self.device.copy([(rows[i], value) for i, value in enumerate(values)])
        except RuntimeError as exc:  # torch's device errors (out of memory included) are RuntimeErrors
            for load in loads:
                self._release(load)
                self._fail(load, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}", results)
            return
        for i, load in enumerate(loads):
            load.out = rows[i]
            load.event = event
            load.state = _COPYING
            self._copying.append(load)
        self.events_out += len(loads)

    def _landed_direct(self, load: _Load, direct: DirectLoads, results: list[LoadResult]) -> None:
        fetched, load.fetched = load.fetched, None
        assert fetched is not None
        self.futures_pending -= 1
        self._seen(load, fetched)
        if load.cancelled:
            load.state = _DONE
            return
        if fetched.failure is not None:
            self._fail(load, fetched.failure, fetched.detail, results)
            return
        load.state = _DONE
        self._forget(load)
        self.loaded += 1
        direct.landed(load.dest)
        self.loaded_bytes += direct.nbytes(load.dest)
        results.append(LoadResult(load.key, None, in_place=True))

    def _lend(self, load: _Load, results: list[LoadResult], consume: Callable[[LoadResult], object]) -> None:
        """A fetched load on a host device: ``consume`` reads the staging buffer itself, then it goes back."""
        fetched = load.fetched
        assert fetched is not None
        if load.cancelled or fetched.failure is not None or fetched.dtype is None:
            self._on_fetched(load, results)  # released, failed or dropped there; nothing to lend
            return
        load.fetched = None
        self.futures_pending -= 1
        assert load.buf is not None
        value = load.buf.view(fetched.dtype, fetched.shape)
        load.state = _DONE
        self._forget(load)
        self.loaded += 1
        self.loaded_bytes += value.numel() * value.element_size()
        try:
            consume(LoadResult(load.key, value))
        finally:
            self._release(load)

    def _finish_copy(self, load: _Load, results: list[LoadResult]) -> None:
        self.events_out -= 1
        load.event = None
        nbytes = load.buf.nbytes if load.buf is not None else 0
        self._release(load)
        load.state = _DONE
        out, load.out = load.out, None
        if out is not None:  # the value's bytes, not the staging bound a TensorSpec(max_nbytes) asked for
            nbytes = out.numel() * out.element_size()
        if load.cancelled:
            return
        if out is not None:
            self.device.hand_over(out)
        self._forget(load)
        self.loaded += 1
        self.loaded_bytes += nbytes
        results.append(LoadResult(load.key, out))

    def _seen(self, load: _Load, fetched: _Fetched) -> None:
        """Tell the owner of a damaged value, whether or not the load is still wanted."""
        if fetched.failure is Failure.CORRUPT and self.on_corrupt is not None:
            self.on_corrupt(load.key)

    def _fail(self, load: _Load, reason: Failure, detail: str, results: list[LoadResult]) -> None:
        load.state = _DONE
        self._forget(load)
        self.failures[reason] += 1
        log.debug("load of %r failed (%s): %s", load.key, reason.value, detail)
        results.append(LoadResult(load.key, None, reason, detail))

    def _forget(self, load: _Load) -> None:
        if self._loads.get(load.key) is load:
            del self._loads[load.key]

    def _release(self, load: _Load) -> None:
        if load.buf is not None:
            self.pool.release(load.buf)
            load.buf = None
            self.buffers_out -= 1

    # -- loop side -------------------------------------------------------------------------------------
    async def _fetch_batch(self, loads: list[_Load]) -> None:
        """Start one task per load (each cancellable on its own) and stay until all have ended.

        Runs on the loop. Being one runtime task, the batch is cancelled by ``Runtime.close``; it then
        cancels its children and waits for them, so their done-callbacks still hand every load back.
        """
        single_thread_torch()  # the loop's own copies must not start an OpenMP team beside the engine's
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_inflight)
        tasks: list[asyncio.Task[None]] = []
        staged = _Groups(GROUP_BYTES)
        direct_bytes: collections.Counter[DirectLoads] = collections.Counter()
        for ld in loads:
            if ld.direct is not None:
                direct_bytes[ld.direct] += ld.direct.nbytes(ld.dest)
        # Apart from the staged loads and from each other: one kind's own store calls.
        direct = {d: _Groups(d.group_limit(total)) for d, total in direct_bytes.items()}
        for load in loads:
            if load.cancel_requested:  # cancelled before the loop got here: nothing was written
                self._hand_back(load, _Fetched(Failure.STORE_ERROR, "cancelled"))
                continue
            dest = load.dest
            if load.direct is not None:
                full = direct[load.direct].add(load, load.direct.nbytes(dest))
            elif self.store.batch_reads and dest.shape is not None and dest.dtype is not None:
                full = staged.add(load, dest.staging_nbytes)
            else:
                assert load.buf is not None
                task = asyncio.ensure_future(self._fetch_and_land(load, load.buf))
                load.task = task
                task.add_done_callback(functools.partial(self._fetch_done, load))
                tasks.append(task)
                continue
            if full:
                tasks.append(self._start_group(full))
        for groups in (staged, *direct.values()):
            if groups.loads:
                tasks.append(self._start_group(groups.loads))
        if not tasks:
            return
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            raise

    def _start_group(self, loads: list[_Load]) -> asyncio.Task[None]:
        """One task reads ``loads`` in one store call (a backend with ``batch_reads``), handing each back as
        the call ends. Their ``task`` stays None: cancelling one of them marks it only, and the worker drops
        its value when the group lands -- its buffer is being written until then, and a group is a few MiB
        of one local read. The exception: a direct load whose kind's reads can be abandoned is a group of
        its own, and its ``task`` is this one, for :meth:`interrupt`."""
        task = asyncio.ensure_future(self._fetch_group(loads))
        task.add_done_callback(functools.partial(self._group_done, loads))
        if len(loads) == 1 and loads[0].direct is not None and loads[0].direct.held:
            loads[0].task = task  # a read of its own that can be abandoned: ``interrupt`` stops it
        return task

    async def _fetch_group(self, loads: list[_Load]) -> None:
        items: list[tuple[str, Any]] = []
        for load in loads:
            dest = load.dest
            if load.direct is not None:
                items.append((load.key, dest))
                continue
            assert load.buf is not None and dest.dtype is not None and dest.shape is not None
            items.append((load.key, load.buf.view(dest.dtype, dest.shape)))
        direct = loads[0].direct  # a group is all of one direct kind or all staged
        if direct is not None and not direct.held:  # memory copies: ``max_inflight`` bounds staging in use
            statuses = await self._timed_call(loads, direct.read(items))
        else:
            async with self._call_slot():
                read = self.store.read_into_many(items) if direct is None else direct.read(items)
                statuses = await self._timed_call(loads, read)
        for status, load in zip(statuses, loads, strict=True):
            load.fetched = self._outcome(status, load.dest.dtype, load.dest.shape)
        # The group at once, with one wake-up: a wake-up per value had the worker thread polling (and taking
        # the GIL) between the loop's hand-backs of one call's values.
        self._fetched.extend(loads)  # one C call under the GIL: the worker pops whole loads in poll()
        self._loop_progress = time.monotonic()
        self._wake()

    def _call_slot(self) -> asyncio.Semaphore:
        assert self._slots is not None, "set by _fetch_batch before any call starts"
        return self._slots

    async def _timed_call(self, loads: list[_Load], call: Awaitable[_T]) -> _T:
        """Await one store call, marking when it began for every load it reads (see ``fetching_for``)."""
        self._loop_progress = now = time.monotonic()
        for load in loads:
            load.started_at = now
        return await call

    def _group_done(self, loads: list[_Load], task: asyncio.Task[None]) -> None:
        """A group's task ended without handing its loads back (cancelled, or the store failed): do it."""
        for load in loads:
            load.task = None
        fetched = _unlanded(task)
        if fetched is not None:
            for load in loads:
                self._hand_back(load, fetched)

    async def _fetch_and_land(self, load: _Load, buf: PinnedBuffer) -> None:
        """Fetch, then hand the load back at once: not from the task's done-callback, which the loop runs
        only after every other ready task's step -- with reads served inline (a cached ``file://`` value),
        a whole batch would land together after its last read instead of value by value."""
        async with self._call_slot():
            fetched = await self._timed_call([load], self._fetch(load, buf))
        self._hand_back(load, fetched)  # nothing after this touches the buffer

    def _fetch_done(self, load: _Load, task: asyncio.Task[None]) -> None:
        """A fetch task ended (the loop is done with its buffer): hand back a load that did not land (the
        task was cancelled or raised); one that landed was handed back by the task itself."""
        load.task = None
        fetched = _unlanded(task)
        if fetched is not None:
            self._hand_back(load, fetched)

    def _hand_back(self, load: _Load, fetched: _Fetched) -> None:
        load.fetched = fetched
        self._fetched.append(load)  # deque.append is thread-safe; the worker pops in poll()
        self._loop_progress = time.monotonic()
        self._wake()

    async def _fetch(self, load: _Load, buf: PinnedBuffer) -> _Fetched:
        """Read and validate ``load.key`` into ``buf``. Runs on the loop; touches no device state."""
        dest = load.dest
        if dest.shape is not None and dest.dtype is not None:
            return await self._fetch_exact(load.key, buf, dest.dtype, dest.shape)
        return await self._fetch_any(load.key, buf)

    async def _fetch_exact(
        self, key: str, buf: PinnedBuffer, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> _Fetched:
        return self._outcome(await self.store.read_into(key, buf.view(dtype, shape)), dtype, shape)

    @staticmethod
    def _outcome(status: Fetch, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> _Fetched:
        if status is Fetch.HIT and dtype is not None and shape is not None:
            return _Fetched(dtype=dtype, shape=shape)
        if status is Fetch.CORRUPT:
            return _Fetched(
                Failure.CORRUPT, f"value is not a valid frame, expected {dtype}{list(shape or ())}"
            )
        if status is Fetch.NOT_CACHED:
            return _Fetched(Failure.NOT_CACHED, "not in the store's memory (a cached_only read)")
        return _Fetched(Failure.MISS, "not in the store")

    async def _fetch_any(self, key: str, buf: PinnedBuffer) -> _Fetched:
        # The size is unknown until the frame is decoded: one extra host copy, bounded by max_nbytes.
        (tensor,) = await self.store.get([key])
        if tensor is None:
            return await self._why_not(key, "")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > buf.nbytes:
            detail = f"value is {nbytes} bytes, TensorSpec.max_nbytes is {buf.nbytes}"
            return _Fetched(Failure.TOO_LARGE, detail)
        if nbytes:
            buf.storage[:nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        return _Fetched(dtype=tensor.dtype, shape=tuple(tensor.shape))

    async def _why_not(self, key: str, expected: str) -> _Fetched:
        """Tell a miss from a bad value after ``get`` (which reads both as None): one extra ``exists``."""
        (present,) = await self.store.exists([key])
        if present:
            return _Fetched(Failure.CORRUPT, f"value is not a valid frame {expected}".rstrip())
        return _Fetched(Failure.MISS, "not in the store")


class _Groups:
    """Loads cut into consecutive groups of about ``limit`` bytes, one store call each."""

    __slots__ = ("limit", "loads", "nbytes")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.loads: list[_Load] = []
        self.nbytes = 0

    def add(self, load: _Load, nbytes: int) -> list[_Load] | None:
        """Add ``load``; the group it completes, if it does."""
        self.loads.append(load)
        self.nbytes += nbytes
        if self.nbytes < self.limit:
            return None
        full, self.loads, self.nbytes = self.loads, [], 0
        return full


class _StagedHandOver(Protocol):
    """How :meth:`StreamLoader.poll` hands over a fetched staged load: one implementation per device mode."""

    def take(
        self,
        loader: StreamLoader,
        load: _Load,
        results: list[LoadResult],
        consume: Callable[[LoadResult], object] | None,
    ) -> None: ...


class _OnHost:
    """A host device (:attr:`TransferDevice.synchronous`): a consumer reads the staging buffer itself, lent
    for the call (no copy); without one, the value is copied into a tensor of its own."""

    def take(
        self,
        loader: StreamLoader,
        load: _Load,
        results: list[LoadResult],
        consume: Callable[[LoadResult], object] | None,
    ) -> None:
        if consume is not None:
            loader._lend(load, results, consume)
        else:
            loader._on_fetched(load, results)


@dataclass(frozen=True, slots=True)
class _OnDevice:
    """A device that copies asynchronously: a copy and an event per value, or with ``rows`` the fetched
    loads of one dtype and shape next in line as the rows of one device tensor (``StreamLoader``'s
    ``rows``)."""

    rows: bool

    def take(
        self,
        loader: StreamLoader,
        load: _Load,
        results: list[LoadResult],
        consume: Callable[[LoadResult], object] | None,
    ) -> None:
        fetched = loader._fetched
        if self.rows and _copyable(load) and fetched and _copyable(fetched[0], like=load):
            group = [load]
            while fetched and _copyable(fetched[0], like=load):
                group.append(fetched.popleft())
            loader._copy_group(group, results)
        else:
            loader._on_fetched(load, results)


def _copyable(load: _Load, like: _Load | None = None) -> bool:
    """A fetched load ready for its device copy (not cancelled, not failed), of the dtype and shape of
    ``like`` (itself copyable) when given."""
    fetched = load.fetched
    if load.cancelled or fetched is None or fetched.failure is not None or fetched.dtype is None:
        return False
    if load.direct is not None:
        return False
    other = like.fetched if like is not None else None
    return other is None or (other.dtype == fetched.dtype and other.shape == fetched.shape)


def _unlanded(task: asyncio.Task[None]) -> _Fetched | None:
    """Why a fetch task ended without handing its loads back (cancelled, or raised); None if it did not."""
    if task.cancelled():
        return _Fetched(Failure.STORE_ERROR, "fetch cancelled (interrupted, or the loader or runtime closed)")
    if (exc := task.exception()) is not None:
        return _Fetched(*classify(exc))
    return None


def _cancel_on_loop(load: _Load) -> None:
    """Runs on the loop: stop the fetch, or stop it before it starts if its task has not run yet."""
    load.cancel_requested = True
    if load.task is not None:
        load.task.cancel()
