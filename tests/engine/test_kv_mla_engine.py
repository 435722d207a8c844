"""The KV connector on an MLA model (DeepSeek-V2-style latent KV) in vLLM's real engine.

vLLM's CPU build runs MLA here with its reference kernels (chosen explicitly: on a CPU with AMX it would pick
its AMX kernels, which take bf16 weights only): they force block size 16 and turn prefix caching and chunked
prefill off. The connector still gets vLLM's block hashes and
loads whole prefixes; there is just no local prefix cache to read the blocks back from, so the blocks a
request used are recorded from the scheduler's output and read right after the request ends (their
contents stay until they are allocated again; the pool is far larger than the three prompts). Engine 1
computes and saves; a fresh engine 2 loads. Checked against a connector-less reference engine: tokens, and
every latent block of every prompt byte for byte; vLLM counted every full block as an external hit.

With TP=2 (multiprocess workers, read through ``collective_rpc``; ``slow``) both ranks hold the same latent
blocks: rank 0 alone saves them (one value per block in the store), and both ranks of a fresh engine load
that one copy byte-exact.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn_tools.engines import Probe, close_llm, kv_config, make_llm, runner_kv_caches
from tests.engine.kvcase import assert_idle, generate
from tests.engine.ranks import settled

pytestmark = pytest.mark.vllm

MLA_BLOCK = 16  # vLLM's CPU MLA backend overrides the block size to 16
# The reference kernels, also where the CPU has AMX: vLLM picks its AMX MLA backend there by default, which
# takes bf16 weights only (this model is float32) and keeps prefix caching on -- another test.
CPU_MLA = {"attention_backend": "CPU_MLA"}
rng = random.Random(11)
PROMPTS = [[rng.randrange(5, 1000) for _ in range(260)] for _ in range(3)]  # 16 full blocks each
FULL_BLOCKS = len(PROMPTS[0]) // MLA_BLOCK


@pytest.fixture(scope="module")
def mla_model() -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model("mla")


def run_prompts(llm: Any) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """Generate each prompt alone; tokens, and per prompt each layer's latent KV of its full blocks
    (``[FULL_BLOCKS, 16, 576]``), read from the blocks the scheduler gave the request."""
    probe = Probe(llm)
    assert [kind for kind, _ in probe.kv_groups()] == ["MLAAttentionSpec"]
    scheduler = probe.scheduler
    original = scheduler.schedule
    block_ids: dict[tuple[int, ...], list[int]] = {}

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            block_ids[tuple(new.prompt_token_ids)] = list(new.block_ids[0])
        return out

    scheduler.schedule = schedule
    tokens: list[list[int]] = []
    kv: list[dict[str, torch.Tensor]] = []
    try:
        for prompt in PROMPTS:
            tokens += generate(llm, [prompt])
            ids = block_ids[tuple(prompt)][:FULL_BLOCKS]
            assert len(ids) == FULL_BLOCKS
            kv.append({name: cache[ids].clone() for name, cache in probe.kv_caches().items()})
    finally:
        del scheduler.schedule
    return tokens, kv


@pytest.fixture(scope="module")
def mla_reference(mla_model: Path) -> Iterator[dict[str, Any]]:
    llm = make_llm(mla_model, **CPU_MLA)
    try:
        tokens, kv = run_prompts(llm)
        assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the tokens depend on the context
        yield {"tokens": tokens, "kv": kv}
    finally:
        close_llm(llm)


def test_an_mla_models_latent_kv_is_saved_and_loaded_byte_exact(
    mla_model: Path, mla_reference: dict[str, Any], engines: list[Any], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = make_llm(mla_model, kv=kv_config(backend_url=url), **CPU_MLA)
    engines.append(first)
    # one prompt at a time, as the reference ran (a batched prefill on vLLM's CPU MLA kernels gives other
    # tokens)
    assert run_prompts(first)[0] == mla_reference["tokens"]
    probe = Probe(first)
    assert_idle(probe)
    assert probe.kv_worker_connector().worker_side.saver.saved > 0
    close_llm(first)
    engines.remove(first)

    second = make_llm(mla_model, kv=kv_config(backend_url=url), **CPU_MLA)
    engines.append(second)
    probe = Probe(second)
    tokens, kv = run_prompts(second)
    loader = probe.kv_worker_connector().worker_side.loader
    assert loader.loaded > 0 and not loader.failures
    # no local prefix cache: every full block of every prompt came from the store
    assert probe.metrics()["vllm:external_prefix_cache_hits"] >= len(PROMPTS) * FULL_BLOCKS * MLA_BLOCK
    for p, (got, want) in enumerate(zip(kv, mla_reference["kv"], strict=True)):
        assert got.keys() == want.keys()
        for name in got:
            assert got[name].shape == (FULL_BLOCKS, MLA_BLOCK, 576), got[name].shape
            for b in range(FULL_BLOCKS):
                assert torch.equal(got[name][b], want[name][b]), (p, b, name)
    # The first token of each prompt is computed over the loaded latent blocks. Later ones may differ: vLLM's
    # reference CPU MLA kernels compute a prefill on top of cached blocks in another float order than a
    # whole prefill (the reason vLLM turns prefix caching off for MLA on such CPUs), and random weights
    # amplify that; the blocks loaded are byte-equal above.
    assert [t[0] for t in tokens] == [t[0] for t in mla_reference["tokens"]]
    assert_idle(probe)


# -- tensor parallel: every rank holds the same latent KV, the store holds it once --------------------------

TP2 = {**CPU_MLA, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def _rank_latent_blocks(worker: Any, block_ids: list[int]) -> dict[str, torch.Tensor]:
    """In a TP worker process (``collective_rpc``): each layer's latent KV at ``block_ids``."""
    return {name: cache[block_ids].clone() for name, cache in runner_kv_caches(worker.model_runner).items()}


