"""Invariant checks a chaos run applies to live engines: correct bytes, nothing held, nothing leaked.

Each function looks at one engine (:class:`~asyncconn_tools.sim.engine.EngineSim`) and returns a list of
problems (empty when all is well) rather than raising, so a run can count violations and still report the
rest.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from typing import Any

import torch

from asyncconn_tools.sim.runner import embedding_for

__all__ = [
    "ProcessCensus",
    "check_embeddings",
    "check_kv",
    "connector_leaks",
    "percentile",
]


def check_kv(sim: Any, request_ids: list[str] | None = None) -> tuple[int, list[str]]:
    """Every given (default: running) request's KV equals what computing its tokens gives, on every rank.

    Loaded blocks hold bytes from the store, computed ones bytes from the simulated forward: a wrong block
    id, offset, rank, layer, a stale lookup answer or a value served under the wrong key shows up here.
    Returns (requests checked, problems).
    """
    problems: list[str] = []
    checked = 0
    ids = request_ids if request_ids is not None else [r.request_id for r in sim.scheduler.running]
    for rid in ids:
        request = sim.scheduler.requests.get(rid)
        if request is None or request.num_computed_tokens == 0:
            continue
        n = request.num_computed_tokens
        tokens = list(request.all_token_ids)[:n]
        checked += 1
        for rank in range(len(sim.workers)):
            got = sim.read_kv(rid, rank)
            want = sim.expected_kv(tokens, rank)
            bad = [layer for layer, t in got.items() if not torch.equal(t, want[layer])]
            if bad:
                problems.append(f"request {rid} rank {rank}: KV of {n} tokens differs on layers {bad}")
    return checked, problems


def check_embeddings(sim: Any, request_id: str, rows: dict[str, int], hidden: int) -> tuple[int, list[str]]:
    """The embedding rows the model consumed for ``request_id`` equal the encoder's output for each item.

    Rows never consumed (an abort before the item's span was scheduled) are NaN and skipped. Returns
    (rows compared, problems).
    """
    problems: list[str] = []
    compared = 0
    for mm_hash, used in sim.embeddings_used(request_id).items():
        consumed = ~torch.isnan(used).any(dim=1)
        if not bool(consumed.any()):
            continue
        want = embedding_for(mm_hash, rows[mm_hash], hidden)
        if not torch.equal(used[consumed], want[consumed]):
            problems.append(f"request {request_id}: embedding of {mm_hash} differs from what E produced")
        compared += int(consumed.sum())
    return compared, problems


def connector_leaks(sim: Any, settle: float = 5.0) -> list[str]:
    """The simulator's leak check plus every connector side's ``held()`` (scheduler, workers) at zero.

    ``settle``: a discarded lookup's or a cancelled load's store call runs to its end on the loop; give
    those up to this long to hand their state back before calling it a leak.
    """
    problems = [f"engine: {p}" for p in sim.leak_check()]
    deadline = time.monotonic() + settle
    sources: list[tuple[str, Any]] = []
    ec = getattr(sim.scheduler, "ec_connector", None)
    if ec is not None:
        sources.append(("EC scheduler", ec.scheduler_side))
        sources += [(f"EC worker {w.rank}", w.ec_connector.worker_side) for w in sim.workers]
    kv = getattr(sim.scheduler, "connector", None)
    if kv is not None:
        sources.append(("KV scheduler", kv.scheduler_side))
        sources += [(f"KV worker {w.rank}", w.kv_connector.worker_side) for w in sim.workers]
    for name, side in sources:
        held = _held(side)
        while held and time.monotonic() < deadline:
            poll = getattr(side, "poll", None)
            if poll is not None:
                poll()
            time.sleep(0.01)
            held = _held(side)
        problems += [f"{name}: {k}={v}" for k, v in held.items()]
    return problems


#: Counters that are bookkeeping, not held resources: "pushing" (an E scheduler's saves it may still report)
#: and "pending_drops" (drop orders for items no worker holds, delivered with the next model step).
_NOT_HELD = frozenset({"pushing", "pending_drops"})


def _held(side: Any) -> dict[str, int]:
    """``side.held()`` (what every connector side holds now) without the zeros and the bookkeeping."""
    return {k: v for k, v in side.held().items() if v and k not in _NOT_HELD}


class ProcessCensus:
    """Open file descriptors and threads of this process, to compare before and after a run."""

    def __init__(self) -> None:
        self.fd_names = _fd_names()
        self.fds = len(self.fd_names)
        self.threads = threading.active_count()

    def grown(self, slack_fds: int = 0) -> list[str]:
        problems = []
        names = _fd_names()
        if len(names) > self.fds + slack_fds:
            new = sorted((Counter(names) - Counter(self.fd_names)).elements())
            problems.append(f"file descriptors: {self.fds} before, {len(names)} after (new: {new[:8]})")
        threads = threading.active_count()
        if threads > self.threads:
            names = sorted(t.name for t in threading.enumerate())
            problems.append(f"threads: {self.threads} before, {threads} after ({names})")
        return problems


def _fd_names() -> list[str]:
    """What each open descriptor points at (``socket:[...]``, a path, ``anon_inode:[eventfd]``)."""
    names = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to compare
        return []
    for fd in fds:
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the descriptor listdir itself used, closed since
    return names


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
