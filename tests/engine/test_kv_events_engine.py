"""KV events and hit sources in vLLM's real engine: what a router and a dashboard see.

One engine with ``kv_events_config`` (vLLM's own ZMQ publisher) and our connector on ``file://`` computes a
prompt; a router-like client fetches the publisher's batches over its replay socket (what a router asks for
after a gap; the live PUB stream carries the same frames) and decodes them with msgspec as ``KVEventBatch``.
Our ``BlockStored`` events must name the prompt's full blocks exactly as vLLM's own ``GPU`` events do. A
second engine then loads the prompt from the store, and vLLM's ``vllm:prompt_tokens_cached_by_source``
counts those tokens under ``disk``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine import routers
from tests.engine.kvcase import FULL_BLOCKS, PROMPTS, assert_idle, cached_by_source, generate

pytestmark = pytest.mark.vllm


def test_a_router_sees_the_stores_blocks_and_hits_count_as_disk(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    url = f"file://{tmp_path}"
    events_config, _, replay_port = routers.events_config()
    prompt = PROMPTS[0]
    first = make_llm(text_model, kv=kv_config(backend_url=url), kv_events_config=events_config)
    engines.append(first)
    generate(first, [prompt])
    probe = Probe(first)
    assert_idle(probe)  # every save confirmed and reported: its events are published
    want = [maybe_convert_block_hash(h) for h in probe.block_hashes(prompt)][:FULL_BLOCKS]
    events = [e for batch in routers.replayed_batches(replay_port) for e in batch.events]
    # A connector reset (how a weight update clears caches) is refused: the store keeps its values -- the
    # second engine below still loads every one of them.
    assert first.reset_prefix_cache(reset_connector=True) is False
    close_llm(first)
    engines.remove(first)

    stored = [e for e in events if isinstance(e, BlockStored)]
    ours = [e for e in stored if e.medium == "STORAGE"]
    assert {(e.locality, e.ownership) for e in ours} == {("LOCAL", "asyncconn:file")}
    got = [h for e in ours for h in e.block_hashes]
    assert len(got) == len(want) and set(got) == set(want)  # each full block once
    # What a router matches on equals vLLM's own prefix-cache event for the same blocks.
    gpu = {h: (e, i) for e in stored if e.medium == "GPU" for i, h in enumerate(e.block_hashes)}
    for event in ours:
        (block_hash,) = event.block_hashes
        own, i = gpu[block_hash]
        parent = own.block_hashes[i - 1] if i else own.parent_block_hash
        assert event.parent_block_hash == parent
        assert event.token_ids == own.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        assert (event.block_size, event.lora_id, event.extra_keys) == (own.block_size, None, [None])

    second = make_llm(text_model, kv=kv_config(backend_url=url))
    engines.append(second)
    generate(second, [prompt])
    assert cached_by_source(second) == {"disk": FULL_BLOCKS * BLOCK_SIZE}


def test_a_router_sees_the_host_tier_apart_from_the_store(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """With a host tier, the engine also publishes the tier's residency (``CPU``, ``asyncconn:host``): a
    router replaying the events holds exactly the values the tier holds, after saves, after values leave
    the tier, and after a load brings them back; the store's residency is untouched by the tier's. A live
    subscriber (SUB on the publisher's stream) got the same batches."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events_config, pub_port, replay_port = routers.events_config()
    url = f"file://{tmp_path}"
    llm = make_llm(
        text_model, kv=kv_config(backend_url=url, host_cache_bytes="64MiB"), kv_events_config=events_config
    )
    engines.append(llm)
    live = routers.Subscriber(pub_port)
    prompt, other = PROMPTS[0], PROMPTS[1][::-1]  # no shared prefix
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    lru = worker.store.host_tier.lru
    block_hashes = probe.block_hashes(prompt)[:FULL_BLOCKS]
    value_keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    want = [maybe_convert_block_hash(h) for h in block_hashes]

    def in_tier() -> set[Any]:
        return {h for h, key in zip(want, value_keys, strict=True) if key in lru}

    def router() -> dict[tuple[Any, Any], set[Any]]:
        return routers.residency(routers.replayed_batches(replay_port))

    host, store = ("CPU", "asyncconn:host"), ("STORAGE", "asyncconn:file")
    generate(llm, [prompt])
    assert_idle(probe)
    held = router()
    assert held[host] == in_tier() == set(want) and held[store] == set(want)

    assert lru.discard(value_keys[2:4]) == 2  # two values leave the tier (not the store)
    generate(llm, [other])
    assert_idle(probe)
    held = router()
    assert held[host] & set(want) == in_tier() == set(want) - set(want[2:4])
    assert set(want) <= held[store]

    assert llm.reset_prefix_cache()  # vLLM's own cache forgets the prompt: it is loaded, and the tier
    generate(llm, [prompt])  # takes the two values in again
    assert_idle(probe)
    held = router()
    assert held[host] & set(want) == in_tier() == set(want)
    try:
        batches = live.drain()
    finally:
        live.close()
    assert live.seqs == list(range(len(batches))) and batches  # all, in order: what a replay gives
    assert routers.residency(batches) == routers.residency(routers.replayed_batches(replay_port))


def test_kv_events_host_publishes_the_tiers_residency_alone(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """``kv_events=host``: the engine publishes its host tier's residency and vLLM's own ``GPU`` blocks,
    not the store's (a router blind to ``medium`` and ``ownership`` then scores only what this server alone
    loads fast)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events_config, _, replay_port = routers.events_config()
    kv = kv_config(backend_url=f"file://{tmp_path}", host_cache_bytes="64MiB", kv_events="host")
    llm = make_llm(text_model, kv=kv, kv_events_config=events_config)
    engines.append(llm)
    prompt = PROMPTS[0]
    generate(llm, [prompt])
    probe = Probe(llm)
    assert_idle(probe)
    want = {maybe_convert_block_hash(h) for h in probe.block_hashes(prompt)[:FULL_BLOCKS]}
    held = {
        where: hashes
        for where, hashes in routers.residency(routers.replayed_batches(replay_port)).items()
        if hashes
    }
    assert set(held) == {("CPU", "asyncconn:host"), ("GPU", None)}
    assert held[("CPU", "asyncconn:host")] == want and want <= held[("GPU", None)]


def test_a_router_sees_the_local_store_apart_from_the_shared_one(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """With a local store (``local_store_url``), the engine publishes the directory's residency too
    (``STORAGE``, ``asyncconn:local``): a router replaying the events holds exactly the values the
    directory holds -- after the saves, after the directory's own sweep evicted them (the shared store's
    residency untouched), and after a load wrote them back."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events_config, _, replay_port = routers.events_config()
    kv = kv_config(
        backend_url=f"file://{tmp_path / 'shared'}", local_store_url=f"file://{tmp_path / 'local'}"
    )
    llm = make_llm(text_model, kv=kv, kv_events_config=events_config)
    engines.append(llm)
    prompt, other = PROMPTS[0], PROMPTS[1][::-1]  # no shared prefix
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    local = worker.store.layered.local
    block_hashes = probe.block_hashes(prompt)[:FULL_BLOCKS]
    value_keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    want = [maybe_convert_block_hash(h) for h in block_hashes]

    def on_disk() -> set[Any]:  # asked of the directory itself
        there = worker.runtime.run(local.exists(value_keys))
        bpv = worker.keys.blocks_per_value
        return {h for v, held in enumerate(there) if held for h in want[v * bpv : (v + 1) * bpv]}

    def router() -> dict[tuple[Any, Any], set[Any]]:
        return routers.residency(routers.replayed_batches(replay_port))

    here, shared = ("STORAGE", "asyncconn:local"), ("STORAGE", "asyncconn:file")
    generate(llm, [prompt])
    assert_idle(probe)
    held = router()
    assert held[here] == on_disk() == set(want) and held[shared] == set(want)

    local.max_bytes = 1  # the directory's sweep evicts everything past its bound
    report = worker.runtime.run(local.sweep())
    local.max_bytes = 0
    assert report is not None and report.evicted >= len(value_keys)
    generate(llm, [other])  # steps: the worker's report reaches the scheduler
    assert_idle(probe)
    held = router()
    assert held[here] & set(want) == on_disk() == set()
    assert set(want) <= held[shared]

    assert llm.reset_prefix_cache()  # vLLM's own cache forgets the prompt: it is loaded from the shared
    generate(llm, [prompt])  # store, and written to the directory again
    assert_idle(probe)
    held = router()
    assert held[here] & set(want) == on_disk() == set(want)


@pytest.mark.usefixtures("unwatched_directories")
def test_a_router_hears_another_engines_sweep_and_write_of_the_local_directory(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """Another engine's store on the same local directory sweeps it (past its ``max_bytes``), later the
    values are written there again: this engine's workers hear neither, and here the directory cannot be
    watched either (as a sweep from another host of a network filesystem would not be seen). With
    ``kv_events_recheck`` the scheduler asks the directory again, and while the engine serves other prompts
    (never that one) a router replaying vLLM's publisher drops the prompt's values from the local residency,
    then finds them again -- each time exactly what the directory holds; the shared store's residency keeps
    them throughout."""
    from asyncconn.runtime import get_runtime
    from asyncconn.store import TensorStore

    here, shared = ("STORAGE", "asyncconn:local"), ("STORAGE", "asyncconn:file")
    local_dir = tmp_path / "local"
    llm, probe, replay_port, block_hashes, want = _announced(
        text_model, engines, here, f"file://{tmp_path / 'shared'}",
        local_store_url=f"file://{local_dir}", kv_events_recheck="300ms",
    )  # fmt: skip
    worker = probe.kv_worker_connector().worker_side
    local = worker.store.layered.local
    keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    saved = {key: local.path_for(key).read_bytes() for key in keys}

    def on_disk() -> set[Any]:  # asked of the directory itself
        there = worker.runtime.run(local.exists(keys))
        return {h for h, present in zip(want, there, strict=True) if present}

    runtime = get_runtime()
    other = runtime.run(TensorStore.open(f"file://{local_dir}?max_bytes=1"), 30)  # sweeps as it opens
    runtime.run(other.close(), 30)
    assert on_disk() == set()
    held = _serve_others_until(llm, replay_port, lambda held: not held[here] & set(want))
    assert held[here] & set(want) == on_disk() == set()
    assert set(want) <= held[shared]

    for key, data in saved.items():  # written there again (by the other engine)
        local.path_for(key).write_bytes(data)
    held = _serve_others_until(llm, replay_port, lambda held: set(want) <= held[here])
    assert_idle(probe)
    assert held[here] & set(want) == on_disk() == set(want)
    side = probe.kv_scheduler_connector().scheduler_side
    assert side.local_recheck is not None and side.local_recheck.removed == len(keys)


def test_another_engines_sweeps_of_this_hosts_directories_are_announced_at_the_next_steps(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """The recheck off: another engine's stores on this host's shared and local directories sweep them (past
    their ``max_bytes``), which neither this engine's workers nor its scheduler's stores did. The scheduler's
    stores watch both directories (inotify), so a router replaying vLLM's publisher drops the prompt's
    values from both residencies while the engine serves its next prompt, each equal to what the directory
    holds. (Without the watch nothing is heard: the values stay.)"""
    from asyncconn.runtime import get_runtime
    from asyncconn.store import TensorStore

    here, shared = ("STORAGE", "asyncconn:local"), ("STORAGE", "asyncconn:file")
    llm, probe, replay_port, block_hashes, want = _announced(
        text_model, engines, here, f"file://{tmp_path / 'shared'}",
        local_store_url=f"file://{tmp_path / 'local'}", kv_events_recheck=0,
    )  # fmt: skip
    assert set(want) <= routers.residency(routers.replayed_batches(replay_port))[shared]
    runtime = get_runtime()
    for directory in ("shared", "local"):
        other = runtime.run(TensorStore.open(f"file://{tmp_path / directory}?max_bytes=1"), 30)  # sweeps
        runtime.run(other.close(), 30)
    held = _serve_others_until(llm, replay_port, lambda held: not (held[here] | held[shared]) & set(want), 2)
    assert_idle(probe)
    worker = probe.kv_worker_connector().worker_side
    keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    assert not any(worker.runtime.run(worker.store.layered.local.exists(keys)))
    assert not any(worker.runtime.run(worker.store.layered.shared.exists(keys)))
    assert held[here] & set(want) == set() and held[shared] & set(want) == set()


def test_a_sweep_by_the_schedulers_own_lookup_store_is_announced(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """The scheduler's process opens the shared ``file://`` store to answer lookups, and a ``file://`` store
    sweeps wherever it is open: a sweep that runs there (past ``max_bytes``) evicts the prompt's values,
    which no worker hears. With the recheck off, a router replaying vLLM's publisher still drops them at the
    next step -- the scheduler hooked its own store -- and its residency equals what the store holds."""
    from asyncconn.runtime import get_runtime

    store = ("STORAGE", "asyncconn:file")
    llm, probe, replay_port, block_hashes, want = _announced(
        text_model, engines, store, f"file://{tmp_path}", kv_events_recheck=0
    )
    side = probe.kv_scheduler_connector().scheduler_side
    assert side.lookup is not None and side.lookup.store is not None
    backend = side.lookup.store.backend
    backend.max_bytes = 1
    report = get_runtime().run(backend.sweep(), 30)
    backend.max_bytes = 0
    assert report is not None and report.evicted >= len(want)
    generate(llm, [PROMPTS[1][::-1]], max_tokens=4)  # steps: the scheduler publishes what it heard
    assert_idle(probe)
    held = routers.residency(routers.replayed_batches(replay_port))[store]
    worker = probe.kv_worker_connector().worker_side
    keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    there = worker.runtime.run(worker.store.exists(keys))
    assert not any(there) and held & set(want) == set()


def _serve_others_until(llm: Any, replay_port: int, done: Any, prompts: int = 40) -> dict[Any, set[Any]]:
    """Serve prompts sharing nothing with ``PROMPTS[0]`` (never looked up again) until ``done`` holds of
    the residency a router replaying the publisher holds; that residency."""
    held: dict[Any, set[Any]] = {}
    for n in range(prompts):
        generate(llm, [[(t + n + 1) % 200 + 1 for t in PROMPTS[1]]], max_tokens=4)
        held = routers.residency(routers.replayed_batches(replay_port))
        if done(held):
            break
    return held


@pytest.mark.usefixtures("unwatched_directories")  # unreported: only the lookup can find it missing
def test_a_value_deleted_behind_the_stores_back_is_announced_removed_at_the_next_lookup(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    """A store that never reports a removal (a file deleted behind ``file://``'s back here, as Mooncake
    evicts without telling): when the engine next looks the prompt up, the store answers that value 2 is
    missing, and a router replaying vLLM's publisher drops exactly that value from the store's residency."""
    store = ("STORAGE", "asyncconn:file")
    llm, probe, replay_port, block_hashes, want = _announced(text_model, engines, store, f"file://{tmp_path}")
    prompt = PROMPTS[0]
    worker = probe.kv_worker_connector().worker_side
    value_hashes = worker.keys.value_hashes(block_hashes)  # one value per block
    Path(worker.store.backend._path(worker.keys.store_key(value_hashes[2], 0))).unlink()

    assert llm.reset_prefix_cache()  # vLLM's own cache forgets the prompt: it is looked up again
    generate(llm, [prompt])
    assert_idle(probe)
    held = routers.residency(routers.replayed_batches(replay_port))[store]
    assert held == set(want) - {want[2]}
    there = worker.runtime.run(worker.store.exists([worker.keys.store_key(h, 0) for h in value_hashes]))
    assert held == {h for h, present in zip(want, there, strict=True) if present}  # what the store holds


@pytest.mark.mooncake
def test_a_mooncake_value_removed_behind_the_engines_back_is_announced_while_it_serves_other_prompts(
    text_model: Path, engines: list[Any], mooncake_master: Any
) -> None:
    """Mooncake never reports a removal. With ``kv_events_recheck`` the engine asks the store again about
    the values it announced, on a timer: a value another client removes is dropped from a router's view of
    the store while the engine serves other prompts -- it never looks that prompt up again -- and the
    residency then equals what the store holds."""
    import uuid

    from asyncconn.runtime import get_runtime
    from asyncconn.store import TensorStore
    from asyncconn.url import with_param

    url = mooncake_master.url(
        segment="128MiB", buffer="32MiB", timeout="5s", prefix=f"recheck-{uuid.uuid4().hex[:8]}/"
    )
    store = ("CPU", "asyncconn:mooncake")
    llm, probe, replay_port, block_hashes, want = _announced(
        text_model, engines, store, url, kv_events_recheck="300ms"
    )
    worker = probe.kv_worker_connector().worker_side
    keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(block_hashes)]
    runtime = get_runtime()
    other = runtime.run(TensorStore.open(with_param(url, "segment", "0")), 30)  # another client of the store
    try:
        assert runtime.run(other.delete([keys[2]]), 30) == 1
    finally:
        runtime.run(other.close(), 30)

    held = _serve_others_until(llm, replay_port, lambda held: want[2] not in held[store])[store]
    assert_idle(probe)
    assert held & set(want) == set(want) - {want[2]}
    there = worker.runtime.run(worker.store.exists(keys))
    assert held & set(want) == {h for h, present in zip(want, there, strict=True) if present}
    side = probe.kv_scheduler_connector().scheduler_side
    assert side.recheck is not None and side.recheck.removed == 1


def _announced(
    text_model: Path, engines: list[Any], store: tuple[str, str], url: str, **kv: Any
) -> tuple[Any, Probe, int, list[Any], list[Any]]:
    """An engine with KV events on over ``url`` that computed ``PROMPTS[0]``, whose full blocks a router
    replaying the publisher finds in ``store``'s residency (``medium``, ``ownership``), exactly: the engine,
    its probe, the replay port, the blocks' hashes, and the same as the events carry them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events_config, _, replay_port = routers.events_config()
    llm = make_llm(text_model, kv=kv_config(backend_url=url, **kv), kv_events_config=events_config)
    engines.append(llm)
    generate(llm, [PROMPTS[0]])
    probe = Probe(llm)
    assert_idle(probe)
    block_hashes = probe.block_hashes(PROMPTS[0])[:FULL_BLOCKS]
    want = [maybe_convert_block_hash(h) for h in block_hashes]
    assert routers.residency(routers.replayed_batches(replay_port))[store] == set(want)
    return llm, probe, replay_port, block_hashes, want