def _rank_connector(worker: Any) -> dict[str, int]:
    """In a TP worker process: the KV connector's rank, save and load totals, and its bookkeeping counts."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    side.poll()
    return {
        "rank": side.rank,
        "saved": side.saver.saved,
        "loaded": side.loader.loaded,
        "load_failures": int(bool(side.loader.failures)),
        "held": sum(side.held().values()),
    }


def run_prompts_tp(llm: Any) -> list[list[dict[str, torch.Tensor]]]:
    """Generate each prompt alone; per prompt, per rank, each layer's latent KV of its full blocks."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in process; the workers are not
    original = scheduler.schedule
    block_ids: dict[tuple[int, ...], list[int]] = {}

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            block_ids[tuple(new.prompt_token_ids)] = list(new.block_ids[0])
        return out

    scheduler.schedule = schedule
    kv: list[list[dict[str, torch.Tensor]]] = []
    try:
        for prompt in PROMPTS:
            generate(llm, [prompt])
            ids = block_ids[tuple(prompt)][:FULL_BLOCKS]
            assert len(ids) == FULL_BLOCKS
            kv.append(llm.collective_rpc(_rank_latent_blocks, args=(ids,)))
    finally:
        del scheduler.schedule
    return kv


@pytest.mark.slow
@pytest.mark.long  # two TP=2 engines, multiprocess: about a minute each to start on two busy cores
@pytest.mark.timeout(600)
def test_tp2_ranks_store_one_latent_copy_and_both_load_it_byte_exact(
    mla_model: Path, engines: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 (vLLM's multiprocess executor, a CPU core per rank): every rank computes the same latent blocks;
    rank 0 alone saves them, so engine 1 leaves one value per block (not one per block and rank), and engine
    2's ranks both load that copy, byte-equal to what engine 1 computed on each rank."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    store = tmp_path / "store"
    url = f"file://{store}"
    first = make_llm(mla_model, kv=kv_config(backend_url=url), **TP2)
    engines.append(first)
    computed = run_prompts_tp(first)
    ranks = settled(first, _rank_connector)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["saved"] for r in ranks] == [len(PROMPTS) * FULL_BLOCKS, 0]  # rank 0 saves, rank 1 does not
    assert [r["held"] for r in ranks] == [0, 0]  # rank 1 reported its (no) saves finished: nothing held
    for per_rank in computed:  # the latent KV is the same on both ranks: one copy serves both
        for name in per_rank[0]:
            assert torch.equal(per_rank[0][name], per_rank[1][name]), name
    close_llm(first)
    engines.remove(first)
    values = [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(values) == len(PROMPTS) * FULL_BLOCKS  # one value per block, not one per block and rank

    second = make_llm(mla_model, kv=kv_config(backend_url=url), **TP2)
    engines.append(second)
    loaded = run_prompts_tp(second)
    ranks = settled(second, _rank_connector)
    assert all(r["loaded"] == len(PROMPTS) * FULL_BLOCKS and not r["load_failures"] for r in ranks), ranks
    assert [r["held"] for r in ranks] == [0, 0]
    for p, (got, want) in enumerate(zip(loaded, computed, strict=True)):
        for rank in (0, 1):
            assert got[rank].keys() == want[0].keys()
            for name in got[rank]:
                assert got[rank][name].shape == (FULL_BLOCKS, MLA_BLOCK, 576)
                assert torch.equal(got[rank][name], want[0][name]), (p, rank, name)
