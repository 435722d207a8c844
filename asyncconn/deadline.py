"""One point in time that several bounded steps share (a shutdown's: cancel loads, finish saves, close the
store), so their waits add up to one bound instead of one each."""

from __future__ import annotations

import time

__all__ = ["STORE_CLOSE_FLOOR_S", "Deadline"]

#: The least a shutdown gives closing the store, however late: closing a healthy store's connections takes
#: milliseconds, and leaving them open leaves the server one client more until it notices.
STORE_CLOSE_FLOOR_S = 0.1


class Deadline:
    """``seconds`` from now; :meth:`left` is what each step may still wait."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, floor: float = 0.0) -> float:
        """Seconds until the deadline, never below ``floor`` (a step that must at least be tried)."""
        return max(self.at - time.monotonic(), floor)
