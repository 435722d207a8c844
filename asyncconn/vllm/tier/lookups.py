"""Presence checks the scheduler thread never waits for: vLLM's asynchronous tier-lookup contract.

vLLM asks a tier about one chunk at a time, on its scheduler thread, and accepts three answers: present,
absent, or "ask again on a later step" (``RETRY``). A chunk seen for the first time is answered "ask
again" and collected; once per step (``on_schedule_end``) the step's chunks go to the loop as one batch
(one ``exists`` round trip); a later lookup finds the answer and keeps it for as long as a request that
asked still lives, so a request's repeated lookups on later steps cost a dict read.

Everything here belongs to the scheduler thread; the loop is reached only through the futures that
``ask`` returns, read with ``done()`` (no lock, no wait). An answer is applied only to the state it was
asked for (a generation number): a chunk forgotten and asked again while the old answer was on its way
takes the new answer only. More than ``max_pending`` chunks waiting for an answer: the next is a miss.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Collection, Hashable
from typing import Generic, TypeVar

__all__ = ["TierLookups"]

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)


class _State:
    __slots__ = ("generation", "result", "users")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.result: bool | None = None  # None: not answered yet
        self.users: set[str] = set()


class TierLookups(Generic[K]):
    """Answers to "is this chunk in the store?", asked in batches through ``ask`` and kept per request."""

    def __init__(
        self, ask: Callable[[list[K]], concurrent.futures.Future[list[bool]]], max_pending: int
    ) -> None:
        self._ask = ask
        self._max_pending = max_pending
        self._states: dict[K, _State] = {}
        self._by_user: dict[str, set[K]] = {}
        self._batch: list[tuple[K, int]] = []  # asked this step, sent at flush()
        self._asked: list[tuple[list[tuple[K, int]], concurrent.futures.Future[list[bool]]]] = []
        self._outstanding = 0  # chunks in _batch or _asked
        self._generation = 0

    def lookup(self, key: K, user: str) -> bool | None:
        """True/False once answered, None meanwhile (the first call for a chunk queues it)."""
        if self._asked:
            self._collect()
        state = self._states.get(key)
        if state is None:
            if self._outstanding >= self._max_pending:
                return False
            state = _State(self._generation)
            self._generation += 1
            self._states[key] = state
            self._batch.append((key, state.generation))
            self._outstanding += 1
        state.users.add(user)
        self._by_user.setdefault(user, set()).add(key)
        return state.result

    def flush(self) -> None:
        """Send this step's new chunks as one batch (once per step, after the step's lookups)."""
        self._collect()
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        live = [(k, g) for k, g in batch if self._current(k, g)]
        self._outstanding -= len(batch) - len(live)
        if live:
            self._asked.append((live, self._ask([k for k, _ in live])))

    def mark_miss(self, keys: Collection[K]) -> None:
        """Answer "absent" from now on for ``keys`` (a load of them failed: no endless re-promotion)."""
        for key in keys:
            state = self._states.get(key)
            if state is not None:
                state.result = False

    def release(self, user: str) -> None:
        """``user`` (a request) is done: forget the answers nobody else holds."""
        for key in self._by_user.pop(user, ()):
            state = self._states[key]
            state.users.discard(user)
            if not state.users:  # an answer still on its way is ignored when it comes (generation check)
                del self._states[key]

    def busy(self) -> bool:
        """Chunks waiting for an answer (vLLM must keep stepping so that they are collected)."""
        return self._outstanding > 0

    def futures(self) -> list[concurrent.futures.Future[list[bool]]]:
        return [future for _, future in self._asked]

    def tracked(self) -> int:
        """Chunks with a state (answered or not): zero once every request is released."""
        return len(self._states)

    def _current(self, key: K, generation: int) -> bool:
        state = self._states.get(key)
        return state is not None and state.generation == generation

    def _collect(self) -> None:
        if not self._asked:
            return
        still: list[tuple[list[tuple[K, int]], concurrent.futures.Future[list[bool]]]] = []
        for batch, future in self._asked:
            if not future.done():
                still.append((batch, future))
                continue
            self._outstanding -= len(batch)
            try:
                answers = future.result()
            except Exception as exc:  # the asker answers store errors itself; this is a bug: say so, miss
                log.warning("presence check of %d chunks failed: %r", len(batch), exc)
                answers = [False] * len(batch)
            for (key, generation), present in zip(batch, answers, strict=True):
                state = self._states.get(key)
                if state is not None and state.generation == generation:
                    state.result = bool(present)
        self._asked = still
