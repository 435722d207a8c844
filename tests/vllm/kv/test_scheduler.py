"""KVSchedulerSide on its own (no engine): a lookup transport the test answers by hand, fake requests.

What only a controlled transport can show: ``(None, False)`` for exactly as long as the store has not
answered, an answer kept (not re-asked) while the request cannot be admitted, a preempted request's old
answer never reused, and a late answer to a discarded lookup never served.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.lookup import PREFIX, LookupClient
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from tests.lookup.fakes import FakeTransport, noop, wait_until
from tests.vllm.kv.scheduling import HASHES, allocated, fake_request, step_output

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

IDENTITY = KVIdentity("m", "", "float16", "default", 16, 2, 8, ("l0",), 1, 1)


@dataclass
class Harness:
    """The scheduler side under test, the transport its lookups go to, and the loop that runs them."""

    side: KVSchedulerSide
    client: LookupClient[int]
    transport: FakeTransport
    rt: Any

    def answer_all(self, value: int | None = None) -> None:
        wait_until(lambda: bool(self.transport.pending))
        for wid in list(self.transport.pending):
            self.rt.run(self.transport.answer(wid, value))
        self.rt.run(noop())


@pytest.fixture
def h(runtime: Any) -> Iterator[Harness]:
    transport = FakeTransport()
    client = LookupClient(transport, PREFIX, runtime=runtime, timeout=30.0)
    harness = Harness(
        KVSchedulerSide(KeySpace(IDENTITY), lookup=client, save=True), client, transport, runtime
    )
    try:
        yield harness
    finally:
        harness.side.close()


def test_deferred_until_answered_then_kept_until_allocation(h: Harness) -> None:
    request = fake_request("r")
    assert h.side.get_num_new_matched_tokens(request, 0) == (None, False)
    assert h.side.get_num_new_matched_tokens(request, 0) == (None, False)  # polled, not re-submitted
    h.answer_all(4)  # 4 of the 6 usable values present
    assert h.side.get_num_new_matched_tokens(request, 16) == (64 - 16, True)
    # the scheduler could not allocate: asked again next step, answered from memory, no new lookup
    assert h.side.get_num_new_matched_tokens(request, 16) == (48, True)
    assert h.client.metrics.submitted == 1
    h.side.update_state_after_alloc(request, allocated([7, 8, 9, 10, 11, 12, 13]), 48)
    meta = h.side.build_connector_meta(step_output())
    (load,) = meta.loads
    assert [ref.block_ids for ref in load.values] == [((8,),), ((9,),), ((10,),)]  # block 0 was a local hit
    assert h.side.request_finished(request) == (True, None)  # finished while loading: blocks held
    assert h.side.build_connector_meta(step_output(finished=frozenset({"r"}))).finished_via_recv == frozenset(
        {"r"}
    )
    assert not any(h.side.held().values())


def test_preempted_request_asks_the_store_anew(h: Harness) -> None:
    request = fake_request("p")
    h.side.get_num_new_matched_tokens(request, 0)
    h.answer_all(3)
    assert h.side.get_num_new_matched_tokens(request, 0) == (48, True)
    h.side.build_connector_meta(step_output(preempted=frozenset({"p"})))  # preempted before it was allocated
    assert h.side.get_num_new_matched_tokens(request, 0) == (None, False)  # a new lookup, not the old answer
    assert h.client.metrics.submitted == 2
    h.answer_all(1)  # the store changed meanwhile
    assert h.side.get_num_new_matched_tokens(request, 0) == (16, True)
    h.side.request_finished(request)
    assert not any(h.side.held().values())


def test_late_answer_of_an_aborted_lookup_is_never_served(h: Harness) -> None:
    request = fake_request("a")
    h.side.get_num_new_matched_tokens(request, 0)
    wait_until(lambda: bool(h.transport.pending))
    assert h.side.request_finished(request) == (False, None)  # aborted while its lookup was in flight
    h.answer_all(6)  # the late answer
    assert h.client.metrics.stale == 1
    again = fake_request("a")  # the same id reused later is a new request
    assert h.side.get_num_new_matched_tokens(again, 0) == (None, False)
    h.side.request_finished(again)
    wait_until(lambda: not any(h.side.held().values()))


def test_nothing_asked_when_the_local_cache_covers_the_usable_prefix(h: Harness) -> None:
    # a one-block prompt: vLLM computes the last token itself, so nothing can ever be loaded
    assert h.side.get_num_new_matched_tokens(fake_request("s", 16), 0) == (0, False)
    assert h.side.get_num_new_matched_tokens(fake_request("c"), 96) == (0, False)
    assert h.client.metrics.submitted == 0


def test_an_idle_step_waits_for_outstanding_lookups_a_busy_step_never(h: Harness) -> None:
    """A step that scheduled nothing hands the GIL to the loop until the lookups are answered (bounded);
    then the next step admits the request, instead of tens of empty steps polling an answer the loop
    cannot deliver while vLLM's thread spins."""
    import threading
    import time

    request = fake_request("w")
    assert h.side.get_num_new_matched_tokens(request, 0) == (None, False)
    wait_until(lambda: bool(h.transport.pending))
    busy = step_output()
    busy.total_num_scheduled_tokens = 8
    started = time.monotonic()
    h.side.build_connector_meta(busy)  # tokens scheduled: never waits
    assert time.monotonic() - started < 0.5
    assert h.client.outstanding()

    def answer_soon() -> None:
        time.sleep(0.001)
        h.rt.run(h.transport.answer_all())

    answering = threading.Thread(target=answer_soon)
    answering.start()
    idle = step_output()
    idle.total_num_scheduled_tokens = 0
    h.side.build_connector_meta(idle)  # waits (<= IDLE_WAIT_S) for the answer
    answering.join()
    # Either the wait saw the answer, or the 2 ms bound passed first on a loaded box: never longer.
    if not h.client.outstanding():
        assert h.side.get_num_new_matched_tokens(request, 0) == (96, True)  # 6 usable values, all there
    h.side.request_finished(request)
    assert not any(h.side.held().values())


