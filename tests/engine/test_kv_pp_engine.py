"""The KV connector under pipeline parallelism in vLLM's real engine: two stages (vLLM's multiprocess
executor, a CPU core each), each holding half the layers.

Each stage's worker saves and loads the KV of its own layers under keys of its own: the layers are part of the
key space (``KeySpace``), so one stage never reads another's values. vLLM hands the scheduler the first
stage's KV cache config, so lookups ask for the first stage's keys; a value another stage lacks (lost,
evicted, never written) fails that stage's load, and vLLM recomputes it (``kv_load_failure_policy``):
a miss, never a wrong block.

vLLM 0.32's CPU model runner allocates a later stage's input buffers (``intermediate_tensors``) only in its
warm-up run, which it skips on an eager engine with an explicit KV cache size (ours); the engine then stops at
its first step (an ``AssertionError`` in ``sync_and_gather_intermediate_tensors``, with or without a
connector). :func:`_stage_ready` allocates them as the warm-up would before the engine takes a request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn_tools.engines import BLOCK_SIZE, close_llm, kv_config, make_llm
from tests.engine import routers
from tests.engine.kvcase import FULL_BLOCKS, PROMPTS, cached_by_source, generate
from tests.engine.ranks import block_hashes, run_prompts, settled
from tests.servers import RedisServer

PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
#: The prompts' shared prefix (``shared_prefix_prompts``: 96 tokens) is blocks 0-2; 3 to 5 are each prompt's.
OWN_BLOCKS = range(3, FULL_BLOCKS)
#: Distinct full-block values of the prompts: the shared prefix's once, each prompt's own.
VALUES = len({tuple(p[: (b + 1) * BLOCK_SIZE]) for p in PROMPTS for b in range(FULL_BLOCKS)})


@pytest.fixture(autouse=True)
def _a_core_per_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's worker on a core of its own (``_pp_llm`` needs it)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def _stage_ready(worker: Any) -> int:
    """In a worker process: a later stage's input buffers, as vLLM's warm-up run allocates them (see the
    module docstring); the worker's stage."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
    return int(get_pp_group().rank_in_group)


def _own_keys(block_hashes: list[bytes], stage: int) -> tuple[Any, list[str]] | None:
    """In a worker process: on pipeline stage ``stage`` only, its KV worker side and the store keys of its
    values of ``block_hashes`` past the shared prefix (:data:`OWN_BLOCKS`); None on another stage."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().rank_in_group != stage:
        return None
    side = get_kv_transfer_group().worker_side
    values = side.keys.value_hashes(block_hashes)  # one value per block (kv_blocks_per_value=1)
    return side, side.keys.store_keys([values[b] for b in OWN_BLOCKS], 0)


def _drop_own_values(worker: Any, block_hashes: list[bytes], stage: int) -> int:
    """In a worker process: on stage ``stage`` only, delete its own values (:func:`_own_keys`) from the
    store; how many were there."""
    own = _own_keys(block_hashes, stage)
    if own is None:
        return 0
    side, keys = own
    return int(side.runtime.run(side.store.delete(keys), timeout=30.0))


def _tier_figures(worker: Any) -> dict[str, int]:
    """In a worker process: its stage, and the values its host tier holds and served."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group

    side = get_kv_transfer_group().worker_side
    side.poll()
    tier = side.store.host_tier
    return {
        "stage": get_pp_group().rank_in_group,
        "values": len(tier.lru),
        "hits": tier.stats.hits,
        "held": sum(side.held().values()),
    }


def _remove_own_values(worker: Any, block_hashes: list[bytes], stage: int) -> int:
    """In a worker process: on stage ``stage`` only, delete its own values from the store and report them
    removed, as a store's removal hook does (its keys are that stage's own); how many were there."""
    removed = _drop_own_values(worker, block_hashes, stage)
    own = _own_keys(block_hashes, stage)
    if own is not None:
        own[0].report_removed(own[1])
    return removed


