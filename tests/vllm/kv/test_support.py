"""Helpers shared by the KV connector tests (no tests here): specs, a byte-exact KV check, the leak check."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

_names = itertools.count()


def store_url(latency: str = "") -> str:
    """A private in-process store shared by every engine of one test (a fresh name each call)."""
    url = f"memory://kvtest-{next(_names)}"
    return f"{url}?latency={latency}" if latency else url


def kv_spec(url: str, role: str = "kv_both", **extra: Any) -> Any:
    from asyncconn_tools.sim.engine import ConnectorSpec

    return ConnectorSpec("AsyncConnKVConnector", "asyncconn.vllm", role, {"backend_url": url, **extra})


def check_kv(sim: Any) -> int:
    """Every running request's computed KV equals what computing it would give, on every rank.

    Returns how many requests were checked. Loaded blocks hold bytes from the store, computed ones bytes
    from the simulated forward: any wrong block id, offset, rank or layer shows up here.
    """
    checked = 0
    for request in list(sim.scheduler.running):
        n = request.num_computed_tokens
        if n == 0:
            continue
        for rank in range(len(sim.workers)):
            got = sim.read_kv(request.request_id, rank)
            want = sim.expected_kv(request.all_token_ids[:n], rank)
            for layer, tensor in got.items():
                assert torch.equal(tensor, want[layer]), (
                    f"{request.request_id} rank {rank} {layer}: KV differs"
                )
        checked += 1
    return checked


def record_hit_sources(sim: Any) -> list[dict[Any, int]]:
    """Every step's hits by source as vLLM's scheduler records them (``get_external_cache_hit_sources``),
    appended to the list returned as the simulator runs."""
    seen: list[dict[Any, int]] = []
    make_stats = sim.scheduler.make_stats

    def recording(*args: Any, **kwargs: Any) -> Any:
        stats = make_stats(*args, **kwargs)
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            seen.append(dict(stats.connector_prefix_cache_stats.hits_by_source))
        return stats

    sim.scheduler.make_stats = recording
    return seen


def run_checked(sim: Any, max_steps: int = 2000) -> list[Any]:
    """``run_until_idle`` with :func:`check_kv` after every step."""
    records: list[Any] = []
    while sim.scheduler.has_requests() or sim.scheduler.requests:
        assert len(records) < max_steps, f"not idle after {max_steps} steps"
        record = sim.step()
        records.append(record)
        check_kv(sim)
        if not record.num_scheduled_tokens:
            time.sleep(0.002)  # an idle engine step: give in-flight store calls wall time, as a real one does
    return records


def leaks(sim: Any) -> list[str]:
    """The simulator's leak check plus every connector-side count (scheduler and each worker) at zero."""
    problems = list(sim.leak_check())
    side = sim.scheduler.connector.scheduler_side
    deadline = time.monotonic() + 5.0
    while any(v for k, v in side.held().items() if k.startswith("lookup_")) and time.monotonic() < deadline:
        time.sleep(0.01)  # a discarded lookup's store call still runs to its end; its answer is dropped
    problems += [f"scheduler {k}={v}" for k, v in side.held().items() if v]
    for worker in sim.workers:
        side_w = worker.kv_connector.worker_side
        while any(side_w.held().values()) and time.monotonic() < deadline:
            side_w.poll()  # cancelled fetches hand their staging back once their loop task has stopped
            time.sleep(0.01)
        counts = side_w.held()
        problems += [f"worker {worker.rank} {k}={v}" for k, v in counts.items() if v]
    return problems


def prompt(seed: int, length: int, vocab: int = 1000) -> list[int]:
    return [(seed * 7919 + i * 31) % vocab for i in range(length)]


def load_error_blocks(records: list[Any]) -> set[int]:
    """Every block id the worker reported as failed to load (``invalid_block_ids``) over ``records``."""
    return set().union(
        *(r.kv_connector_output.invalid_block_ids or set() for r in records if r.kv_connector_output)
    )


class EventRouter:
    """Stands in for the scheduler's ``kv_event_publisher`` and indexes what it gets as a router does:
    residency by (medium, ownership), block hash. vLLM's ``AllBlocksCleared`` (its prefix cache reset)
    clears its own ``GPU`` blocks. (The engine tests replay a real publisher's batches into one:
    ``tests/engine/routers.py``.)"""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.held: dict[tuple[str | None, str | None], set[Any]] = {}

    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            self.events.append(event)
            if isinstance(event, AllBlocksCleared):
                self.held.get(("GPU", None), set()).clear()
                continue
            if not isinstance(event, BlockStored | BlockRemoved):
                continue
            where = self.held.setdefault((event.medium, getattr(event, "ownership", None)), set())
            if isinstance(event, BlockStored):
                where.update(event.block_hashes)
            else:
                where.difference_update(event.block_hashes)

    def of(self, kind: type, where: tuple[str, str]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and (e.medium, e.ownership) == where]

    def shutdown(self) -> None:
        pass


def check_tier_events(sim: Any, router: EventRouter) -> int:
    """Between steps: the router's host-tier residency is exactly the values the scheduler published as in
    every tier, and every rank's tier can still serve each of them (indexed, or withdrawn and not yet
    acknowledged). How many values that is."""
    from asyncconn.vllm.kv.tierevents import HOST_TIER

    events = sim.scheduler.connector.scheduler_side.tier_events
    assert events is not None
    published = events.published()
    want = {h for block_hashes in published.values() for h in block_hashes}
    assert router.held.get((HOST_TIER.medium, HOST_TIER.ownership), set()) == want
    for worker in (w.kv_connector.worker_side for w in sim.workers):
        lru = worker.store.host_tier.lru
        names = worker.keys.store_keys(list(published), worker.rank)
        assert all(lru.readable(name) for name in names), "a published value no longer in a tier"
    return len(published)


def record_stats(side: Any) -> list[dict[str, Any]]:
    """The KV scheduler side's stats as vLLM takes them each step (``side.stats()``), recorded from now on
    in the list returned."""
    counted: list[dict[str, Any]] = []
    taken = side.stats

    def recorded() -> Any:
        stats = taken()
        if stats is not None:
            counted.append(dict(stats.data))
        return stats

    side.stats = recorded
    return counted


def serve_others(sim: Any, until: Any, *, start: int = 0, seconds: float = 5.0) -> int:
    """Serve short prompts unrelated to a test's own (each new) until ``until()`` holds or ``seconds``
    pass; how many were served so far (``start``: how many an earlier call served)."""
    import time

    deadline = time.monotonic() + seconds
    n = start
    while time.monotonic() < deadline and not until():
        n += 1
        sim.add_request(f"other-{n}", prompt(100 + n, 2 * 16 + 1), max_tokens=2)
        run_checked(sim)
        time.sleep(0.05)
    return n
