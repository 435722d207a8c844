"""Key derivation and connector stats: fast unit tests of our own logic (no engine)."""

from __future__ import annotations

import concurrent.futures
import hashlib
from dataclasses import replace

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.exceptions import ConfigError
from asyncconn.lookup import store_key
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.metadata import AsyncConnKVStats, bucket

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

BASE = KVIdentity(
    model="/m/opt",
    revision="",
    dtype="float16",
    layout="default",
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    layers=("l0", "l1"),
    tp_size=2,
    blocks_per_value=1,
)
HASHES = [bytes([i]) * 32 for i in range(8)]


def test_every_incompatibility_changes_the_key() -> None:
    ref = KeySpace(BASE).value_key(HASHES[0], 0)
    variants = [
        replace(BASE, model="/m/other"),
        replace(BASE, revision="v2"),
        replace(BASE, dtype="bfloat16"),
        replace(BASE, layout="HND"),
        replace(BASE, block_size=32),
        replace(BASE, num_kv_heads=4),
        replace(BASE, head_size=64),
        replace(BASE, layers=("l0",)),
        replace(BASE, tp_size=4),
        replace(BASE, blocks_per_value=2),
    ]
    keys = {KeySpace(v).value_key(HASHES[0], 0) for v in variants}
    assert ref not in keys and len(keys) == len(variants)
    assert KeySpace(BASE).value_key(HASHES[0], 1) != ref
    assert KeySpace(BASE).value_key(HASHES[1], 0) != ref
    assert KeySpace(BASE).value_key(HASHES[0], 0) == ref  # deterministic across instances


def test_store_key_is_the_lookup_clients_name() -> None:
    space = KeySpace(BASE, key_prefix="kv:")
    key = space.value_key(HASHES[2], 1)
    assert space.store_key(HASHES[2], 1) == store_key("kv:", key) == "kv:" + key.hex()


def test_store_keys_are_store_key_of_each_hash_and_the_key_format_is_unchanged() -> None:
    space = KeySpace(BASE, key_prefix="kv:")
    for rank in (0, 1):
        assert space.store_keys(HASHES, rank) == [space.store_key(h, rank) for h in HASHES]
    # the derivation written out (the pre-seeded hashers must not change a key that stores already hold)
    h = hashlib.blake2b(space.namespace, digest_size=16)
    h.update((1).to_bytes(4, "little"))
    h.update(HASHES[3])
    assert space.value_key(HASHES[3], 1) == h.digest()
    assert space.store_keys([], 0) == []
    name = space.namer(1)  # what the save tracker's copy thread calls: the same names
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(name, HASHES)) == [space.store_key(h, 1) for h in HASHES]
    with pytest.raises(ConfigError, match="rank"):
        space.namer(2)
    with pytest.raises(ConfigError, match="rank"):
        space.store_keys(HASHES, 2)
    with pytest.raises(ConfigError, match="rank"):
        space.value_key(HASHES[0], -1)


def test_values_and_lookup_keys_order() -> None:
    space = KeySpace(replace(BASE, blocks_per_value=3))
    assert space.value_hashes(HASHES) == [HASHES[2], HASHES[5]]  # a value is named by its last block
    assert space.tokens_per_value == 48
    keys = KeySpace(BASE).lookup_keys(HASHES[:2])
    assert keys == [
        KeySpace(BASE).value_key(HASHES[0], 0),
        KeySpace(BASE).value_key(HASHES[0], 1),
        KeySpace(BASE).value_key(HASHES[1], 0),
        KeySpace(BASE).value_key(HASHES[1], 1),
    ]


def test_bad_rank_and_identity_rejected() -> None:
    with pytest.raises(ConfigError, match="rank 2"):
        KeySpace(BASE).value_key(HASHES[0], 2)
    with pytest.raises(ConfigError):
        KeySpace(replace(BASE, blocks_per_value=0))


def test_stats_aggregate_and_reduce() -> None:
    a, b = AsyncConnKVStats(), AsyncConnKVStats()
    assert a.is_empty()
    a.add("loads", 3)
    a.observe("load_latency", 0.004)
    b.add("loads", 2)
    b.add("bytes_saved", 100)
    b.observe("load_latency", 0.2)
    merged = a.aggregate(b)
    out = merged.reduce()
    assert out["loads"] == 5 and out["bytes_saved"] == 100
    assert out["load_latency_p50_ms"] == 5.0 and out["load_latency_p99_ms"] == 250.0
    assert not merged.is_empty()
    rebuilt = AsyncConnKVStats(dict(merged.data))
    assert rebuilt.reduce() == out
    assert bucket(0.0) == 0 and bucket(1e9) == 15


