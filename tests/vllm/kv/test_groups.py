"""Which KV cache groups the KV connector accepts, and what it says about the others (vLLM's real specs)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncconn.exceptions import ConfigError
from asyncconn.vllm.kv.groups import NULL_BLOCK_ID, check_groups, check_sync_loads, has_null, real_blocks

pytestmark = pytest.mark.interface  # vLLM's spec classes only: scripts/lane-vllm033.sh runs it on 0.33 too


def _kv_config(*specs: Any) -> Any:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"g{i}.l"]) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=8)


def _attention(kind: str, block_size: int = 16) -> Any:
    from vllm.v1 import kv_cache_interface as specs

    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    if kind == "full":
        return specs.FullAttentionSpec(**common)
    if kind == "window":
        return specs.SlidingWindowSpec(**common, sliding_window=64)
    return specs.ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)


def test_full_attention_groups_are_whole() -> None:
    layout = check_groups(_kv_config(_attention("full"), _attention("full")))
    assert layout.layers == ["g0.l", "g1.l"] and layout.group_of_layer == {"g0.l": 0, "g1.l": 1}
    assert not layout.windowed


@pytest.mark.parametrize("kind", ["window", "chunked"])
def test_windowed_groups_beside_full_attention_are_accepted(kind: str) -> None:
    layout = check_groups(_kv_config(_attention(kind), _attention("full"), _attention(kind)))
    assert layout.layers == ["g0.l", "g1.l", "g2.l"] and layout.windowed


def test_mamba_groups_are_refused_saying_what_to_do() -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(torch.float16,))
    with pytest.raises(ConfigError) as caught:
        check_groups(_kv_config(_attention("full"), mamba))
    message = str(caught.value)
    assert "MambaSpec" in message and "recurrent state" in message
    assert "without a KV connector" in message


def test_groups_of_different_block_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="block sizes"):
        check_groups(_kv_config(_attention("full"), _attention("full", block_size=32)))
    with pytest.raises(ConfigError):
        check_groups(None)


def test_null_blocks() -> None:
    assert NULL_BLOCK_ID == 0
    assert has_null(((3, 4), (0, 5))) and not has_null(((3, 4), (6, 5)))
    assert real_blocks(((3, 4), (0, 5))) == {3, 4, 5}


def test_only_models_whose_groups_are_all_mla_are_replicated() -> None:
    from vllm.v1 import kv_cache_interface as specs

    from asyncconn.vllm.kv.groups import replicated

    mla = specs.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert replicated(_kv_config(mla).kv_cache_groups)
    assert replicated(_kv_config(mla, mla).kv_cache_groups)
    assert not replicated(_kv_config(_attention("full")).kv_cache_groups)
    assert not replicated(_kv_config(mla, _attention("window")).kv_cache_groups)
    assert not replicated([])


def test_sync_loads_are_refused_with_several_groups_saying_why_and_what_to_do() -> None:
    """vLLM 0.32 cannot be told that a sync load failed when block ids are per group."""
    single = check_groups(_kv_config(_attention("full")))
    assert single.num_groups == 1
    check_sync_loads(single, True)
    hybrid = check_groups(_kv_config(_attention("window"), _attention("full")))
    assert hybrid.num_groups == 2
    check_sync_loads(hybrid, False)
    with pytest.raises(ConfigError, match="kv_sync_loads") as info:
        check_sync_loads(hybrid, True)
    assert "2 KV cache groups" in str(info.value) and "--disable-hybrid-kv-cache-manager" in str(info.value)
    # two full-attention groups (different layer shapes) share block ids across groups just the same
    with pytest.raises(ConfigError, match="kv_sync_loads"):
        check_sync_loads(check_groups(_kv_config(_attention("full"), _attention("full"))), True)
