"""Host-tier hits counted as ``host``: the scheduler side claims a planned load's values in the tier of the
one worker in its process, counts their tokens, and releases the claims when the load ends, the request is
preempted or finishes. A real :class:`HostTier` over ``memory://``; the lookup transport answered by hand.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)
from asyncconn_backends.memory import MemoryBackend

from asyncconn.hosttier import HostTier
from asyncconn.lookup import PREFIX, LookupClient
from asyncconn.vllm.kv.connector import AsyncConnKVConnector
from asyncconn.vllm.kv.hostclaims import HostClaims, register_tier, registered_tier, unregister_tier
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from tests.lookup.fakes import FakeTransport, noop, wait_until
from tests.vllm.kv.scheduling import HASHES, allocated, fake_request, received

pytestmark = pytest.mark.interface

IDENTITY = KVIdentity("m", "", "float16", "default", 16, 2, 8, ("l0",), 1, 1)
KEYS = KeySpace(IDENTITY)
VALUE = 1000  # bytes per stored value


def _key(value: int) -> str:
    return KEYS.store_key(KEYS.value_hashes(HASHES)[value], 0)


class Setup:
    def __init__(self, runtime: Any, name: str) -> None:
        self.rt = runtime
        self.name = name
        self.tier = HostTier(MemoryBackend(), 4 * VALUE, align=1)
        runtime.run(self.tier.ready())
        self.transport = FakeTransport()
        client = LookupClient(self.transport, PREFIX, runtime=runtime, timeout=30.0)
        self.side = KVSchedulerSide(
            KEYS, lookup=client, save=False, host=HostClaims(name, ValueParts.single(KEYS), 16)
        )

    def hold(self, *values: int) -> None:
        self.rt.run(self.tier.put([(_key(v), [bytes([v]) * VALUE]) for v in values]))

    def plan(self, rid: str, hit: int, block_ids: list[int]) -> int:
        """Look ``rid`` up (the store answers ``hit`` values), plan its load: the tokens counted as host."""
        request = fake_request(rid)
        assert self.side.get_num_new_matched_tokens(request, 0) == (None, False)
        wait_until(lambda: bool(self.transport.pending))
        for wid in list(self.transport.pending):
            self.rt.run(self.transport.answer(wid, hit))
        self.rt.run(noop())
        tokens, load_async = self.side.get_num_new_matched_tokens(request, 0)
        assert tokens == hit * 16 and load_async
        self.side.update_state_after_alloc(request, allocated(block_ids), hit * 16)
        return self.side.host_tokens(rid)


@pytest.fixture
def setup(runtime: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    s = Setup(runtime, f"engine-{request.node.name}")
    register_tier(s.name, s.tier)
    try:
        yield s
    finally:
        s.side.close()
        unregister_tier(s.name, s.tier)
        runtime.run(s.tier.close())


def test_a_planned_loads_tier_values_are_counted_kept_and_released_when_received(setup: Setup) -> None:
    setup.hold(0, 1, 2)
    assert setup.plan("r", 4, [10, 11, 12, 13]) == 3 * 16  # values 0-2 in the tier; 3 only in the store
    assert setup.side.host_tokens("r") == 0  # asked once
    lru = setup.tier.lru
    assert lru.claims == 1 and lru.stats.pinned == 3
    setup.hold(5, 6)  # the tier is full of claimed values: the new ones are not kept, none evicted
    assert all(_key(v) in lru for v in (0, 1, 2)) and lru.stats.evictions == 0
    setup.side.update_connector_output(received("r"))
    assert lru.claims == 0 and lru.stats.pinned == 0
    assert setup.side.held()["host_claims"] == 0 and setup.side.held()["host_tokens"] == 0
    setup.hold(5, 6)  # now they are kept, evicting unclaimed values
    assert _key(5) in lru and _key(6) in lru


def test_claims_end_with_preemption_and_with_the_request(setup: Setup) -> None:
    setup.hold(0, 1)
    assert setup.plan("p", 2, [1, 2]) == 32
    assert setup.plan("f", 2, [3, 4]) == 32
    assert setup.tier.lru.claims == 2
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[], new_token_ids=[]
    )
    so = SimpleNamespace(
        preempted_req_ids={"p"},
        finished_req_ids=set(),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    setup.side.build_connector_meta(so)
    assert setup.tier.lru.claims == 1
    setup.side.request_finished(fake_request("f"))
    assert setup.tier.lru.claims == 0 and setup.tier.lru.stats.pinned == 0
    held = setup.side.held()
    assert held["host_claims"] == 0 and held["host_tokens"] == 0


def test_no_tier_or_several_tiers_in_the_process_count_nothing_as_host(runtime: Any, setup: Setup) -> None:
    setup.hold(0, 1)
    other = HostTier(MemoryBackend(), VALUE, align=1)
    register_tier(setup.name, other)  # a second worker in this process: whose tier a load reads is unknown
    try:
        assert registered_tier(setup.name) is None
        assert setup.plan("a", 2, [1, 2]) == 0 and setup.tier.lru.claims == 0
    finally:
        unregister_tier(setup.name, other)
        runtime.run(other.close())
    assert registered_tier(setup.name) is setup.tier
    assert setup.plan("b", 2, [3, 4]) == 32
    unregister_tier(setup.name, setup.tier)
    assert setup.plan("c", 2, [5, 6]) == 0
    register_tier(setup.name, setup.tier)


def test_the_registry_does_not_keep_a_tier_alive(runtime: Any) -> None:
    tier = HostTier(MemoryBackend(), VALUE, align=1)
    register_tier("gone", tier)
    assert registered_tier("gone") is tier
    runtime.run(tier.close())
    del tier
    gc.collect()
    assert registered_tier("gone") is None
    unregister_tier("gone", HostTier.__new__(HostTier))  # (nothing left to remove: no error)


def test_the_connector_splits_a_hit_between_host_and_the_stores_source() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    def sources(host: int, n: int) -> dict[Any, int]:
        fake = SimpleNamespace(
            scheduler_side=SimpleNamespace(host_tokens=lambda rid: host, local_store_tokens=lambda rid: 0),
            _cache_hit_source=CacheHitSource.DISK,
        )
        return AsyncConnKVConnector.get_external_cache_hit_sources(fake, fake_request("r"), n)  # type: ignore[arg-type]

    assert sources(48, 64) == {CacheHitSource.HOST: 48, CacheHitSource.DISK: 16}
    assert sources(64, 64) == {CacheHitSource.HOST: 64}
    assert sources(0, 64) == {CacheHitSource.DISK: 64}
    assert sources(80, 64) == {CacheHitSource.HOST: 64}  # never more than vLLM granted


def test_claims_only_where_the_worker_runs_in_the_schedulers_process() -> None:
    """vLLM's CPU platform turns ``uni`` into ``mp`` under ``vllm serve``: one rank in a worker process of its
    own must report its tier (claims in the scheduler's process would find none and count nothing)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    from asyncconn.vllm.kv.connector import _tier_mode, _worker_in_scheduler_process

    def in_process(backend: Any) -> bool:
        config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
        return _worker_in_scheduler_process(config)

    assert in_process("uni") and in_process("external_launcher") and in_process(ExecutorWithExternalLauncher)
    assert in_process(UniProcExecutor)
    assert not in_process("mp") and not in_process("ray") and not in_process(None) and not in_process(object)
    assert _tier_mode(True, False, True, 1, True) == "claims"
    assert _tier_mode(True, False, True, 1, False) == "reports"
    assert _tier_mode(True, False, True, 2, True) == "reports"
    assert _tier_mode(True, True, True, 1, True) == "reports"  # KV events: the tiers' events need reports
    assert _tier_mode(False, False, True, 1, True) == "none"
    assert _tier_mode(True, False, False, 1, False) == "none"  # a producer only: nothing is loaded
