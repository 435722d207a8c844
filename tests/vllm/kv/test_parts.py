"""A hybrid model's values in two parts: the window rule against vLLM's own, the keys of each part, and the
scheduler side's hit rule and save and load plans (a lookup transport answered from a set of present keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncconn.lookup import PREFIX, LookupClient
from asyncconn.vllm.kv.groups import NULL_BLOCK_ID, check_groups
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from tests.lookup.fakes import FakeTransport, noop, wait_until

pytestmark = pytest.mark.interface  # vLLM's spec and manager classes only

BLOCK = 16
WINDOW = 33  # the last two blocks at a cut: cdiv(33 - 1, 16)
HASHES = [bytes([i]) * 32 for i in range(10)]
LAYERS = ("g0.l", "g1.l")  # g0 sliding-window, g1 full attention


def _spec(kind: str, size: int = WINDOW) -> Any:
    from vllm.v1 import kv_cache_interface as specs

    common = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    if kind == "full":
        return specs.FullAttentionSpec(**common)
    if kind == "window":
        return specs.SlidingWindowSpec(**common, sliding_window=size)
    return specs.ChunkedLocalAttentionSpec(**common, attention_chunk_size=size)


def _parts(*kinds: str) -> ValueParts:
    groups = [SimpleNamespace(kv_cache_spec=_spec(k), layer_names=[f"g{i}.l"]) for i, k in enumerate(kinds)]
    layout = check_groups(SimpleNamespace(kv_cache_groups=groups, num_blocks=64))
    names = tuple(f"g{i}.l" for i in range(len(kinds)))
    identity = KVIdentity("m", "", "float16", "default", BLOCK, 1, 8, names, 1, 1)
    return ValueParts.of(KeySpace(identity), layout)


@pytest.mark.parametrize("window", [17, 32, 33, 64, 100])
def test_the_sliding_window_rule_is_vllms(window: int) -> None:
    """The first block read at a cut is where vLLM's null padding ends (``get_num_skipped_tokens``), and a
    hit of ``n`` blocks needs exactly the last ``_contiguous_blocks_for_hit`` of them."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    rule = check_groups(
        SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=_spec("window", window), layer_names=["a"])]
        )
    ).window
    assert rule is not None
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    needed = SlidingWindowManager._contiguous_blocks_for_hit(window, BLOCK, False)
    for n in range(12):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, n * BLOCK)  # type: ignore[arg-type]
        assert rule.first_block(n * BLOCK) == skipped // BLOCK
        assert n - rule.first_block(n * BLOCK) == min(n, needed)


def test_the_chunked_local_rule_is_vllms() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager

    rule = check_groups(
        SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=_spec("chunked", 64), layer_names=["a"])]
        )
    ).window
    assert rule is not None
    manager = SimpleNamespace(attention_chunk_size=64)
    for tokens in range(0, 200, 16):
        skipped = ChunkedLocalAttentionManager.get_num_skipped_tokens(manager, tokens)  # type: ignore[arg-type]
        assert rule.first_block(tokens) == skipped // BLOCK


def test_a_model_without_windowed_groups_keeps_one_part_and_its_keys() -> None:
    parts = _parts("full", "full")
    identity = KVIdentity("m", "", "float16", "default", BLOCK, 1, 8, LAYERS, 1, 1)
    assert not parts.split and len(parts.keys) == 1
    assert parts.keys[0].value_key(HASHES[0], 0) == KeySpace(identity).value_key(HASHES[0], 0)


def test_each_part_has_keys_of_its_own() -> None:
    """The whole-life part, the window part and a value of every layer never share a key."""
    parts = _parts("window", "full")
    assert parts.split and (parts.whole, parts.window) == (0, 1)
    assert [k.identity.layers for k in parts.keys] == [("g1.l",), ("g0.l",)]
    every = KeySpace(KVIdentity("m", "", "float16", "default", BLOCK, 1, 8, LAYERS, 1, 1))
    keys = {every.value_key(HASHES[0], 0), *(k.value_key(HASHES[0], 0) for k in parts.keys)}
    assert len(keys) == 3


# -- the scheduler side ---------------------------------------------------------------------------------


@pytest.fixture
def side(runtime: Any) -> Iterator[tuple[KVSchedulerSide, FakeTransport, Any]]:
    transport = FakeTransport()
    client = LookupClient(transport, PREFIX, runtime=runtime, timeout=30.0)
    parts = _parts("window", "full")
    scheduler = KVSchedulerSide(parts.keys[0], lookup=client, save=True, parts=parts)
    try:
        yield scheduler, transport, runtime
    finally:
        scheduler.close()


def _present(parts: ValueParts, whole: range, window: list[int]) -> set[bytes]:
    whole_keys, window_keys = parts.keys[0], parts.keys[1]
    return {whole_keys.value_key(HASHES[v], 0) for v in whole} | {
        window_keys.value_key(HASHES[v], 0) for v in window
    }


def _hit(side: tuple[KVSchedulerSide, FakeTransport, Any], present: set[bytes], rid: str) -> tuple[int, int]:
    """Ask until answered, each question answered from ``present`` (leading keys present); (hit tokens,
    questions asked)."""
    scheduler, transport, rt = side
    request = SimpleNamespace(request_id=rid, block_hashes=HASHES[:8], num_tokens=8 * BLOCK + 1)
    asked = 0
    while True:
        got, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if got is not None:
            return got, asked
        wait_until(lambda: bool(transport.pending))
        for wid, keys in list(transport.pending.items()):
            count = next((i for i, k in enumerate(keys) if k not in present), len(keys))
            rt.run(transport.answer(wid, count))
        rt.run(noop())
        asked += 1


