"""Why a transfer failed, as a value: the engines report failures in their poll results, never by raising.

vLLM's worker thread must not see an exception from a store it did not choose; a failed load is a miss to
recompute and a failed save is a counted, logged non-event. :func:`classify` is the one place where the
exceptions that come back from the loop are turned into a :class:`Failure`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from asyncconn.exceptions import (
    BackendError,
    BackendTimeout,
    CodecError,
    FrameTooLarge,
    PoolTooSmall,
    RuntimeStateError,
)

__all__ = ["Failure", "RateLimitedLog", "classify"]

log = logging.getLogger(__name__)


class RateLimitedLog:
    """Warnings of one kind at most once per ``interval`` seconds; the next line says how many were held back.

    Why: a store that is down fails every batch of every step, and one warning per batch was a flood (tens
    of lines a second) that buried everything else in the engine's log. The first failure of a kind is
    logged at once; ``suppressed`` counts the lines held back in all. Owned by one thread, like the engine
    state it reports on.
    """

    def __init__(
        self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self.interval = interval
        self._clock = clock
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self.suppressed = 0

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` was logged within ``interval``; True when logged."""
        now = self._clock()
        if now < self._next.get(kind, -1.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            self.suppressed += 1
            return False
        held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more like it in the last %gs, not logged)"
            args = (*args, held, self.interval)
        self._logger.warning(msg, *args)
        self._next[kind] = now + self.interval
        return True


class Failure(enum.StrEnum):
    """The reason carried by a failed load (and counted for failed saves)."""

    MISS = "miss"  # the key is not in the store
    CORRUPT = "corrupt"  # a value is there but is not a valid frame of the expected dtype/shape
    TIMEOUT = "timeout"  # the store did not answer within its timeout
    STORE_ERROR = "store_error"  # the store failed (unreachable, full, closed) or the runtime is gone
    TOO_LARGE = "too_large"  # the value can never fit the staging pool or the declared maximum
    DEVICE_ERROR = "device_error"  # the device refused (e.g. out of memory for the destination)
    NOT_CACHED = "not_cached"  # an in-place load the store could not serve from memory: load it another way


def classify(exc: BaseException) -> tuple[Failure, str]:
    """Map an exception from a fetch or put to a failure reason and a one-line detail."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, BackendTimeout):
        return Failure.TIMEOUT, detail
    if isinstance(exc, BackendError | RuntimeStateError):
        return Failure.STORE_ERROR, detail
    if isinstance(exc, FrameTooLarge | PoolTooSmall):
        return Failure.TOO_LARGE, detail
    if isinstance(exc, CodecError):
        return Failure.CORRUPT, detail
    # Not ours: a bug in a third-party backend. Still a failure value, never an exception on the worker.
    log.error("unexpected exception in a transfer, treated as a store error", exc_info=exc)
    return Failure.STORE_ERROR, detail