def test_idle_wait_is_bounded_when_the_store_never_answers(h: Harness) -> None:
    import time

    from asyncconn.vllm.kv.scheduler import IDLE_WAIT_S

    request = fake_request("s")
    h.side.get_num_new_matched_tokens(request, 0)
    wait_until(lambda: bool(h.transport.pending))
    idle = step_output()
    idle.total_num_scheduled_tokens = 0
    started = time.monotonic()
    h.side.build_connector_meta(idle)
    elapsed = time.monotonic() - started
    assert IDLE_WAIT_S * 0.9 <= elapsed < 1.0
    h.side.request_finished(request)
    h.answer_all()  # the late answer of the discarded lookup is dropped
    assert not any(h.side.held().values())


def test_stats_is_none_and_allocates_nothing_on_a_quiet_step(h: Harness) -> None:
    request = fake_request("q")
    h.side.get_num_new_matched_tokens(request, 0)
    h.answer_all(2)
    h.side.get_num_new_matched_tokens(request, 0)
    first = h.side.stats()
    assert first is not None and first.data["lookups"] == 1 and sum(first.data["lookup_latency"]) == 1
    kept = h.side._stats
    assert h.side.stats() is None
    assert h.side._stats is kept  # the fast path kept the (empty) accumulator: nothing allocated
    h.side.request_finished(request)


