"""Polling helpers: drive an engine from the test thread the way vLLM's worker does, with a hang guard."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from asyncconn.transfer import LoadResult, SaveTracker, StreamLoader

#: ``SaveTracker.held()`` once every request is reported: nothing held.
SAVER_IDLE = {
    "requests": 0,
    "queued": 0,
    "buffers_out": 0,
    "events_out": 0,
    "futures_pending": 0,
    "copy_jobs": 0,
    "inflight_keys": 0,
}
HANG_GUARD = 10.0  # seconds: a test that needs this long has hung (not a performance assertion)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"hung waiting for {what}")
        time.sleep(0.0005)


def drain_loads(loader: StreamLoader, n: int) -> dict[str, LoadResult]:
    """Poll until ``n`` results have come back; return them by key."""
    out: dict[str, LoadResult] = {}

    def step() -> bool:
        for result in loader.poll():
            assert result.key not in out, f"{result.key} reported twice"
            out[result.key] = result
        return len(out) >= n

    wait_until(step, f"{n} load results")
    return out


def drain_saves(tracker: SaveTracker, ids: Iterable[str]) -> set[str]:
    """Poll until every id in ``ids`` was reported finished; return everything reported meanwhile."""
    wanted = set(ids)
    seen: set[str] = set()

    def step() -> bool:
        seen.update(tracker.poll())
        return wanted <= seen

    wait_until(step, f"saves of {sorted(wanted)}")
    return seen


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe): the loaded bytes are the stored bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
