"""The KV connector on hybrid models in vLLM's real engine, with vLLM's hybrid KV cache manager on.

Two families, each with 64-token sliding windows (2 blocks): a tiny Gemma-3-style model (three
sliding-window layers and one full-attention layer: four one-layer groups) and a tiny Gemma-2-style one
(sliding-window and full-attention layers alternating, soft-capped attention: two two-layer groups). vLLM
gives each layer kind its own KV cache groups from one block pool, frees a sliding-window group's blocks once
they leave the window, and puts its null block in their place. Engine 1 computes and saves; a fresh engine 2
loads. Checked byte for byte against a connector-less reference engine: every full-attention block, and
every sliding-window block engine 2 holds (those inside the window at the cut, which is what the next token
reads); engine 2 holds every such block, and vLLM counted the whole hit as external.

A failed load (a corrupt value; one deleted after the lookup found it) is reported to vLLM per request
(``failed_recving``), never as block ids, which vLLM 0.32 answers with a RuntimeError that stops the engine
on these models: the prompt is recomputed (``recompute``) or fails alone (``fail``). ``kv_sync_loads`` is
refused at start-up (a failed sync load has no report there).

Also with the Gemma-2-style model: requests preempted under a small KV cache resume with the connector
(vLLM counted preemptions; a resumed request loads blocks it saved before its preemption; tokens equal a
reference engine's under the same cache; with batches large enough that vLLM 0.32 reserves a parked load's
sliding-window block, which it does not with small ones: its scheduler then hangs at times, see the case)
-- and TP=2 (marker ``long``): each rank saves and loads its own heads' blocks, byte-equal to what that rank
computed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import assert_idle, generate, sampling
from tests.engine.ranks import run_prompts, settled

pytestmark = pytest.mark.vllm

WINDOW_BLOCKS = 2  # the models' 64-token window in 32-token blocks
rng = random.Random(7)
HEAD = [rng.randrange(5, 1000) for _ in range(160)]
PROMPTS = [HEAD + [rng.randrange(5, 1000) for _ in range(100)] for _ in range(3)]  # 8 full blocks each
FULL_BLOCKS = len(PROMPTS[0]) // BLOCK_SIZE
#: Prompts of the cut tests (``test_the_window_is_stored_only_at_the_cut...``): SHORT stops after the head's
#: 5 blocks (its window, blocks 3 and 4, is stored); OTHER shares nothing with the others; FALLBACK shares 6
#: blocks with PROMPTS[0], whose window at 6 (blocks 4, 5) nobody stored, but the window at 5 SHORT did;
#: ZERO shares 3 blocks with OTHER, and no window inside them was stored.
SHORT = HEAD + [rng.randrange(5, 1000) for _ in range(10)]
OTHER = [rng.randrange(5, 1000) for _ in range(260)]
FALLBACK = PROMPTS[0][:200] + [rng.randrange(5, 1000) for _ in range(60)]
ZERO = OTHER[:100] + [rng.randrange(5, 1000) for _ in range(160)]
EXTRA = [FALLBACK, ZERO]
#: The Gemma-2-style model's expected groups: one per layer kind, its two layers each.
GEMMA2_GROUPS = [
    ("SlidingWindowSpec", ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]),
    ("FullAttentionSpec", ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]),
]


@pytest.fixture(scope="module", params=["hybrid", "hybrid-gemma2"])
def hybrid_model(request: pytest.FixtureRequest) -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model(request.param)


@pytest.fixture(scope="module")
def gemma2_model() -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model("hybrid-gemma2")


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_model: Path) -> Iterator[dict[str, Any]]:
    llm = make_llm(hybrid_model)
    try:
        probe = Probe(llm)
        kinds = {kind for kind, _ in probe.kv_groups()}
        assert kinds == {"SlidingWindowSpec", "FullAttentionSpec"}, kinds  # the hybrid manager is on
        if hybrid_model.name.startswith("hybrid-gemma2"):
            assert probe.kv_groups() == GEMMA2_GROUPS
        tokens = generate(llm, PROMPTS)
        assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the tokens depend on the context
        kv = [probe.prompt_kv_by_group(p) for p in PROMPTS]
        extra_tokens = []
        extra_kv = []
        for prompt in EXTRA:
            extra_tokens += generate(llm, [prompt])
            extra_kv.append(probe.prompt_kv_by_group(prompt))
        yield {
            "tokens": tokens,
            "kv": kv,
            "groups": probe.kv_groups(),
            "extra_tokens": extra_tokens,
            "extra_kv": extra_kv,
        }
    finally:
        close_llm(llm)


def test_a_hybrid_models_kv_is_saved_and_loaded_byte_exact(
    hybrid_model: Path, hybrid_reference: dict[str, Any], engines: list[Any], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(first)
    assert generate(first, PROMPTS) == hybrid_reference["tokens"]
    assert_idle(Probe(first))
    close_llm(first)
    engines.remove(first)

    second = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(second)
    probe = Probe(second)
    worker = probe.kv_worker_connector().worker_side
    assert worker.windowed
    for prompt, want_tokens in zip(PROMPTS, hybrid_reference["tokens"], strict=True):
        assert generate(second, [prompt]) == [want_tokens]  # one at a time: each loads its own prefix
    assert worker.loader.loaded > 0 and not worker.loader.failures
    metrics = probe.metrics()
    # Prompt 1 loads all its full blocks; prompts 2 and 3 hit the shared head locally where vLLM kept it.
    assert metrics["vllm:external_prefix_cache_hits"] >= FULL_BLOCKS * BLOCK_SIZE

    full_layers = [
        n for kind, names in hybrid_reference["groups"] for n in names if kind == "FullAttentionSpec"
    ]
    window_layers = [
        n for kind, names in hybrid_reference["groups"] for n in names if kind != "FullAttentionSpec"
    ]
    for prompt, want in zip(PROMPTS, hybrid_reference["kv"], strict=True):
        got = probe.prompt_kv_by_group(prompt)
        for b in range(FULL_BLOCKS):
            for name in full_layers:
                g, w = got[b][name], want[b][name]
                assert g is not None and w is not None and torch.equal(g, w), (b, name)
            for name in window_layers:
                g, w = got[b][name], want[b][name]
                if g is not None:  # a window block engine 2 holds: what the reference computed
                    assert w is not None and torch.equal(g, w), (b, name)
        # the blocks the next token reads through the window are there, loaded or computed
        for b in range(FULL_BLOCKS - WINDOW_BLOCKS, FULL_BLOCKS):
            assert all(got[b][name] is not None for name in window_layers), b
    # vLLM's null block (block 0: the sliding-window groups' positions outside the window) never written
    assert all(not cache[0].any() for cache in probe.kv_caches().values())
    assert_idle(probe)


def _window_first_block(cut: int) -> int:
    """The first block the sliding-window layers read at a cut of ``cut`` blocks (vLLM's rule, written out
    for the 64-token window: tokens before ``cut * 32 - 64 + 1`` are skipped)."""
    return max(0, cut * BLOCK_SIZE - 64 + 1) // BLOCK_SIZE


def test_the_window_is_stored_only_at_the_cut_and_a_shorter_prefix_hits_only_where_its_window_is(
    hybrid_model: Path,
    hybrid_reference: dict[str, Any],
    engines: list[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine 1 saves SHORT, then PROMPTS and OTHER: the store holds every prefix block's full-attention
    layers, and the sliding-window layers only of the blocks inside the window at each prompt's cut -- no
    other key. A fresh engine 2 then serves FALLBACK, whose shared prefix (6 blocks) ends where no window
    was stored: it hits the 5 blocks whose window SHORT stored, and computes the rest; and ZERO, whose
    shared prefix holds no stored window: no hit. Tokens and KV equal a connector-less engine's."""
    from urllib.parse import quote

    store = tmp_path / "store"
    url = f"file://{store}"
    first = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(first)
    probe = Probe(first)
    generate(first, [SHORT])  # alone: the others then find the head in vLLM's prefix cache
    generate(first, [*PROMPTS, OTHER])
    assert_idle(probe)
    parts = probe.kv_worker_connector().worker_side.parts
    assert parts.split and parts.whole == 0 and parts.window == 1
    whole, window = set(), set()
    for prompt in (SHORT, *PROMPTS, OTHER):
        hashes = probe.block_hashes(prompt)
        cut = len(prompt) // BLOCK_SIZE
        whole |= {parts.keys[0].store_key(bytes(hashes[b]), 0) for b in range(cut)}
        window |= {parts.keys[1].store_key(bytes(hashes[b]), 0) for b in range(_window_first_block(cut), cut)}
    assert len(window) == 2 * 5  # SHORT's blocks 3 and 4, and blocks 6 and 7 of the four others
    names = {p.name for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert names == {quote(k, safe="") for k in whole | window}
    close_llm(first)
    engines.remove(first)

    second = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(second)
    probe = Probe(second)
    connector = probe.kv_scheduler_connector()
    lookup = connector.get_num_new_matched_tokens
    answers: dict[int, list[int | None]] = {}  # prompt length -> what each call answered

    def recorded(request: Any, num_computed_tokens: int) -> Any:
        hit, is_async = lookup(request, num_computed_tokens)
        answers.setdefault(request.num_prompt_tokens, []).append(hit)
        return hit, is_async

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", recorded)
    (want_fallback, want_zero) = hybrid_reference["extra_tokens"]
    assert generate(second, [FALLBACK]) == [want_fallback]
    assert probe.metrics()["vllm:external_prefix_cache_hits"] == 5 * BLOCK_SIZE
    got = probe.prompt_kv_by_group(FALLBACK)
    want = hybrid_reference["extra_kv"][0]
    full_layers = {
        n for kind, names in hybrid_reference["groups"] for n in names if kind == "FullAttentionSpec"
    }
    for b in range(FULL_BLOCKS):
        for name in got[b]:
            g, w = got[b][name], want[b][name]
            if name in full_layers or g is not None:  # full attention: every block; sliding window: held
                assert g is not None and w is not None and torch.equal(g, w), (b, name)
        if b >= FULL_BLOCKS - WINDOW_BLOCKS:  # the window the next token reads is there
            assert all(got[b][name] is not None for name in got[b]), b
    assert generate(second, [ZERO]) == [want_zero]
    assert answers[len(ZERO)][0] is None and answers[len(ZERO)][-1] == 0  # asked the store: no usable hit
    assert probe.metrics()["vllm:external_prefix_cache_hits"] == 5 * BLOCK_SIZE
    assert all(not cache[0].any() for cache in probe.kv_caches().values())
    assert_idle(probe)


# -- load failures: reported per request, never as block ids -----------------------------------------------


@pytest.mark.parametrize(
    ("fault", "policy"),
    [("corrupt", "recompute"), ("deleted", "recompute"), ("corrupt", "fail")],
    ids=["corrupt", "deleted-after-lookup", "corrupt-policy-fail"],
)
def test_a_failed_load_on_a_hybrid_model_is_reported_per_request_not_as_block_ids(
    hybrid_model: Path,
    hybrid_reference: dict[str, Any],
    engines: list[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    policy: str,
) -> None:
    """Engine 1 saves; one value PROMPTS[0] loads (its third block's full-attention part) is then damaged:
    one bit flipped, or deleted after the lookup found it (as an eviction or a TTL would). vLLM 0.32 stops
    its engine with a RuntimeError when a connector reports block ids on a model with several KV cache
    groups; a fresh engine 2 instead gets the request in ``failed_recving`` (and no block id). With
    ``kv_load_failure_policy: recompute`` it computes the prompt: tokens and full-attention KV equal a
    connector-less engine's; with ``fail`` the request ends with an error. Either way the engine serves the
    other prompts afterwards, and the connector holds nothing at the end."""
    from urllib.parse import quote

    store = tmp_path / "store"
    url = f"file://{store}"
    first = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(first)
    probe = Probe(first)
    generate(first, [PROMPTS[0]])
    assert_idle(probe)
    whole = probe.kv_worker_connector().worker_side.parts.keys[0]
    key = whole.store_key(bytes(probe.block_hashes(PROMPTS[0])[2]), 0)
    close_llm(first)
    engines.remove(first)
    (path,) = store.rglob(quote(key, safe=""))
    if fault == "corrupt":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01  # one bit of the payload
        path.write_bytes(bytes(data))

    kv = kv_config(backend_url=url)
    kv.kv_load_failure_policy = policy
    second = make_llm(hybrid_model, kv=kv)
    engines.append(second)
    probe = Probe(second)
    connector = probe.kv_worker_connector()
    worker = connector.worker_side
    failed: set[str] = set()
    invalid: set[int] = set()
    results, errors = connector.get_transfer_results, connector.get_block_ids_with_load_errors

    def recorded_results(finished: set[str]) -> Any:
        out = results(finished)
        failed.update(out.failed_recving)
        assert out.failed_recving <= out.finished_recving  # vLLM's rule: a failed receive is a finished one
        return out

    def recorded_errors() -> set[int]:
        out = errors()
        invalid.update(out)
        return out

    monkeypatch.setattr(connector, "get_transfer_results", recorded_results)
    monkeypatch.setattr(connector, "get_block_ids_with_load_errors", recorded_errors)
    if fault == "deleted":
        issue = worker.issue_loads

        def issue_after_deleting(meta: Any) -> Any:
            if meta.loads and path.exists():
                path.unlink()  # the lookup found it; the read will not
            return issue(meta)

        monkeypatch.setattr(worker, "issue_loads", issue_after_deleting)

    (out,) = second.generate([{"prompt_token_ids": PROMPTS[0]}], sampling())
    assert worker.loader.failures, "no load failed"
    assert len(failed) == 1 and not invalid, (failed, invalid)
    if policy == "recompute":
        assert list(out.outputs[0].token_ids) == hybrid_reference["tokens"][0]
        got = probe.prompt_kv_by_group(PROMPTS[0])
        for b in range(FULL_BLOCKS):
            for kind, names in hybrid_reference["groups"]:
                for name in names if kind == "FullAttentionSpec" else ():
                    g, w = got[b][name], hybrid_reference["kv"][0][b][name]
                    assert g is not None and w is not None and torch.equal(g, w), (b, name)
    else:
        assert out.outputs[0].finish_reason == "error", out.outputs[0]
    assert generate(second, PROMPTS[1:]) == hybrid_reference["tokens"][1:]
    assert all(not cache[0].any() for cache in probe.kv_caches().values())
    assert_idle(probe)


def test_sync_loads_are_refused_at_start_up_on_a_hybrid_model(gemma2_model: Path, tmp_path: Path) -> None:
    """vLLM 0.32 has no report for a failed sync load with several KV cache groups: the engine does not
    start, and the error names the setting and what to do."""
    with pytest.raises(Exception, match="kv_sync_loads") as info:
        make_llm(gemma2_model, kv=kv_config(backend_url=f"file://{tmp_path}", kv_sync_loads=True))
    assert "--disable-hybrid-kv-cache-manager" in str(info.value)


# -- preemption ----------------------------------------------------------------------------------------

# Each prompt's 260 tokens and 40 more need 10 full-attention blocks and 3 sliding-window blocks (one pool
# block covers a layer of each group): a cache of a few more than 20 usable blocks admits two prompts whose
# growth then preempts one; a load parks its request in WAITING_FOR_REMOTE_KVS first. Sync loads are refused
# on a hybrid model (vLLM 0.32 cannot be told that one failed:
# ``test_sync_loads_are_refused_at_start_up_on_a_hybrid_model``).
#
# vLLM 0.32 admits an async load only into the free blocks less what the loads parked before it still need
# (``Scheduler._inflight_prefill_reserved_blocks``), but its count of a sliding-window group's need is capped
# by ``max_admission_blocks_per_request`` (about the window plus ``max_num_batched_tokens``, in blocks), then
# compared with every position the request holds, the null blocks outside the window included
# (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``): a parked load longer than the cap reserves no
# sliding-window block, one short of what it needs. With 64-token batches the cap is 5 blocks, and a
# 23-block cache hangs whenever a load is still parked when a preempted request is admitted with its own:
# the two end up holding all but one free block, each needing two, and waiting requests preempt nobody
# (docs/kv.md, hybrid models). Batches of 256 tokens put the cap past max_model_len, so every reservation
# here is exact and the same cache does not hang this way.
PREEMPTING_CACHE_BLOCKS = 23
BATCH_TOKENS = 256


def _small(blocks: int) -> dict[str, int]:
    return {
        "kv_cache_bytes": blocks * 2 * 16 << 10,
        "max_model_len": 320,
        "max_num_batched_tokens": BATCH_TOKENS,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("late_reports", [0, 60], ids=["reported-on-time", "reported-60-steps-late"])
def test_a_hybrid_models_preempted_requests_resume_with_the_connector(
    gemma2_model: Path, engines: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_reports: int
) -> None:
    """Engine 1 saves the prompts; engine 2, under a cache that preempts, loads them, saves the blocks it
    computes, and loads those back when a preempted request resumes: a load planned for a preempted request
    reads a value past the prompt's full blocks, one holding tokens it generated itself, which only engine 2
    saved, before the preemption. Tokens equal a connector-less engine's under the same cache, which runs the
    prompts one after the other. ``late_reports``: each finished load is reported that many steps late, as
    a busy machine's loop thread does; with 64-token batches this hangs vLLM's scheduler (see above)."""
    blocks = PREEMPTING_CACHE_BLOCKS
    small = _small(blocks)
    url = f"file://{tmp_path / 'store'}"
    ref = make_llm(gemma2_model, **small)  # type: ignore[arg-type]
    engines.append(ref)
    assert Probe(ref).free_blocks()[1] == blocks - 1  # the cache is as small as meant (and the null block)
    # Without loads, vLLM admits a prompt only when its whole sequence fits (the window's blocks counted in
    # full under these batches): the reference runs them one after the other and never preempts.
    want = generate(ref, PROMPTS, max_tokens=40)
    close_llm(ref)
    engines.remove(ref)

    first = make_llm(gemma2_model, kv=kv_config(backend_url=url))
    engines.append(first)
    generate(first, PROMPTS)
    probe = Probe(first)
    assert_idle(probe)
    saved = probe.kv_worker_connector().worker_side.saver.saved
    assert saved > 0
    close_llm(first)
    engines.remove(first)

    kv = kv_config(backend_url=url)
    llm = make_llm(gemma2_model, kv=kv, **small)  # type: ignore[arg-type]
    engines.append(llm)
    probe = Probe(llm)
    scheduler = probe.scheduler
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        cap = manager.max_admission_blocks_per_request  # None: not capped (full attention)
        assert cap is None or cap * BLOCK_SIZE >= 320, cap  # every parked load's need is reserved in full
    connector = probe.kv_scheduler_connector()
    keys = connector.scheduler_side.keys
    build = connector.build_connector_meta
    resumed: list[int] = []  # per load planned for a preempted request: the last value it reads (its index)

    def recorded(so: Any) -> Any:
        meta = build(so)
        for spec in meta.loads:
            request = scheduler.requests[spec.request_id]
            if request.num_preemptions:
                hashes = keys.value_hashes(request.block_hashes)
                resumed.append(max(hashes.index(ref.value_hash) for ref in spec.values))
        return meta

    monkeypatch.setattr(connector, "build_connector_meta", recorded)
    worker = probe.kv_worker_connector().worker_side
    lookup = connector.get_num_new_matched_tokens

    def after_its_saves(request: Any, num_computed_tokens: int) -> Any:
        # The value a request completes as it is preempted is still being put when the scheduler asks for it
        # next (at once): the lookup waits for those puts, or on a busy machine it finds one value fewer and
        # the request computes it (correct, but not the path this case is about). vLLM skips it meanwhile.
        if request.num_preemptions and worker.saver.pending(request.request_id):
            return None, False
        return lookup(request, num_computed_tokens)

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", after_its_saves)
    if late_reports:
        worker_connector = probe.kv_worker_connector()
        results = worker_connector.get_transfer_results
        held: dict[str, int] = {}  # request id -> steps its finished load's report is still held back

        def reported_late(finished: set[str]) -> Any:
            out = results(finished)
            assert not out.failed_recving, out.failed_recving  # held back with the report, were there any
            held.update(dict.fromkeys(out.finished_recving, late_reports))
            due = {rid for rid, left in held.items() if left <= 0}
            for rid in held:
                held[rid] -= 1
            for rid in due:
                del held[rid]
            out.finished_recving = due
            return out

        monkeypatch.setattr(worker_connector, "get_transfer_results", reported_late)
    assert generate(llm, PROMPTS, max_tokens=40) == want
    metrics = probe.metrics()
    assert metrics["vllm:num_preemptions"] > 0, "the cache is not small enough"
    assert resumed, "no preempted request was served from the store"
    # a value past the prompt's full blocks holds generated tokens: engine 1 never completed one (8 tokens)
    assert max(resumed) >= FULL_BLOCKS, resumed
    assert worker.loader.loaded > 0 and not worker.loader.failures
    assert not worker.saver.failures and not worker.saver.requests_failed
    assert metrics["vllm:external_prefix_cache_hits"] > 0
    # vLLM's null block never written, whatever the preemptions freed and reallocated
    assert all(not cache[0].any() for cache in probe.kv_caches().values())
    assert_idle(probe)


# -- tensor parallel: each rank holds its own heads' KV, and saves and loads it ------------------------------

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.mark.slow
@pytest.mark.long  # three TP=2 engines, multiprocess: about a minute each to start on two busy cores
@pytest.mark.timeout(900)
def test_tp2_a_hybrid_models_ranks_save_and_load_their_own_kv_byte_exact(
    gemma2_model: Path, engines: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 (vLLM's multiprocess executor, a CPU core per rank; one KV head per rank): engine 1 computes and
    saves, each rank its own heads' blocks; a fresh engine 2's ranks each load theirs. Per rank, every
    full-attention block and every sliding-window block engine 2 holds is byte-equal to what that rank of
    engine 1 computed, tokens equal a TP=2 connector-less engine's, and the ranks' KV differ (so a rank that
    loaded the other's values would fail)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    url = f"file://{tmp_path / 'store'}"
    ref = make_llm(gemma2_model, **TP2)
    engines.append(ref)
    want_tokens, _ = run_prompts(ref, PROMPTS)
    close_llm(ref)
    engines.remove(ref)

    first = make_llm(gemma2_model, kv=kv_config(backend_url=url), **TP2)
    engines.append(first)
    tokens, computed = run_prompts(first, PROMPTS)
    assert tokens == want_tokens
    ranks = settled(first)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["windowed"] and r["saved"] > 0 and r["held"] == 0 for r in ranks), ranks
    assert ranks[0]["saved"] == ranks[1]["saved"]  # each rank saves its own copy of every value
    close_llm(first)
    engines.remove(first)

    second = make_llm(gemma2_model, kv=kv_config(backend_url=url), **TP2)
    engines.append(second)
    tokens, loaded = run_prompts(second, PROMPTS)
    assert tokens == want_tokens
    ranks = settled(second)
    assert all(r["loaded"] > 0 and not r["load_failures"] and r["held"] == 0 for r in ranks), ranks
    assert not any(r["null_written"] for r in ranks), ranks
    full_layers = {n for kind, names in GEMMA2_GROUPS if kind == "FullAttentionSpec" for n in names}
    for p, (got, want) in enumerate(zip(loaded, computed, strict=True)):
        for name, blocks in got["held"].items():
            if name in full_layers:
                assert blocks == list(range(FULL_BLOCKS)), (p, name, blocks)
            else:  # the window at the cut is there
                assert set(range(FULL_BLOCKS - WINDOW_BLOCKS, FULL_BLOCKS)) <= set(blocks), (p, name, blocks)
            for rank in (0, 1):
                for j, b in enumerate(blocks):
                    assert b in want["held"][name], (p, name, b)
                    w = want["ranks"][rank][name][want["held"][name].index(b)]
                    assert torch.equal(got["ranks"][rank][name][j], w), (p, rank, name, b)
        for name in full_layers:  # the ranks hold different heads: a swapped load would not match
            assert not torch.equal(got["ranks"][0][name], got["ranks"][1][name]), (p, name)
