"""The scheduler-facing lookup client: submit and poll in microseconds, all I/O on the runtime loop.

vLLM asks "how much of this request is in the store?" from inside ``schedule()``. This client answers
"not yet" (``None``) until the store has replied, so the scheduler skips the request for a step instead of
waiting. What makes it cheap on the caller's thread -- the published trap is one
``run_coroutine_threadsafe`` per lookup, whose wake-ups and GIL hand-offs ruin the scheduler's p99:

- ``submit`` builds one small entry, appends it to a deque and wakes the loop only if no wake-up is
  already pending, so a step that submits 256 lookups costs the loop one wake-up and one drain.
- The loop drains the deque, hands the whole batch to the transport and later writes each answer into
  its entry's ``result`` attribute (one atomic store). ``poll`` reads that attribute: no lock, no future.
- Every lookup has a deadline. One timer, armed for the oldest lookup in flight, resolves expired ones
  as misses (lookups are issued in deadline order, so the sweep stops at the first live one).

Ownership (one owner per structure): ``_entries`` (request id -> entry) belongs to the caller's thread,
``_inflight`` (wire id -> entry) and the transport belong to the loop. An entry's ``result`` is written
once by the loop, its ``discarded`` flag once by the caller. A client is used from one caller thread
(vLLM's scheduler thread); ``lookup_sync`` is the exception that may block, and only up to the timeout.

Guarantees: a second submit for an outstanding id is a no-op; a result is returned exactly once; after
``discard`` the id's answer can never be returned (a re-submit gets a fresh entry and a fresh wire id, and
late replies to old wire ids are dropped and counted as ``stale``); ``close`` releases everything.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Generic, TypeVar, cast

from asyncconn._deprecated import renamed_method
from asyncconn.exceptions import AsyncConnError, ConfigError, LoopThreadBlocked, RuntimeClosed
from asyncconn.lookup.metrics import LookupMetrics
from asyncconn.lookup.protocol import Key, Kind
from asyncconn.lookup.transports import Answer, LookupTransport
from asyncconn.reachability import Reachability
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer.failures import RateLimitedLog

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT", "EXISTS", "PREFIX", "LookupClient", "Mode"]

R = TypeVar("R")

#: Seconds a lookup may take before it resolves as a miss.
DEFAULT_TIMEOUT = 3.0
_PENDING: object = object()


class Mode(Generic[R]):
    """What a lookup returns: KV ``PREFIX`` (leading keys present, an int) or EC ``EXISTS`` (bool per key)."""

    __slots__ = ("kind",)

    def __init__(self, kind: Kind) -> None:
        self.kind = kind

    def miss(self, nkeys: int) -> R:
        if self.kind is Kind.PREFIX:
            return cast(R, 0)
        return cast(R, (False,) * nkeys)

    def check(self, answer: Answer, nkeys: int) -> R | None:
        """The answer if it fits a lookup of ``nkeys`` keys, else None (a garbage reply is an error)."""
        if self.kind is Kind.PREFIX:
            if isinstance(answer, int) and 0 <= answer <= nkeys:
                return cast(R, answer)
            return None
        if isinstance(answer, tuple) and len(answer) == nkeys:
            return cast(R, answer)
        return None

    @staticmethod
    def found(answer: Answer) -> int:
        return answer if isinstance(answer, int) else sum(answer)


PREFIX: Mode[int] = Mode(Kind.PREFIX)
EXISTS: Mode[tuple[bool, ...]] = Mode(Kind.EXISTS)


class _Entry:
    """One lookup: the caller creates it and sets ``discarded``; the loop fills ``wid`` and ``result``."""

    __slots__ = ("by_store", "deadline", "discarded", "keys", "result", "t0", "waiter", "wid")

    def __init__(self, keys: tuple[Key, ...], t0: float, deadline: float) -> None:
        self.keys = keys
        self.t0 = t0
        self.deadline = deadline
        self.wid = -1
        self.result: object = _PENDING
        self.by_store = False  # the store answered (not a miss made up for a timeout, an error, a refusal)
        self.discarded = False
        self.waiter: threading.Event | None = None


class LookupClient(Generic[R]):
    """Pipelined, time-bounded lookups keyed by request id, polled from a synchronous thread.

    ``transport`` is started on the runtime's loop by the constructor (which waits up to ``timeout`` for
    it: a store that cannot be opened raises here, at connector start-up, not in ``schedule()``).
    ``max_pending`` bounds the lookups outstanding at once; a submit past it resolves at once as a miss
    (counted as ``rejected``) so memory stays bounded whatever the store does.
    """

    def __init__(
        self,
        transport: LookupTransport,
        mode: Mode[R],
        *,
        runtime: Runtime | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_pending: int = 100_000,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"lookup: bad value {timeout!r} for 'timeout': must be > 0")
        self.mode = mode
        self.timeout = timeout
        self.max_pending = max_pending
        self.metrics = LookupMetrics()
        # Timeouts are misses the scheduler cannot tell from real ones: say so, at most a line per interval.
        self._timeout_log = RateLimitedLog(log)  # loop thread
        self._rt = runtime or get_runtime()
        self._loop = self._rt.loop
        self._transport = transport
        self._entries: dict[str, _Entry] = {}  # caller thread
        self._queue: collections.deque[_Entry] = collections.deque()  # caller -> loop
        self._wake_pending = False
        self._inflight: dict[int, _Entry] = {}  # loop thread
        self._next_wid = 0  # loop thread
        self._timer: asyncio.TimerHandle | None = None  # loop thread
        self._answered = threading.Event()  # set on the loop after answers were written; cleared by wait()
        self._closed = False
        # A direct transport connects to its store here: give it its own connect bound (plus slack).
        connect = getattr(transport, "connect_timeout", None) or 0.0
        self._rt.run(transport.start(mode.kind, self._deliver), timeout=max(timeout, 5.0, connect + 1.0))

    # -- caller thread ---------------------------------------------------------------------------------
    def submit(self, request_id: str, keys: Sequence[Key]) -> None:
        """Start a lookup for ``request_id`` unless one is outstanding. Never waits on the loop."""
        if request_id in self._entries:
            return
        if self._closed or self._rt.closed:
            raise RuntimeClosed("lookup client (or its runtime) is closed")
        now = time.monotonic()
        entry = _Entry(tuple(keys), now, now + self.timeout)
        self._entries[request_id] = entry
        if len(self._entries) > self.max_pending:
            entry.result = self.mode.miss(len(entry.keys))
            self.metrics.rejected += 1
            return
        self.metrics.submitted += 1
        self._queue.append(entry)
        if not self._wake_pending:
            try:
                self._wake()
            except RuntimeClosed:
                del self._entries[request_id]
                raise

    def poll(self, request_id: str) -> R | None:
        """The answer, consumed (a second poll returns None); None while outstanding or if never submitted."""
        got = self.poll_answer(request_id)
        return None if got is None else got[0]

    def poll_answer(self, request_id: str) -> tuple[R, bool] | None:
        """:meth:`poll`, and whether the store gave that answer: False for the miss served in its stead
        when the lookup timed out, failed or was refused (a caller that acts on a miss must tell them
        apart)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        result = entry.result
        if result is _PENDING:
            return None
        del self._entries[request_id]
        if not self._entries:
            self._entries = {}  # dicts never shrink: drop the table a burst grew
        return cast(R, result), entry.by_store

    def lookup(self, request_id: str, keys: Sequence[Key]) -> R | None:
        """Submit if new, then poll: what ``get_num_new_matched_tokens`` calls on every step."""
        if request_id not in self._entries:
            self.submit(request_id, keys)
        return self.poll(request_id)

    def pending(self, request_id: str) -> bool:
        """True while a lookup for ``request_id`` is submitted and not yet consumed or discarded."""
        return request_id in self._entries

    def discard(self, request_id: str) -> bool:
        """Forget ``request_id``'s lookup (finished, aborted, preempted). Its answer is never returned."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        if not self._entries:
            self._entries = {}
        entry.discarded = True
        self.metrics.discards += 1
        if entry.result is _PENDING and not self._closed:
            # Tell the loop so it drops the in-flight slot now rather than at the deadline.
            self._queue.append(entry)
            if not self._wake_pending:
                with contextlib.suppress(RuntimeClosed):  # discard never fails: the loop is gone anyway
                    self._wake()
        return True

    def outstanding(self) -> bool:
        """True while some submitted lookup has no answer yet (answered, unconsumed ones do not count)."""
        return any(entry.result is _PENDING for entry in self._entries.values())

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until every outstanding lookup is answered; True if none is left.

        For a scheduler with nothing else to do (a step that scheduled no tokens while lookups are out):
        vLLM steps again at once, and its back-to-back empty steps hold the GIL that the loop thread needs
        to send the lookups and read the answers. A blocking wait hands the GIL over and returns as soon as
        the last answer is written (collect them with ``poll``), at once when nothing is outstanding.
        """
        if self._rt.in_loop_thread():
            raise LoopThreadBlocked("wait() called on the loop thread; it would deadlock")
        deadline = time.monotonic() + timeout
        while self.outstanding():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return False
            self._answered.clear()
            if not self.outstanding():  # answered between the test and the clear
                break
            self._answered.wait(remaining)
        return True

    def _wake(self) -> None:
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the runtime's loop was closed underneath this client
            self._wake_pending = False
            raise RuntimeClosed("the runtime this lookup client runs on is closed") from None

    def lookup_sync(self, request_id: str, keys: Sequence[Key]) -> R:
        """Block until the answer (at most about ``timeout``); the miss value if none came. Consumes it."""
        if self._rt.in_loop_thread():
            raise LoopThreadBlocked("lookup_sync() called on the loop thread; it would deadlock")
        self.submit(request_id, keys)
        entry = self._entries.get(request_id)
        if entry is not None and entry.result is _PENDING:
            waiter = threading.Event()
            entry.waiter = waiter
            if entry.result is _PENDING:  # the loop writes result before reading waiter
                waiter.wait(max(0.0, entry.deadline - time.monotonic()) + 1.0)
        result = self.poll(request_id)
        if result is None:  # the loop never resolved it (closed underneath us): give up as a miss
            self.discard(request_id)
            return self.mode.miss(len(keys))
        return result

    @property
    def store_reachability(self) -> Reachability | None:
        """The reachability of the store this client queries itself (a direct transport), else None: a
        lookup server's store is the server's to watch and report."""
        reach = getattr(getattr(self._transport, "_store", None), "reachability", None)
        return reach if isinstance(reach, Reachability) else None

    counters = renamed_method("counters", "held")  # the old name, deprecated (docs/transfer.md)

    @property
    def store(self) -> TensorStore | None:
        """The store this client asks itself (a direct transport), for another client to share; None
        behind a lookup server."""
        store = getattr(self._transport, "store", None)
        return store if isinstance(store, TensorStore) else None

    @property
    def runtime(self) -> Runtime:
        """The runtime whose loop runs this client's transport (and owns its :attr:`store`)."""
        return self._rt

    def held(self) -> dict[str, int]:
        """Sizes of every internal structure (tests check that they come back to zero)."""
        return {
            "entries": len(self._entries),
            "queued": len(self._queue),
            "inflight": len(self._inflight),
            "transport": self._transport.busy(),
        }

    def close(self, timeout: float = 5.0) -> None:
        """Stop the transport and drop every lookup. Safe to call twice; later submits raise.

        Never raises for the store: vLLM calls this while shutting down, possibly with the store dead or
        hung (a Mooncake client unmounting from a dead master retries for seconds). Past ``timeout`` the
        transport goes on closing on the loop and this returns, with a warning.
        """
        if self._closed:
            return
        self._closed = True
        self._entries.clear()
        if self._rt.closed:
            return
        try:
            self._rt.run(self._aclose(), timeout=timeout)
        except TimeoutError:
            log.warning("lookup client: the transport did not close within %.1fs (store down?)", timeout)
        except AsyncConnError as exc:
            log.warning("lookup client: closing the transport failed: %s", exc)

    def __enter__(self) -> LookupClient[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loop thread -----------------------------------------------------------------------------------
    def _drain(self) -> None:
        self._wake_pending = False  # before draining: a submit after this point schedules another drain
        queue, inflight = self._queue, self._inflight
        batch: list[tuple[int, tuple[Key, ...]]] = []
        while queue:
            entry = queue.popleft()
            if entry.discarded:
                if entry.wid >= 0:
                    inflight.pop(entry.wid, None)
                continue
            if entry.wid >= 0:
                continue
            wid = self._next_wid
            self._next_wid = wid + 1
            entry.wid = wid
            inflight[wid] = entry
            batch.append((wid, entry.keys))
        if self._closed:
            return
        if batch:
            self._transport.send(batch)
        elif not inflight:
            self._inflight = {}
        self._arm()

    def _deliver(self, answers: list[tuple[int, Answer | None]]) -> None:
        inflight, mode, metrics = self._inflight, self.mode, self.metrics
        now = time.monotonic()
        for wid, answer in answers:
            entry = inflight.pop(wid, None)
            if entry is None or entry.discarded:
                metrics.stale += 1
                continue
            nkeys = len(entry.keys)
            if answer is None or (value := mode.check(answer, nkeys)) is None:
                metrics.errors += 1
                self._resolve(entry, mode.miss(nkeys))
                continue
            found = mode.found(answer)
            metrics.completed += 1
            metrics.keys_queried += nkeys
            metrics.keys_hit += found
            if found:
                metrics.hits += 1
            else:
                metrics.misses += 1
            metrics.observe(now - entry.t0)
            entry.by_store = True  # (before the result: the caller reads it once the result is there)
            self._resolve(entry, value)
        if not inflight:
            self._inflight = {}
        self._answered.set()  # after every result is written: wait() re-checks them

    @staticmethod
    def _resolve(entry: _Entry, value: object) -> None:
        entry.result = value
        waiter = entry.waiter
        if waiter is not None:
            waiter.set()

    def _arm(self) -> None:
        if self._timer is None and self._inflight:
            oldest = next(iter(self._inflight.values()))
            delay = max(0.0, oldest.deadline - time.monotonic())
            self._timer = self._loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        inflight = self._inflight
        expired = []
        for wid, entry in inflight.items():
            if entry.deadline > now:
                break
            expired.append(wid)
        timed_out = 0
        for wid in expired:
            entry = inflight.pop(wid)
            if not entry.discarded:
                timed_out += 1
                self._resolve(entry, self.mode.miss(len(entry.keys)))
        if timed_out:
            self.metrics.timeouts += timed_out
            self._timeout_log.warning(
                "timeout",
                "lookup: %d lookups unanswered after %gs, served as misses; %d lookup timeouts since start",
                timed_out,
                self.timeout,
                self.metrics.timeouts,
            )
        if not inflight:
            self._inflight = {}
        if expired:
            self._answered.set()
        self._arm()

    async def _aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._drain()
        for entry in self._inflight.values():
            self._resolve(entry, self.mode.miss(len(entry.keys)))
        self._inflight.clear()
        self._queue.clear()
        self._answered.set()
        await self._transport.close()
