"""Whether a store answers, as the calls made to it see it: one line when it stops, one when it is back.

Why: an operator running two engines on one Redis saw nothing in the log when Redis went away (the failures
were only counted, or logged per failed batch -- a flood) and nothing when it returned. A store is judged
on every call :class:`~asyncconn.store.TensorStore` makes: a timeout or a :class:`BackendUnavailable` marks it
unreachable; any answer -- a value, a miss, or an error the store itself returned -- marks it reachable.

Lines are rate-limited so a flapping store cannot flood the log: after an "unreachable" line the next one
comes no sooner than ``interval`` later. An outage inside that window is still counted (:attr:`outages`,
the figure the connectors export) and neither of its lines is logged; the next logged line says how many
were not. The "back" line is logged exactly when its outage's "unreachable" line was, so the log always
reads as pairs. Owned by the runtime loop thread (the store's calls run there); others only read the ints.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

__all__ = ["Reachability"]

log = logging.getLogger(__name__)


class Reachability:
    """The reachable/unreachable state of one store, its outage count, and the two log lines."""

    __slots__ = (
        "_clock",
        "_down_since",
        "_logged",
        "_next_line",
        "_unlogged",
        "interval",
        "log",
        "name",
        "outages",
    )

    def __init__(
        self,
        name: str,
        *,
        interval: float = 30.0,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name  # already redacted by the caller (a store's name is its redacted URL)
        self.interval = interval
        self.log = logger or log
        self._clock = clock
        self._down_since: float | None = None
        self._logged = False  # the current outage's "unreachable" line was logged
        self._next_line = -math.inf
        self._unlogged = 0  # outages since the last logged line whose lines were held back
        #: Times the store went from reachable to unreachable since it was opened (the exported counter).
        self.outages = 0

    @property
    def reachable(self) -> bool:
        return self._down_since is None

    def failed(self, reason: str) -> None:
        """A call found the store unreachable (timed out, refused, reset). ``reason`` must hold no secret."""
        if self._down_since is not None:
            return
        now = self._clock()
        self._down_since = now
        self.outages += 1
        if now < self._next_line:
            self._logged = False
            self._unlogged += 1
            return
        self._logged = True
        self._next_line = now + self.interval
        held, self._unlogged = self._unlogged, 0
        note = f" ({held} shorter outages in the last {self.interval:g}s not logged)" if held else ""
        self.log.warning(
            "store %s unreachable (%s): loads and lookups are misses and saves are dropped until it is back; "
            "outage %d since start%s",
            self.name,
            reason,
            self.outages,
            note,
        )

    def answered(self) -> None:
        """A call got an answer from the store: if it was unreachable, it is back."""
        since = self._down_since
        if since is None:
            return
        self._down_since = None
        if self._logged:
            self._logged = False
            self.log.warning(
                "store %s is back after %.1fs unreachable (outage %d since start)",
                self.name,
                self._clock() - since,
                self.outages,
            )
