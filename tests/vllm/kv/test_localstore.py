"""Local-store hits counted as ``disk``: the scheduler side asks the local store (``local_store_url``) beside
the shared one, waits for both answers, and counts the planned values the local store holds. Both lookup
transports answered by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.lookup import EXISTS, PREFIX, LookupClient
from asyncconn.vllm.kv.connector import AsyncConnKVConnector
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.localstore import LocalStoreHits
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from tests.lookup.fakes import FakeTransport, noop, wait_until
from tests.vllm.kv.scheduling import allocated, fake_request, step_output

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


@dataclass
class Harness:
    side: KVSchedulerSide
    shared: FakeTransport
    local: FakeTransport
    rt: Any

    def answer(self, transport: FakeTransport, value: Any) -> None:
        wait_until(lambda: bool(transport.pending))
        for wid in list(transport.pending):
            self.rt.run(transport.answer(wid, value))
        self.rt.run(noop())

    def fail(self, transport: FakeTransport) -> None:
        """Every question ``transport`` holds fails (the store's error: ``None``, as a transport says it)."""
        wait_until(lambda: bool(transport.pending))

        async def deliver() -> None:
            assert transport._deliver is not None
            transport._deliver([(wid, None) for wid in transport.pending])
            transport.pending.clear()

        self.rt.run(deliver())
        self.rt.run(noop())


def _harness(runtime: Any, tp: int) -> Harness:
    identity = KVIdentity("m", "", "float16", "default", 16, 2, 8, ("l0",), tp, 1)
    keys = KeySpace(identity)
    shared, local = FakeTransport(), FakeTransport()
    side = KVSchedulerSide(
        keys,
        lookup=LookupClient(shared, PREFIX, runtime=runtime, timeout=30.0),
        save=False,
        local_store=LocalStoreHits(
            LookupClient(local, EXISTS, runtime=runtime, timeout=30.0), keys.keys_per_value
        ),
    )
    return Harness(side, shared, local, runtime)


@pytest.fixture
def h(runtime: Any) -> Iterator[Harness]:
    harness = _harness(runtime, tp=1)
    try:
        yield harness
    finally:
        harness.side.close()


def test_the_planned_values_the_local_store_holds_are_counted_as_disk(h: Harness) -> None:
    request = fake_request("r")
    assert h.side.get_num_new_matched_tokens(request, 0) == (None, False)
    wait_until(lambda: bool(h.local.pending))
    (asked,) = h.local.pending.values()
    assert len(asked) == 6  # the keys the shared store is asked for, the same ones
    h.answer(h.shared, 6)
    assert h.side.get_num_new_matched_tokens(request, 16) == (None, False)  # the local answer is not in yet
    h.answer(h.local, (True, True, False, True, True, False))
    assert h.side.get_num_new_matched_tokens(request, 16) == (80, True)
    h.side.update_state_after_alloc(request, allocated([1, 2, 3, 4, 5, 6, 7]), 80)
    # Values 1-5 are loaded (value 0 is a local hit of vLLM's); the local store holds 1, 3 and 4.
    assert h.side.local_store_tokens("r") == 48
    assert h.side.local_store_tokens("r") == 0  # asked once
    h.side.build_connector_meta(step_output(finished=frozenset({"r"})))
    assert not any(h.side.held().values())


def test_a_value_is_on_the_local_disk_only_when_every_ranks_key_is(runtime: Any) -> None:
    h = _harness(runtime, tp=2)
    try:
        request = fake_request("r", 50)  # 3 values of 2 keys each (one per rank), all usable
        h.side.get_num_new_matched_tokens(request, 0)
        h.answer(h.shared, 6)
        h.answer(h.local, (True, True, True, False, True, True))  # rank 1's key of value 1 is missing
        assert h.side.get_num_new_matched_tokens(request, 0) == (48, True)
        h.side.update_state_after_alloc(request, allocated([1, 2, 3]), 48)
        assert h.side.local_store_tokens("r") == 32  # values 0 and 2
    finally:
        h.side.close()


def test_a_local_store_that_fails_counts_nothing_and_holds_up_nothing(h: Harness) -> None:
    request = fake_request("f")
    h.side.get_num_new_matched_tokens(request, 0)
    h.fail(h.local)  # the local store failed (or its lookup timed out): nothing held
    h.answer(h.shared, 4)
    assert h.side.get_num_new_matched_tokens(request, 0) == (64, True)
    h.side.update_state_after_alloc(request, allocated([1, 2, 3, 4, 5, 6, 7]), 64)
    assert h.side.local_store_tokens("f") == 0
    h.side.build_connector_meta(step_output(finished=frozenset({"f"})))
    assert not any(h.side.held().values())


def test_preemption_and_finish_drop_the_local_question(h: Harness) -> None:
    preempted, finished = fake_request("p"), fake_request("q")
    for request in (preempted, finished):
        h.side.get_num_new_matched_tokens(request, 0)
    wait_until(lambda: len(h.local.pending) == 2)
    h.side.build_connector_meta(step_output(preempted=frozenset({"p"}), finished=frozenset({"q"})))
    # Both questions to each store discarded: the loop drops them in flight (never served).
    wait_until(lambda: not any(h.side.held().values()))
    assert h.side.local_store is not None and h.side.local_store.lookup.metrics.discards == 2


def test_the_connector_splits_a_hit_between_host_disk_and_the_stores_source() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    def sources(host: int, local: int, n: int, store: Any = None) -> dict[Any, int]:
        fake = SimpleNamespace(
            scheduler_side=SimpleNamespace(
                host_tokens=lambda rid: host, local_store_tokens=lambda rid: local
            ),
            _cache_hit_source=store or CacheHitSource.EXTERNAL_UNSPECIFIED,
        )
        return AsyncConnKVConnector.get_external_cache_hit_sources(fake, fake_request("r"), n)  # type: ignore[arg-type]

    ext, disk, host = CacheHitSource.EXTERNAL_UNSPECIFIED, CacheHitSource.DISK, CacheHitSource.HOST
    assert sources(0, 48, 64) == {disk: 48, ext: 16}
    assert sources(16, 48, 64) == {host: 16, disk: 32, ext: 16}  # the tier's tokens are the local store's too
    assert sources(32, 16, 64) == {host: 32, ext: 32}  # (a tier holding what the local store dropped)
    assert sources(0, 80, 64) == {disk: 64}  # never more than vLLM granted
    assert sources(0, 0, 64) == {ext: 64}
    assert sources(0, 48, 64, store=disk) == {disk: 64}  # a file:// shared store counts as disk too


def test_an_admitted_request_with_nothing_to_load_drops_its_local_question(h: Harness) -> None:
    request = fake_request("n")
    h.side.get_num_new_matched_tokens(request, 0)
    h.answer(h.shared, 0)  # a miss: nothing waits for the local answer
    assert h.side.get_num_new_matched_tokens(request, 0) == (0, False)
    h.side.update_state_after_alloc(request, allocated([1, 2, 3, 4, 5, 6, 7]), 0)
    wait_until(lambda: not any(v for k, v in h.side.held().items() if k != "requests"))
    assert h.side.local_store_tokens("n") == 0
