"""Store names of offloaded chunks: every fact that changes a chunk's bytes changes the namespace, and no
name can be one of the KV connector's keys in a shared store."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from asyncconn.lookup.protocol import store_key
from asyncconn.vllm.tier.names import TierNames, namespace


@dataclasses.dataclass(frozen=True)
class Group:
    tokens_per_block: int = 16
    layer_names: tuple[str, ...] = ("layer.0", "layer.1")
    group_id: int = 0


def config(**changes: Any) -> Any:
    base: dict[str, Any] = {
        "model": SimpleNamespace(name="m", dtype="float16"),
        "cache": SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        "groups": (Group(),),
        "worker_kv_bytes_per_block": 4096,
        "parallel": SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
        "replicated_layout": False,
        "canonical_layout": False,
        "kv_cache_layout": "NHD",
    }
    base.update(changes)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "changes",
    [
        {"model": SimpleNamespace(name="other", dtype="float16")},
        {"model": SimpleNamespace(name="m", dtype="bfloat16")},
        {"cache": SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=2)},
        {"groups": (Group(layer_names=("layer.0",)),)},
        {"worker_kv_bytes_per_block": 8192},
        {"parallel": SimpleNamespace(world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1)},
        {"canonical_layout": True},
        {"kv_cache_layout": "HND"},
    ],
)
def test_every_fact_of_the_bytes_changes_the_namespace(changes: dict[str, Any]) -> None:
    assert namespace(config(**changes), 4096) != namespace(config(), 4096)


def test_the_row_size_changes_the_namespace_and_the_same_facts_do_not() -> None:
    assert namespace(config(), 8192) != namespace(config(), 4096)
    assert namespace(config(), 4096) == namespace(config(), 4096)


def test_a_name_is_never_a_kv_connector_key() -> None:
    block = bytes(range(32)) + (0).to_bytes(4, "big")
    names = TierNames(namespace(config(), 4096), "kv:")
    name = names.name(block)
    assert name.startswith("kv:offload:") and name.endswith(block.hex())
    # the KV connector's keys are key_prefix + hex: no ':' after the prefix, so never one of these
    assert ":" not in store_key("kv:", block)[len("kv:") :]
    assert names.names([block]) == [name]
