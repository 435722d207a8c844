"""What a leak check counts of this process's own resources: its open file descriptors (Linux ``/proc``)."""

from __future__ import annotations

import os

__all__ = ["HAVE_PROC_FDS", "open_descriptors"]

#: Whether this process's descriptors can be counted (Linux's ``/proc/self/fd``).
HAVE_PROC_FDS = os.path.isdir("/proc/self/fd")


def open_descriptors() -> int:
    """How many file descriptors this process holds now (the listing's own one included, every time)."""
    return len(os.listdir("/proc/self/fd"))
