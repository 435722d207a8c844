"""How a demo part's or benchmark's summary ``{"title", "figures", "checks"}`` is printed for people."""

from __future__ import annotations

from typing import Any

__all__ = ["print_summary"]


def print_summary(summary: dict[str, Any]) -> None:
    print(f"== {summary['title']} ==")
    for name, value in summary.get("figures", {}).items():
        print(f"  {name:<58} {value}")
    for name, ok in summary.get("checks", {}).items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
