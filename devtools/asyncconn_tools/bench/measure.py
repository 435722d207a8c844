"""Small shared pieces of the benchmark commands: percentiles, a stderr progress bar, size parsing."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from asyncconn.url import parse_size

__all__ = ["Progress", "human_size", "parse_sizes", "summarize"]


def parse_sizes(text: str) -> list[int]:
    """``"1MiB,4MiB"`` -> byte counts; raises ValueError naming the bad item."""
    return [parse_size(item.strip()) for item in text.split(",") if item.strip()]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """Latency summary in microseconds: p50, p99, max, mean (medians are what the docs quote)."""
    if not samples_s:
        return {"n": 0}
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1e6

    return {
        "n": len(ordered),
        "p50_us": pct(50),
        "p99_us": pct(99),
        "max_us": ordered[-1] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal (or forced)."""

    def __init__(
        self, total: int, label: str = "", *, stream: TextIO | None = None, force: bool = False
    ) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self._last = 0.0

    def advance(self, n: int = 1, label: str | None = None) -> None:
        self.done += n
        if label is not None:
            self.label = label
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            width = 30
            filled = int(width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.label:<40.40}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
