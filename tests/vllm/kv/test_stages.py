"""Pipeline stages' key spaces learnt from the workers' reports, and the host tiers followed across stages.

Our own logic with hand-made reports (the proof in vLLM's real two-stage engine is
``tests/engine/test_kv_pp_engine.py``): a later stage's key space is the first stage's identity with that
stage's layers, exactly the worker's own derivation; until every stage is known, no value counts as held by
every worker.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.stages import StageSpaces
from asyncconn.vllm.kv.tiernews import TierMirror

FIRST = KVIdentity("m", "", "float16", "default", 16, 2, 8, ("model.layers.0.attn",), 2, 1)
SECOND = replace(FIRST, layers=("model.layers.1.attn",))
HASHES = [bytes([i]) * 32 for i in range(1, 4)]

pytestmark = pytest.mark.interface


def test_a_later_stages_key_space_is_learnt_from_its_layers() -> None:
    first = KeySpace(FIRST, "p/")
    spaces = StageSpaces(first, stages=2)
    assert not spaces.complete
    assert dict(spaces.keys_of(HASHES[:1])) == {first.store_key(HASHES[0], r): HASHES[0] for r in (0, 1)}
    assert not spaces.learn({0: ("other",), 2: ("out of range",)})  # only later stages that exist
    assert spaces.learn({1: SECOND.layers}) and not spaces.learn({1: SECOND.layers})
    assert spaces.complete
    worker = KeySpace(SECOND, "p/")  # what the second stage's worker derives for itself
    keys = dict(spaces.keys_of(HASHES))
    for value_hash in HASHES:
        for rank in (0, 1):
            assert keys[worker.store_key(value_hash, rank)] == value_hash
            assert keys[first.store_key(value_hash, rank)] == value_hash
    assert len(keys) == 2 * 2 * len(HASHES)
    spaces.reset(first)
    assert not spaces.complete


def test_the_host_tiers_count_a_value_only_when_every_stages_every_rank_holds_it() -> None:
    first, second = KeySpace(FIRST), KeySpace(SECOND)
    spaces = StageSpaces(first, stages=2)
    mirror = TierMirror(ValueParts.single(first), 2, 16, spaces)
    value = HASHES[0]
    news = {
        slot: (1, [space.store_key(value, rank)], [])
        for slot, (space, rank) in enumerate([(first, 0), (first, 1), (second, 0), (second, 1)])
    }
    mirror.update(news)
    assert not mirror.everywhere(0, value)  # the second stage's keys are not known yet
    spaces.learn({1: SECOND.layers})
    assert mirror.everywhere(0, value)
    assert mirror.acks() == {0: 1, 1: 1, 2: 1, 3: 1}  # acknowledged per worker slot
    mirror.update({3: (2, [], [second.store_key(value, 1)])})  # the last worker's tier lets it go
    assert not mirror.everywhere(0, value)
    mirror.update({4: (3, [second.store_key(value, 1)], [])})  # no such worker: ignored
    assert not mirror.everywhere(0, value)