def _scheduled_new(rid: str, block_ids: list[int], computed: int, scheduled: int) -> Any:
    out = step_output()
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=computed)
    ]
    out.num_scheduled_tokens = {rid: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


@pytest.mark.parametrize("local", [0, 48, 96])
def test_values_in_the_local_prefix_cache_are_not_saved_again(h: Harness, local: int) -> None:
    """A prompt whose first ``local`` tokens vLLM's own prefix cache holds (saved when this engine computed
    them, or loaded from the store): only the values after them are saved -- a prompt run again saves
    nothing again. The store has none of them (the lookup answers 0)."""
    request = fake_request("t", 100)  # 6 full one-block values of 16 tokens
    answer = h.side.get_num_new_matched_tokens(request, local)
    if local < 96:  # the store could add something: asked, and it has nothing
        assert answer == (None, False)
        h.answer_all(0)
        assert h.side.get_num_new_matched_tokens(request, local) == (0, False)
    else:
        assert answer == (0, False)  # the local cache covers all that could be loaded: nothing asked
    h.side.update_state_after_alloc(request, allocated(list(range(10, 17))), 0)
    meta = h.side.build_connector_meta(_scheduled_new("t", list(range(10, 17)), local, 100 - local))
    saved = [ref.value_hash for spec in meta.saves for ref in spec.values]
    assert saved == HASHES[local // 16 : 6]
    assert h.side.request_finished(request) == (local < 96, None)  # holds its blocks only for saves
    assert not any(h.side.held().values()), h.side.held()


def test_a_local_hit_evicted_before_allocation_is_saved_after_all(h: Harness) -> None:
    """vLLM's cache held 48 tokens when the request was first seen, none when it was finally admitted (the
    blocks were evicted meanwhile): the latest answer counts, so every value is saved."""
    request = fake_request("e", 100)
    assert h.side.get_num_new_matched_tokens(request, 48) == (None, False)
    h.answer_all(0)
    assert h.side.get_num_new_matched_tokens(request, 0) == (0, False)
    h.side.update_state_after_alloc(request, allocated(list(range(10, 17))), 0)
    meta = h.side.build_connector_meta(_scheduled_new("e", list(range(10, 17)), 0, 100))
    assert [ref.value_hash for spec in meta.saves for ref in spec.values] == HASHES[:6]
    h.side.request_finished(request)
    assert not any(h.side.held().values()), h.side.held()


def test_sync_loads_run_at_once_end_with_their_step_and_lower_what_is_stored_when_they_fail(
    runtime: Any,
) -> None:
    """``kv_sync_loads``: the hit is granted as a synchronous load (vLLM schedules the request in the same
    step, on top of it), the load is marked sync, a request finished in that step is not held for its load
    (it ended with the step), and blocks the step reports invalid make their values stored no more, so the
    recompute saves them."""
    transport = FakeTransport()
    client = LookupClient(transport, PREFIX, runtime=runtime, timeout=30.0)
    h = Harness(
        KVSchedulerSide(KeySpace(IDENTITY), lookup=client, save=True, sync_loads=True),
        client,
        transport,
        runtime,
    )
    try:
        request = fake_request("s", 100)  # 6 full one-block values of 16 tokens
        assert h.side.get_num_new_matched_tokens(request, 16) == (None, False)
        h.answer_all(4)
        assert h.side.get_num_new_matched_tokens(request, 16) == (48, False)  # sync: scheduled at once
        ids = list(range(7, 14))
        h.side.update_state_after_alloc(request, allocated(ids), 48)
        meta = h.side.build_connector_meta(_scheduled_new("s", ids, 64, 36))
        (load,) = meta.loads
        assert load.sync and [ref.block_ids for ref in load.values] == [((8,),), ((9,),), ((10,),)]
        assert [ref.value_hash for spec in meta.saves for ref in spec.values] == HASHES[4:6]
        # the step reports block 9 (value 2) invalid: values 2.. are stored no more, and are saved again
        h.side.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids={9}))
        again = step_output()
        again.scheduled_cached_reqs = SimpleNamespace(
            req_ids=["s"],
            resumed_req_ids=set(),
            new_block_ids=[None],
            num_computed_tokens=[32],
            new_token_ids=[],
        )
        again.num_scheduled_tokens = {"s": 68}
        meta = h.side.build_connector_meta(again)
        assert [ref.value_hash for spec in meta.saves for ref in spec.values] == HASHES[2:6]
        assert h.side.request_finished(request) == (True, None)  # held for its saves only
        assert (
            h.side.build_connector_meta(step_output(finished=frozenset({"s"}))).finished_via_recv
            == frozenset()
        )

        # finished in the very step that loads it (one output token): not held for the load
        other = fake_request("t", 100)
        h.side.get_num_new_matched_tokens(other, 0)
        h.answer_all(6)
        assert h.side.get_num_new_matched_tokens(other, 0) == (96, False)
        h.side.update_state_after_alloc(other, allocated(list(range(20, 27))), 96)
        h.side.build_connector_meta(step_output())
        assert h.side.request_finished(other) == (False, None)
        h.side.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=set()))
        assert not h.side.build_connector_meta(step_output(finished=frozenset({"t"}))).finished_via_recv
        assert not any(h.side.held().values()), h.side.held()
    finally:
        h.side.close()


def test_a_load_failed_per_request_is_recomputed_saved_anew_and_never_loaded_again(h: Harness) -> None:
    """A model with several KV cache groups: the workers report a failed load in ``failed_recving`` (the
    request, not its blocks). vLLM then computes it from its local hit; every value it was loading is saved
    anew, and it is never offered a store hit again (a value the lookup finds but no read gets would
    otherwise load, fail and recompute forever)."""
    request = fake_request("f", 100)  # 6 full one-block values of 16 tokens
    h.side.get_num_new_matched_tokens(request, 16)
    h.answer_all(4)
    assert h.side.get_num_new_matched_tokens(request, 16) == (48, True)
    ids = list(range(7, 14))
    h.side.update_state_after_alloc(request, allocated(ids), 48)
    (load,) = h.side.build_connector_meta(step_output()).loads
    assert [ref.value_hash for ref in load.values] == HASHES[1:4]
    h.side.update_connector_output(
        SimpleNamespace(finished_recving={"f"}, failed_recving={"f"}, invalid_block_ids=set())
    )
    assert h.side.get_num_new_matched_tokens(request, 16) == (0, False)  # no new lookup, no hit
    assert h.client.metrics.submitted == 1
    h.side.update_state_after_alloc(request, allocated(ids), 0)
    meta = h.side.build_connector_meta(_scheduled_new("f", ids, 16, 84))
    assert not meta.loads
    assert [ref.value_hash for spec in meta.saves for ref in spec.values] == HASHES[1:6]
    assert h.side.request_finished(request) == (True, None)  # held for its saves only
    h.side.build_connector_meta(step_output(finished=frozenset({"f"})))
    assert not any(h.side.held().values()), h.side.held()
