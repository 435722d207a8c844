"""Removals made by the stores vLLM's scheduler process opened for its own lookups.

A ``file://`` store sweeps (``max_bytes``, ``max_age``) wherever it is open, and only the process whose sweep
ran hears what it removed. The scheduler's process opens such stores too: the shared store, to answer
lookups, and with ``local_store_url`` the local directory, to count ``disk`` hits. The workers' removal hooks
never hear those sweeps, so the scheduler side hooks its own stores and publishes what they removed at its
next step. vLLM's real scheduler through the simulator, with the recheck off (``kv_events_recheck=0``), so
that nothing else could announce the removals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved

from asyncconn.runtime import get_runtime
from asyncconn.vllm.kv.localevents import LOCAL_TIER
from tests.vllm.kv.test_connector import sim_hashes
from tests.vllm.kv.test_support import EventRouter, kv_spec, leaks, prompt, run_checked

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

LOCAL = (LOCAL_TIER.medium, LOCAL_TIER.ownership)
STORE = ("STORAGE", "asyncconn:file")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_by_the_schedulers_own_stores_is_announced(
    make_sim: Any, tmp_path: Path, workers: int
) -> None:
    """The scheduler process's store of the shared directory, then its store of the local directory, sweep
    every value of a prompt: at the next step a router drops them from each residency, exactly once."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    kv = kv_spec(
        f"file://{tmp_path / 'shared'}", local_store_url=f"file://{tmp_path / 'local'}", kv_events_recheck=0
    )
    sim = make_sim(kv=kv, num_workers=workers, kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    tokens = prompt(21, 4 * 16 + 3)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    full = [maybe_convert_block_hash(h) for h in sim_hashes(tokens)[:4]]
    assert router.held[STORE] == router.held[LOCAL] == set(full)

    side = sim.scheduler.connector.scheduler_side
    assert side.lookup is not None and side.local_store is not None
    backends = [client.store.backend for client in (side.lookup, side.local_store.lookup)]
    for where, backend in zip((STORE, LOCAL), backends, strict=True):
        backend.max_bytes = 1  # past its bound: the sweep evicts everything
        report = get_runtime().run(backend.sweep())
        backend.max_bytes = 0
        assert report is not None and report.evicted == 4 * workers
        sim.add_request(f"other-{where[1]}", prompt(99 if where == STORE else 98, 10), max_tokens=2)
        run_checked(sim)  # the step after the sweep publishes it
        assert router.held[where] & set(full) == set()
        removed = [h for e in router.of(BlockRemoved, where) for h in e.block_hashes]
        assert sorted(removed) == sorted(full)  # once each
    assert leaks(sim) == []
    sim.close()
    assert all(backend.on_removed is None for backend in backends)