@pytest.mark.parametrize(
    ("whole", "window", "hit", "asked"),
    [
        (range(8), [6, 7], 8, 2),  # the window at the full prefix was stored
        (range(8), [3, 4, 7], 5, 4),  # 6 missing: no hit of 7 or 8; 5 missing: none of 6; the window at 5
        (range(5), [6, 7], 0, 5),  # the whole part ends at 5, where no window was stored: 4 window questions
        (range(8), [0], 0, 5),  # only the first block's window: a 1-block hit lies past the question cap
        (range(8), [2, 3, 5], 4, 5),  # 7, 6, 4 missing: the window at 4 is the last question allowed
        (range(3), [1, 2], 3, 2),  # a short hit: the window at 3 is blocks 1 and 2
    ],
)
def test_a_hit_covers_the_whole_parts_and_the_window_it_needs(
    side: tuple[KVSchedulerSide, FakeTransport, Any], whole: range, window: list[int], hit: int, asked: int
) -> None:
    scheduler = side[0]
    got, questions = _hit(side, _present(scheduler.parts, whole, window), "r")
    assert got == hit * BLOCK and questions == asked
    assert scheduler.held()["probes"] == 0


class _PlannedRecorder:
    """Stands in for the scheduler's host-tier events: what each planned load names."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, bytes]]] = []

    def planned(self, request: Any, values: list[tuple[int, bytes]]) -> None:
        self.calls.append(list(values))


def test_a_load_writes_the_window_part_only_where_the_hit_needs_it(
    side: tuple[KVSchedulerSide, FakeTransport, Any],
) -> None:
    scheduler = side[0]
    got, _ = _hit(side, _present(scheduler.parts, range(8), [3, 4, 7]), "r")
    assert got == 5 * BLOCK
    request = SimpleNamespace(request_id="r", block_hashes=HASHES[:8], num_tokens=8 * BLOCK + 1)
    # vLLM pads the sliding-window group with the null block below the window at the hit (blocks 0..2)
    window_ids = [NULL_BLOCK_ID] * 3 + [13, 14, 15, 16, 17, 18]
    blocks = SimpleNamespace(get_block_ids=lambda: (window_ids, list(range(20, 29))))
    tiers = _PlannedRecorder()
    scheduler.tier_events = tiers  # type: ignore[assignment]
    scheduler.update_state_after_alloc(request, blocks, 5 * BLOCK)
    scheduler.tier_events = None
    # The host tiers' events name a value by its first part, the whole one here: every value loaded.
    assert tiers.calls == [[(v, HASHES[v]) for v in range(5)]]
    (load,) = scheduler.build_connector_meta(_output()).loads
    assert [(ref.value_hash[0], ref.part) for ref in load.values] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (3, 1),
        (4, 0),
        (4, 1),
    ]
    scheduler.request_finished(request)


def test_saves_store_the_window_part_only_inside_the_window_at_the_cut(
    side: tuple[KVSchedulerSide, FakeTransport, Any],
) -> None:
    scheduler = side[0]
    request = SimpleNamespace(request_id="s", block_hashes=HASHES[:8], num_tokens=8 * BLOCK + 1)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler._hits["s"] = 0  # a miss, without waiting for the lookup
    scheduler.update_state_after_alloc(request, None, 0)
    out = _output()
    window_ids = [1, 2, 3, 4, 5, 6, NULL_BLOCK_ID, 8, 9]  # value 6's window block freed (a stand-in)
    out.scheduled_new_reqs = [
        SimpleNamespace(req_id="s", block_ids=(window_ids, list(range(20, 29))), num_computed_tokens=0)
    ]
    out.num_scheduled_tokens = {"s": 8 * BLOCK + 1}
    out.total_num_scheduled_tokens = 8 * BLOCK + 1
    (save,) = scheduler.build_connector_meta(out).saves
    # every whole part; the window at the cut (6, 7) less value 6, whose block is the null block
    assert [(ref.value_hash[0], ref.part) for ref in save.values] == [*((v, 0) for v in range(8)), (7, 1)]
    scheduler.request_finished(request)


def _output() -> Any:
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[], new_token_ids=[]
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        finished_req_ids=set(),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=1,
    )


def test_a_parts_layout_writes_only_its_layers_whatever_the_other_groups_hold() -> None:
    """A whole part's values land in the full-attention layers at their blocks, batched (the sliding-window
    group's null block is not this layout's concern), and the sliding-window layers are not touched."""
    from asyncconn.vllm.kv.layout import CacheLayout
    from asyncconn.vllm.kv.metadata import ValueRef

    caches = {"g0.l": torch.zeros(8, 2, 4), "g1.l": torch.zeros(8, 2, 4)}
    layout = CacheLayout(caches, ["g1.l"], {"g0.l": 0, "g1.l": 1}, 8, 1)
    values = [torch.full(layout.value_shape, float(i + 1)) for i in range(2)]
    refs = [ValueRef(HASHES[i], (0,), ((NULL_BLOCK_ID,), (3 + i,))) for i in range(2)]
    assert not layout.has_null(refs[0])
    layout.scatter_batch(list(zip(values, refs, strict=True)))
    assert caches["g1.l"][3].eq(1).all() and caches["g1.l"][4].eq(2).all()
    assert not caches["g1.l"][:3].any() and not caches["g1.l"][5:].any()
    assert not caches["g0.l"].any()
    assert [g.tolist() for g in layout.gather(refs)] == [v.tolist() for v in values]
