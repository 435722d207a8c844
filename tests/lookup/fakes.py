"""A lookup transport the test controls: it records what was sent and answers only when told to."""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncconn.lookup.protocol import Key, Kind
from asyncconn.lookup.transports import Answer, Batch, Deliver, LookupTransport


class FakeTransport(LookupTransport):
    """Holds every lookup it is sent until the test answers it -- in any order, late, twice, or never.

    Its answer is all keys present: PREFIX -> ``len(keys)``, EXISTS -> ``(True,) * len(keys)``, so a
    test that encodes a generation in the number of keys can tell a stale answer from a fresh one.
    """

    def __init__(self) -> None:
        self.pending: dict[int, tuple[Key, ...]] = {}
        self.sent = 0
        self.closed = False
        self._deliver: Deliver | None = None
        self._kind = Kind.PREFIX

    async def start(self, kind: Kind, deliver: Deliver) -> None:
        self._kind, self._deliver = kind, deliver

    def send(self, batch: Batch) -> None:
        for wid, keys in batch:
            self.pending[wid] = keys
            self.sent += 1

    def answer_value(self, keys: tuple[Key, ...]) -> Answer:
        return len(keys) if self._kind is Kind.PREFIX else (True,) * len(keys)

    async def answer(self, wid: int, value: Answer | None = None, *, keep: bool = False) -> None:
        """Deliver an answer for ``wid`` (default: all present); ``keep`` leaves it pending (duplicates)."""
        assert self._deliver is not None
        keys = self.pending[wid] if keep else self.pending.pop(wid)
        self._deliver([(wid, self.answer_value(keys) if value is None else value)])

    async def answer_all(self) -> None:
        assert self._deliver is not None
        items = list(self.pending.items())
        self.pending.clear()
        self._deliver([(wid, self.answer_value(keys)) for wid, keys in items])

    async def close(self) -> None:
        self.closed = True


async def noop() -> None:
    """Run on the loop to wait until everything scheduled before it (a client's drain) has run."""


def wait_until(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    """Poll a condition; the generous bound only turns a hang into a failure (not a timing assertion)."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.005)
