"""What KV events cost vLLM's scheduler thread per stored value (not run by the tests).

Usage: ``.venv/bin/python scripts/kv_events_cost.py [--requests N] [--tokens N] [--block-size N]`` (defaults:
20 requests of 4096 tokens, 16-token blocks, one block per value). Real vLLM ``Request`` objects (its block
hasher); times :meth:`KVEvents.planned` (the snapshot taken when a save is planned) and the confirmation path
(``update`` + ``take`` + ``release``) per value, after one warm-up request. With events off neither runs.
Then, with a host tier (``host_cache_bytes``), the tier's events: :meth:`TierEvents.planned` (the snapshot
at a planned save or load) and the reports' path per value, once for the value coming into the tier
(mirror and events updated, ``BlockStored``) and once for it leaving (``BlockRemoved``). Then the same for
the local store's events (``local_store_url``: :class:`LocalTierEvents`, the workers' changes in order).
Last, a recheck (``kv_events_recheck``: :class:`ResidencyRecheck`) of 1,024 remembered values with one and
with eight tensor-parallel ranks, the store's answers stood in for: the longest step and the sum of its steps,
against naming every key in one step; and the local store's recheck of as many values (the step that takes
its answer settles every key in the mirror: timed when nothing changes and when every value is gone).
"""

from __future__ import annotations

import argparse
import gc
import time

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from asyncconn.vllm.kv.events import KVEvents, SavedReport, tier_of
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.localevents import LocalMirror, LocalTierEvents
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.recheck import RECHECK_VALUES, ResidencyRecheck, StoreResidency
from asyncconn.vllm.kv.tierevents import TierEvents
from asyncconn.vllm.kv.tiernews import TierMirror


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(args.block_size, sha256)
    identity = KVIdentity("m", "", "float16", "default", args.block_size, 8, 128, ("l0",), 1, 1)
    events = KVEvents(KeySpace(identity), tier_of("file:///kv"))
    requests = [
        Request(
            f"r{i}",
            [(i * 7919 + j) % 32000 for j in range(args.tokens)],
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
        )
        for i in range(args.requests + 1)
    ]
    gc.collect()  # as vLLM's engine core does once it has started (``freeze_gc_heap``): collections then
    gc.freeze()  # scan only what was made since, as in a serving engine
    events.planned("warm-up", requests[0], list(enumerate(requests[0].block_hashes)))
    events.release("warm-up")
    values = 0
    planned = confirmed = 0.0
    for request in requests[1:]:
        hashes = list(request.block_hashes)
        t0 = time.perf_counter()
        events.planned(request.request_id, request, list(enumerate(hashes)))
        t1 = time.perf_counter()
        events.update(SavedReport(saved=dict.fromkeys(hashes, 1)))
        events.take()
        events.release(request.request_id)
        t2 = time.perf_counter()
        planned += t1 - t0
        confirmed += t2 - t1
        values += len(hashes)
    print(
        f"{values} values: planned {planned / values * 1e6:.1f} us/value, "
        f"update+take+release {confirmed / values * 1e6:.1f} us/value"
    )
    keys = events.keys
    mirror = TierMirror(ValueParts.single(keys), 1, args.block_size)
    tier = TierEvents(events, mirror)
    snapshot = admitted = gone = 0.0
    for seq, request in enumerate(requests[1:]):
        hashes = list(request.block_hashes)
        names = [keys.store_key(h, 0) for h in hashes]
        t0 = time.perf_counter()
        tier.planned(request, list(enumerate(hashes)))
        t1 = time.perf_counter()
        news = {0: (2 * seq + 1, names, [])}
        mirror.update(news)
        tier.update(news)
        events.take()
        t2 = time.perf_counter()
        news = {0: (2 * seq + 2, [], names)}
        mirror.update(news)
        tier.update(news)
        events.take()
        t3 = time.perf_counter()
        snapshot += t1 - t0
        admitted += t2 - t1
        gone += t3 - t2
    assert not tier.published()
    print(
        f"host tier, {values} values: planned {snapshot / values * 1e6:.1f} us/value, "
        f"into the tiers {admitted / values * 1e6:.1f} us/value, out {gone / values * 1e6:.1f} us/value "
        "(names built outside the timing: the worker's reports carry them)"
    )
    local = LocalTierEvents(events, LocalMirror(ValueParts.single(keys), 1))
    snapshot = admitted = gone = 0.0
    for request in requests[1:]:
        hashes = list(request.block_hashes)
        names = [keys.store_key(h, 0) for h in hashes]
        t0 = time.perf_counter()
        local.planned(request, list(enumerate(hashes)))
        t1 = time.perf_counter()
        local.update_local([(name, True) for name in names])
        events.take()
        t2 = time.perf_counter()
        local.update_local([(name, False) for name in names])
        events.take()
        t3 = time.perf_counter()
        snapshot += t1 - t0
        admitted += t2 - t1
        gone += t3 - t2
    assert not local.published()
    print(
        f"local store, {values} values: planned {snapshot / values * 1e6:.1f} us/value, "
        f"into the directory {admitted / values * 1e6:.1f} us/value, out {gone / values * 1e6:.1f} us/value"
    )
    for tp in (1, 8):
        _recheck_cost(requests[1:], args.block_size, tp)
    for tp in (1, 8):
        _local_recheck_cost(requests[1:], args.block_size, tp)


