"""Removing stored values that failed their check, so that the next save writes a good one.

Why: savers skip keys the store already has (the save tracker's ``skip_existing``; the KV scheduler saves
only what its lookup did not find), so a value that is there but unreadable -- damaged, truncated, or of a
frame format this build does not read -- would be skipped as "stored" and fail every later load. A worker
side that sees a load fail as corrupt hands the key here; the delete runs on the runtime loop and the
caller does not wait for it. A delete that fails only leaves the bad value for the next reader to remove.
"""

from __future__ import annotations

import concurrent.futures

from asyncconn.exceptions import RuntimeClosed
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore

__all__ = ["Purger"]


class Purger:
    """Fire-and-forget deletes of bad values, owned by one worker side (``pending`` counts them)."""

    def __init__(self, runtime: Runtime, store: TensorStore) -> None:
        self.runtime = runtime
        self.store = store
        self._futures: set[concurrent.futures.Future[int]] = set()

    def remove(self, key: str) -> None:
        """Delete ``key`` from the store in the background; a closed runtime means nothing to do."""
        try:
            future = self.runtime.submit(self.store.delete([key]))
        except RuntimeClosed:
            return
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)

    @property
    def pending(self) -> int:
        """Deletes still running (0 when idle)."""
        return len(self._futures)
