"""Runs of consecutive integers: how block ids and rows become as few copies (or views) as possible."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["runs"]


def runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """``ids`` as runs of consecutive ids, in order: ``(first, count)`` each (``[4, 5, 6, 9]`` ->
    ``[(4, 3), (9, 1)]``). A run is one slice of a tensor or a buffer where the ids are one piece each."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and i == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