class _Present:
    """Stands in for the recheck's lookup client: every key asked about is there."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}

    def submit(self, rid: str, keys: list[bytes]) -> None:
        self.asked[rid] = len(keys)

    def poll_answer(self, rid: str) -> tuple[tuple[bool, ...], bool] | None:
        n = self.asked.pop(rid, None)
        return None if n is None else ((True,) * n, True)

    def close(self) -> None:
        pass


def _timed_recheck(recheck: ResidencyRecheck) -> tuple[float, float]:
    """One whole recheck, step by step until it is done: its longest step and the sum of its steps (s)."""
    steps = []
    while True:
        t0 = time.perf_counter()
        recheck.step()
        steps.append(time.perf_counter() - t0)
        if not recheck.asking:
            return max(steps), sum(steps)


def _recheck_cost(requests: list[Request], block_size: int, tp: int) -> None:
    identity = KVIdentity("m", "", "float16", "default", block_size, 8, 128, ("l0",), tp, 1)
    events = KVEvents(KeySpace(identity), tier_of("mooncake://h:50051"))
    for request in requests:
        hashes = list(request.block_hashes)
        events.planned(request.request_id, request, list(enumerate(hashes)))
        events.update(SavedReport(saved=dict.fromkeys(hashes, events.ranks)))
        events.take()
        events.release(request.request_id)
    recheck = ResidencyRecheck(StoreResidency(events, events.keys), _Present(), interval=0.0)  # type: ignore[arg-type]
    rounds = [_timed_recheck(recheck) for _ in range(5)]
    oldest = [h for h, _ in events.oldest(RECHECK_VALUES)]
    t0 = time.perf_counter()
    events.keys.lookup_keys(oldest)
    at_once = time.perf_counter() - t0
    longest = sorted(r[0] for r in rounds)[len(rounds) // 2]
    total = sorted(r[1] for r in rounds)[len(rounds) // 2]
    print(
        f"recheck of {RECHECK_VALUES} values, {tp} rank(s): longest step {longest * 1e3:.2f} ms, "
        f"all its steps {total * 1e3:.2f} ms (median of 5); every key named in one step "
        f"{at_once * 1e3:.2f} ms"
    )


class _Answering:
    """Stands in for the local recheck's lookup client: answers that every key is there, or none."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}
        self.held = True

    def submit(self, rid: str, keys: list[bytes]) -> None:
        self.asked[rid] = len(keys)

    def poll_answer(self, rid: str) -> tuple[tuple[bool, ...], bool] | None:
        n = self.asked.pop(rid, None)
        return None if n is None else ((self.held,) * n, True)

    def close(self) -> None:
        pass


def _local_recheck_cost(requests: list[Request], block_size: int, tp: int) -> None:
    """The local store's recheck: its steps while every value is found held as the mirror knows (the usual
    answer), and the step whose answer finds all of them gone (1,024 values settled and announced)."""
    identity = KVIdentity("m", "", "float16", "default", block_size, 8, 128, ("l0",), tp, 1)
    keys = KeySpace(identity)
    events = KVEvents(keys, tier_of("redis://h:6379"), store=False)
    local = LocalTierEvents(events, LocalMirror(ValueParts.single(keys), tp))
    for request in requests:
        hashes = list(request.block_hashes)
        local.planned(request, list(enumerate(hashes)))
        local.update_local([(keys.store_key(h, rank), True) for h in hashes for rank in range(tp)])
        events.take()
    client = _Answering()
    recheck = ResidencyRecheck(local, client, interval=0.0)  # type: ignore[arg-type]
    rounds: list[tuple[float, float]] = []
    for i in range(6):
        client.held = i % 2 == 0  # alternately: all there (nothing changes), all gone (all announced)
        rounds.append(_timed_recheck(recheck))
        events.take()

    def median(i: int, held: bool) -> float:
        picked = sorted(r[i] for n, r in enumerate(rounds) if (n % 2 == 0) == held)
        return picked[len(picked) // 2] * 1e3

    print(
        f"local recheck of {RECHECK_VALUES} values, {tp} rank(s), all there / all gone (announced): "
        f"longest step {median(0, True):.2f} / {median(0, False):.2f} ms, "
        f"all its steps {median(1, True):.2f} / {median(1, False):.2f} ms (median of 3 each)"
    )

if __name__ == "__main__":
    main()