def test_layer_layout_detection() -> None:
    import torch

    from asyncconn.vllm.kv.layout import LayerLayout

    first = LayerLayout.detect(
        {"a": torch.zeros(10, 2, 16, 8), "b": torch.zeros(10, 2, 16, 8)}, ["a", "b"], 10
    )
    assert first.block_dim == 0 and first.value_shape(2, 4) == (2, 4, 2, 16, 8)
    kv_first = LayerLayout.detect({"a": torch.zeros(2, 10, 16, 2, 4)}, ["a"], 10)
    assert kv_first.block_dim == 1 and kv_first.value_shape(1, 1) == (1, 2, 1, 16, 2, 4)
    with pytest.raises(ConfigError, match="must match"):
        LayerLayout.detect({"a": torch.zeros(10, 2), "b": torch.zeros(10, 3)}, ["a", "b"], 10)
    with pytest.raises(ConfigError, match="not registered"):
        LayerLayout.detect({"a": torch.zeros(10, 2)}, ["a", "b"], 10)
    with pytest.raises(ConfigError, match="no block dimension"):
        LayerLayout.detect({"a": torch.zeros(3, 4, 10)}, ["a"], 10)


def test_example_config_is_accepted_by_vllm_and_settings() -> None:
    import json
    from pathlib import Path

    from vllm.config import KVTransferConfig

    from asyncconn.config import Settings

    data = json.loads((Path(__file__).resolve().parents[3] / "examples" / "vllm_kv_offload.json").read_text())
    config = KVTransferConfig(**data)
    assert config.kv_connector == "AsyncConnKVConnector" and config.is_kv_producer and config.is_kv_consumer
    settings = Settings.from_extra_config(config.kv_connector_extra_config)
    assert settings.backend_url.startswith("redis://") and settings.kv_blocks_per_value >= 1
    with pytest.raises(ConfigError, match="kv_blocks_per_valu"):
        Settings.from_extra_config({"kv_blocks_per_valu": 2})


def test_replicated_kv_has_one_key_per_value_for_every_rank_saved_by_rank_0() -> None:
    """MLA (every rank holds the same latent KV): every rank names a value with rank 0's key, only rank 0
    saves, a lookup asks one key per value. The flag is not part of the namespace: rank 0's keys, and every
    key of a model whose ranks hold other heads, are what earlier builds wrote (namespaces pinned)."""
    mla = replace(BASE, num_kv_heads=1, head_size=576)
    shared, per_rank = KeySpace(replace(mla, replicated=True)), KeySpace(mla)
    assert KeySpace(BASE).namespace.hex() == "75f0121d8ce7644c9e920cdb3b805762"
    assert shared.namespace == per_rank.namespace
    assert per_rank.namespace.hex() == "55f4aaa57e5dc3ee7b93ef0f66303ed8"
    for rank in (0, 1):
        assert shared.value_key(HASHES[0], rank) == per_rank.value_key(HASHES[0], 0)
        assert shared.store_keys(HASHES[:3], rank) == per_rank.store_keys(HASHES[:3], 0)
        assert shared.namer(rank)(HASHES[4]) == per_rank.store_key(HASHES[4], 0)
    assert per_rank.value_key(HASHES[0], 1) != per_rank.value_key(HASHES[0], 0)
    assert (shared.keys_per_value, per_rank.keys_per_value) == (1, 2)
    assert shared.lookup_keys(HASHES[:2]) == [per_rank.value_key(h, 0) for h in HASHES[:2]]
    assert [shared.saves_on(r) for r in (0, 1)] == [True, False]
    assert [per_rank.saves_on(r) for r in (0, 1)] == [True, True]
    with pytest.raises(ConfigError, match="rank 2"):
        shared.value_key(HASHES[0], 2)


def test_identity_is_replicated_only_when_every_group_is_mla() -> None:
    from types import SimpleNamespace

    import torch
    from vllm.v1 import kv_cache_interface as specs

    def identity(*kinds: type) -> KVIdentity:
        common = {"block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
        groups = [
            SimpleNamespace(kv_cache_spec=kind(**common), layer_names=[f"g{i}.l"])
            for i, kind in enumerate(kinds)
        ]
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="/m/ds", revision=None), cache_config=SimpleNamespace()
        )
        return KVIdentity.from_vllm(
            vllm_config, SimpleNamespace(kv_cache_groups=groups), tp_size=2, blocks_per_value=1
        )

    assert identity(specs.MLAAttentionSpec).replicated
    assert identity(specs.MLAAttentionSpec, specs.MLAAttentionSpec).replicated
    assert not identity(specs.FullAttentionSpec).replicated  # each rank holds other heads
    assert not identity(specs.MLAAttentionSpec, specs.FullAttentionSpec).replicated  # a value holds both