def _pp_llm(model: Path, url: str, kv: dict[str, Any] | None = None, **extra: Any) -> Any:
    """A two-stage engine on ``url``, ready for requests (needs ``VLLM_CPU_OMP_THREADS_BIND`` set)."""
    from vllm import envs

    # vLLM caches its environment once an engine has started (an earlier test's): read it afresh, so the
    # workers get a core each.
    envs.disable_envs_cache()
    llm = make_llm(model, kv=kv_config(backend_url=url, **(kv or {})), **PP2, **extra)
    assert llm.collective_rpc(_stage_ready) == [0, 1]
    return llm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_each_stage_saves_and_loads_its_own_layers_and_a_stage_missing_a_value_recomputes_it(
    text_model: Path,
    kv_reference: dict[str, Any],
    engines: list[Any],
    tmp_path: Path,
) -> None:
    """Engine 1 (two stages) computes and saves: each stage every value of its own layers, and vLLM's KV
    events publish every value as stored (both stages' reports reach the scheduler). Then the second
    stage's copies of prompt 0's own values are deleted. A fresh engine 2 (two stages) loads: the first stage
    every value, the second every value but those three, whose loads fail; vLLM recomputes them. Every
    block each stage holds afterwards, prompt 0's included, is byte-equal to engine 1's, and tokens equal a
    one-stage connector-less engine's."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    url = f"file://{tmp_path / 'store'}"
    values = VALUES

    events_config, _, replay_port = routers.events_config()
    first = _pp_llm(text_model, url, kv_events_config=events_config)
    engines.append(first)
    tokens, computed = run_prompts(first, PROMPTS)
    assert tokens == kv_reference["tokens"]
    stages = settled(first)
    assert [s["stage"] for s in stages] == [0, 1] and [s["rank"] for s in stages] == [0, 0]
    assert all(s["saved"] == values and s["held"] == 0 for s in stages), stages
    layers = [set(computed[0]["ranks"][w]) for w in (0, 1)]
    assert layers[0] and layers[1] and not layers[0] & layers[1]  # each stage holds its own layers
    assert layers[0] | layers[1] == set(kv_reference["kv"][0][0])  # and together the model's
    published = routers.residency(routers.replayed_batches(replay_port))[("STORAGE", "asyncconn:file")]
    full = {maybe_convert_block_hash(h) for p in PROMPTS for h in block_hashes(first, p)[:FULL_BLOCKS]}
    assert len(full) == values and published == full
    hashes = [bytes(h) for h in block_hashes(first, PROMPTS[0])]
    assert first.collective_rpc(_drop_own_values, args=(hashes, 1)) == [0, len(OWN_BLOCKS)]
    close_llm(first)
    engines.remove(first)

    second = _pp_llm(text_model, url)
    engines.append(second)
    tokens, loaded = run_prompts(second, PROMPTS)
    assert tokens == kv_reference["tokens"]
    stages = settled(second)
    assert stages[0]["loaded"] == values and not stages[0]["load_failures"], stages
    # The second stage: the three values it lacks failed, and were not loaded (recomputed instead)
    assert stages[1]["loaded"] == values - len(OWN_BLOCKS), stages
    assert stages[1]["load_failures"] == len(OWN_BLOCKS), stages
    assert all(s["held"] == 0 and not s["null_written"] for s in stages), stages
    for p, (got, want) in enumerate(zip(loaded, computed, strict=True)):
        for worker in (0, 1):
            for name, rows in got["ranks"][worker].items():
                assert got["held"][name] == list(range(FULL_BLOCKS)), (p, name)
                assert torch.equal(rows, want["ranks"][worker][name]), (p, worker, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_every_stages_host_tier_is_followed_and_a_later_stages_removals_are_heard(
    text_model: Path,
    kv_reference: dict[str, Any],
    engines: list[Any],
    tmp_path: Path,
) -> None:
    """Two stages, each worker with a host tier, KV events on. The scheduler learns the second stage's keys
    from its workers' reports (its layers), so:

    - the tiers' residency (``CPU``, ``asyncconn:host``) is published once both stages' tiers hold a value:
      a router replaying the events holds every value of the prompts;
    - run again after vLLM's own cache is reset, the prompts are served from both stages' tiers, and vLLM
      counts every loaded token as ``host``; the text is unchanged;
    - values the second stage's store removals name (its own keys) leave the store's residency.
    """
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    url = f"file://{tmp_path / 'store'}"
    values = VALUES
    events_config, _, replay_port = routers.events_config()
    llm = _pp_llm(text_model, url, kv={"host_cache_bytes": "64MiB"}, kv_events_config=events_config)
    engines.append(llm)
    tokens, _ = run_prompts(llm, PROMPTS)
    assert tokens == kv_reference["tokens"]
    tiers = settled(llm, _tier_figures)
    assert [t["stage"] for t in tiers] == [0, 1]
    assert all(t["values"] == values and t["held"] == 0 for t in tiers), tiers
    full = {maybe_convert_block_hash(h) for p in PROMPTS for h in block_hashes(llm, p)[:FULL_BLOCKS]}
    held = routers.residency(routers.replayed_batches(replay_port))
    assert held[("CPU", "asyncconn:host")] == full and held[("STORAGE", "asyncconn:file")] == full

    assert llm.reset_prefix_cache()
    tokens, _ = run_prompts(llm, PROMPTS)
    assert tokens == kv_reference["tokens"]
    tiers = settled(llm, _tier_figures)
    assert all(t["hits"] == values and t["held"] == 0 for t in tiers), tiers  # both stages' tiers served
    assert cached_by_source(llm) == {"host": values * BLOCK_SIZE}

    hashes = [bytes(h) for h in block_hashes(llm, PROMPTS[0])]
    assert llm.collective_rpc(_remove_own_values, args=(hashes, 1)) == [0, len(OWN_BLOCKS)]
    generate(llm, [PROMPTS[1][::-1]])  # a step: the second stage's report reaches the scheduler
    settled(llm)
    gone = {maybe_convert_block_hash(hashes[b]) for b in OWN_BLOCKS}
    held = routers.residency(routers.replayed_batches(replay_port))
    assert held[("STORAGE", "asyncconn:file")] & full == full - gone


def _drop_local_copies(worker: Any, block_hashes: list[bytes], stage: int) -> int:
    """In a worker process: on stage ``stage`` only, delete its own values' copies from this host's local
    store (not the shared one); how many were there."""
    own = _own_keys(block_hashes, stage)
    if own is None:
        return 0
    side, keys = own
    return int(side.runtime.run(side.store.layered.local.delete(keys), timeout=30.0))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_a_value_counts_as_disk_only_when_every_stage_holds_it_locally(
    text_model: Path,
    kv_reference: dict[str, Any],
    engines: list[Any],
    tmp_path: Path,
    fresh_redis: RedisServer,
) -> None:
    """Two stages over ``redis://`` with a local directory in front (``local_store_url``): the scheduler
    asks the directory for every stage's keys (the second stage's learnt from its workers' reports). A pass
    after vLLM's own cache is reset loads every value from the directory, all counted as ``disk``; with the
    second stage's local copies of three values deleted, the next pass counts those three under redis's
    source (``external_unspecified``) -- the second stage read them from redis -- and the rest as ``disk``."""
    values = VALUES
    llm = _pp_llm(text_model, fresh_redis.url, kv={"local_store_url": f"file://{tmp_path / 'local'}"})
    engines.append(llm)
    run_prompts(llm, PROMPTS)
    settled(llm)

    def one_pass() -> dict[str, float]:
        before = cached_by_source(llm)
        assert llm.reset_prefix_cache()
        tokens, _ = run_prompts(llm, PROMPTS)
        assert tokens == kv_reference["tokens"]
        settled(llm)
        return {k: v - before.get(k, 0) for k, v in cached_by_source(llm).items() if v - before.get(k, 0)}

    assert one_pass() == {"disk": values * BLOCK_SIZE}
    hashes = [bytes(h) for h in block_hashes(llm, PROMPTS[0])]
    assert llm.collective_rpc(_drop_local_copies, args=(hashes, 1)) == [0, len(OWN_BLOCKS)]
    own = len(OWN_BLOCKS) * BLOCK_SIZE
    assert one_pass() == {"disk": values * BLOCK_SIZE - own, "external_unspecified": own}
