"""The KV worker side's load path on CPU, without an engine: values land straight from the loader's staging
buffer into the cache (no new tensor per value, no gather of a whole value first), partial values still
land only their positions, and landings are scattered while the others are still being read."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, PinnedPool, SaveTracker, StreamLoader
from asyncconn.vllm.kv.connector import AsyncConnKVConnector
from asyncconn.vllm.kv.events import SaveReports
from asyncconn.vllm.kv.in_place import InPlaceLanding
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef
from asyncconn.vllm.kv.worker import KVWorkerSide

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

LAYERS = [f"layer.{i}" for i in range(3)]
NUM_BLOCKS = 32


class _NoTensorSpecs(CpuDevice):
    """Refuses the per-value tensor a load used to be copied into before its scatter."""

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        raise AssertionError("a KV load made a new tensor for its value")


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(name="kv-worker-loads").start()
    yield rt
    rt.close()


def _worker(
    runtime: Runtime,
    blocks_per_value: int,
    url: str | None = None,
    kv_outer: bool = False,
    groups: dict[str, int] | None = None,
    windowed: bool = False,
    num_groups: int = 1,
    host_cache_bytes: int = 0,
    events: bool = False,
    store: TensorStore | None = None,
) -> tuple[KVWorkerSide, KeySpace, dict[str, torch.Tensor]]:
    """A worker on host caches of ``[NUM_BLOCKS, 2, 16, 8]`` per layer (``kv_outer``: ``[2, NUM_BLOCKS, 16,
    8]``, K and V apart, vLLM's other layout), over ``store`` or one opened from ``url``."""
    identity = KVIdentity(
        "worker-loads", "", "float32", "default", 16, 2, 8, tuple(LAYERS), 1, blocks_per_value
    )
    keys = KeySpace(identity)
    url = url or f"memory://kv-loads-{uuid.uuid4().hex[:8]}"
    if store is None:
        store = runtime.run(TensorStore.open(url, host_cache_bytes=host_cache_bytes), timeout=10)
    pool = PinnedPool(8 << 20)
    worker = KVWorkerSide(
        keys,
        store=store,
        loader=StreamLoader(store, runtime=runtime, device=_NoTensorSpecs(), pool=pool),
        saver=SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=pool),
        runtime=runtime,
        layers=LAYERS,
        group_of_layer=groups or dict.fromkeys(LAYERS, 0),
        num_blocks=NUM_BLOCKS,
        windowed=windowed,
        num_groups=num_groups,
        events=SaveReports() if events else None,
    )
    shape = (2, NUM_BLOCKS, 16, 8) if kv_outer else (NUM_BLOCKS, 2, 16, 8)
    caches = {n: torch.zeros(shape) for n in LAYERS}
    worker.register_kv_caches(caches)
    return worker, keys, caches


def _receive(worker: KVWorkerSide, *rids: str) -> None:
    wanted = set(rids)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, got = worker.get_finished(set(), step_tokens=0)
        wanted -= got or set()
        if not wanted:
            return
        time.sleep(0.001)
    raise AssertionError(f"{sorted(wanted)} not reported received")


@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("bpv", [1, 2])
def test_loaded_values_land_bytes_exact_from_staging(
    runtime: Runtime, bpv: int, ascending: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, keys, caches = _worker(runtime, bpv)
    values = [torch.randn(len(LAYERS), bpv, 2, 16, 8) for _ in range(3)]
    hashes = [bytes([v + 1]) * 32 for v in range(3)]
    runtime.run(
        worker.store.put([(keys.store_key(h, 0), val) for h, val in zip(hashes, values, strict=True)])
    )
    gathers = index_tensors = 0
    index_select, make_tensor = torch.Tensor.index_select, torch.tensor

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal gathers
        gathers += 1
        return index_select(self, *args, **kwargs)

    def counted_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal index_tensors
        index_tensors += 1
        return make_tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    whole = tuple(range(bpv))

    def block(v: int, j: int) -> int:  # consecutive ids (a plain slice of the cache), or a reversed run
        return 10 + v * bpv + j if ascending else 20 - v * bpv - j

    refs = [ValueRef(hashes[v], whole, (tuple(block(v, j) for j in whole),)) for v in range(2)]
    if bpv > 1:  # a value of which only the last position is loaded (a local prefix hit covers the rest)
        refs.append(ValueRef(hashes[2], (bpv - 1,), ((3,),)))
    monkeypatch.setattr(torch, "tensor", counted_tensor)
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", tuple(refs))]))
    _receive(worker, "r")
    monkeypatch.setattr(torch, "tensor", make_tensor)
    assert worker.get_block_ids_with_load_errors() == set()
    for i, name in enumerate(LAYERS):
        for v in range(2):
            for j in whole:
                assert torch.equal(caches[name][block(v, j)], values[v][i, j]), (name, v, j)
        if bpv > 1:
            assert torch.equal(caches[name][3], values[2][i, bpv - 1])
    # whole values are copied as they are; only the partial value gathers its positions (once per layer);
    # an index tensor only for its positions and for runs of block ids that are not consecutive
    assert gathers == (len(LAYERS) if bpv > 1 else 0)
    assert index_tensors == (0 if bpv == 1 else 1 if ascending else 3)
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_an_idle_step_reports_a_whole_load_without_waiting_for_the_others(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a step with no tokens the worker waits for loads to land (up to ``IDLE_WAIT_S``); once one
    request's every value is in, it stops waiting and reports that request while another request's read
    still hangs. (Before, the first request waited for the others or for the bound, 15 s here.)"""
    import asyncconn.vllm.kv.worker as worker_module
    from tests.transfer.fakes import GatedBackend

    class SlowFor(GatedBackend):
        """Reads of ``slow`` keys wait on the gate; the others are served at once."""

        slow: frozenset[str] = frozenset()

        async def get_into(self, key: str, dests: Any, sink: Any = None) -> int | None:
            if key in self.slow:
                return await super().get_into(key, dests, sink)
            return self._read_value(key, dests, sink)

    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 15.0)
    backend = SlowFor()
    backend.only_keys = set()  # puts never wait
    store = TensorStore(backend, name="slow-for-one")
    worker, keys, caches = _worker(runtime, 1, store=store)
    fast, slow = b"\x01" * 32, b"\x02" * 32
    values = [torch.randn(len(LAYERS), 1, 2, 16, 8) for _ in range(2)]
    runtime.run(store.put([(keys.store_key(h, 0), v) for h, v in zip((fast, slow), values, strict=True)]))
    backend.slow = frozenset({keys.store_key(slow, 0)})
    loads = [
        LoadSpec(rid, (ValueRef(h, (0,), ((block,),)),))
        for rid, h, block in (("a", fast, 10), ("b", slow, 11))
    ]
    worker.start_load_kv(AsyncConnKVMetadata(loads=loads))
    started, got = time.monotonic(), set()
    while "a" not in got and time.monotonic() - started < 5:
        _, recving = worker.get_finished(set(), step_tokens=0)
        got |= recving or set()
    assert got == {"a"} and time.monotonic() - started < 5
    for i, name in enumerate(LAYERS):
        assert torch.equal(caches[name][10], values[0][i, 0])
    runtime.call_soon(backend.gate.set)
    _receive(worker, "b")
    for i, name in enumerate(LAYERS):
        assert torch.equal(caches[name][11], values[1][i, 0])
    worker.close()
    assert not any(worker.held().values()), worker.held()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_an_idle_step_is_woken_once_for_a_requests_in_place_values(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    """In-place values need nothing from vLLM's thread as they land: an idle step waits for as many as the
    request closest to whole lacks and is woken once, by the last (a wake-up per value took the GIL from
    the loop reading the next ones). Staged values still wake it one by one: it scatters each as it lands."""
    import asyncconn.vllm.kv.worker as worker_module
    from tests.transfer.fakes import GatedBackend

    class OneByOne(GatedBackend):
        """Each value's read waits on a gate of its own; in place when the reads can be abandoned."""

        cancellable_reads = in_place  # writes the caller's memory on the loop only, as redis:// does
        gates: dict[str, asyncio.Event]

        async def get_into(self, key: str, dests: Any, sink: Any = None) -> int | None:
            await self.gates[key].wait()
            return self._read_value(key, dests, sink)

        async def get(self, keys: Any) -> Any:
            for key in keys:
                await self.gates[key].wait()
            return [(self.data[k],) for k in keys]

    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 15.0)
    backend = OneByOne(gated=False)
    store = TensorStore(backend, name="one-by-one")
    worker, keys, caches = _worker(runtime, 1, store=store)
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    values = [torch.randn(len(LAYERS), 1, 2, 16, 8) for _ in hashes]
    runtime.run(store.put([(keys.store_key(h, 0), v) for h, v in zip(hashes, values, strict=True)]))
    backend.gates = {keys.store_key(h, 0): asyncio.Event() for h in hashes}

    async def release() -> None:  # the values land 20 ms apart, once the idle step waits
        for gate in backend.gates.values():
            gate.set()
            await asyncio.sleep(0.02)

    waits: list[int] = []
    wait = worker.loader.wait

    def counted(timeout: float, *, landed: int = 0) -> bool:
        waits.append(landed)
        if len(waits) == 1:
            runtime.submit(release())
        return wait(timeout, landed=landed)

    wakes: list[float] = []

    class Counted(threading.Event):
        def set(self) -> None:
            wakes.append(time.monotonic())
            super().set()

    monkeypatch.setattr(worker.loader, "wait", counted)
    worker.loader._landed = Counted()
    refs = tuple(ValueRef(h, (0,), ((10 + i,),)) for i, h in enumerate(hashes))
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("a", refs)]))
    _, recving = worker.get_finished(set(), step_tokens=0)
    assert recving == {"a"}
    if in_place:
        assert waits == [3] and len(wakes) == 1
        assert worker.loader.totals()["loaded_in_place"] == 3
    else:
        assert waits and set(waits) == {1} and len(wakes) >= 2
    for i, name in enumerate(LAYERS):
        for j in range(3):
            assert torch.equal(caches[name][10 + j], values[j][i, 0])
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_cpu_engines_loads_are_issued_at_bind_once_before_the_forward(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 calls ``start_load_kv`` for asynchronous loads after the forward, which on a CPU engine has
    run to its end by then: the connector issues them when the step's metadata is bound instead, and vLLM's
    later call submits nothing again."""
    worker, keys, caches = _worker(runtime, 1)
    value = torch.randn(len(LAYERS), 1, 2, 16, 8)
    runtime.run(worker.store.put([(keys.store_key(b"\x01" * 32, 0), value)]))
    submitted: list[int] = []
    submit_many = worker.loader.submit_many

    def counted(items: Any) -> None:
        submitted.append(len(items))
        submit_many(items)

    monkeypatch.setattr(worker.loader, "submit_many", counted)
    connector = object.__new__(AsyncConnKVConnector)  # the facade's worker role, without vLLM's config
    connector._worker, connector._scheduler = worker, None
    meta = AsyncConnKVMetadata(loads=[LoadSpec("r", (ValueRef(b"\x01" * 32, (0,), ((5,),)),))])
    assert worker.loads_before_forward
    connector.bind_connector_metadata(meta)
    assert submitted == [1]  # before any forward
    connector.start_load_kv(None)  # type: ignore[arg-type]  # vLLM's call, after the forward
    assert submitted == [1]
    assert [len(f.targets) for f in worker._fetches.values()] in ([1], [])  # not planned twice either
    _receive(worker, "r")
    assert worker.get_block_ids_with_load_errors() == set()
    for i, name in enumerate(LAYERS):
        assert torch.equal(caches[name][5], value[i, 0])
    # the next step's metadata (nothing to load) issues nothing, and a step vLLM never bound still loads
    connector.bind_connector_metadata(AsyncConnKVMetadata())
    connector.start_load_kv(None)  # type: ignore[arg-type]
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("s", (ValueRef(b"\x01" * 32, (0,), ((6,),)),))]))
    assert submitted == [1, 1]
    _receive(worker, "s")
    for i, name in enumerate(LAYERS):
        assert torch.equal(caches[name][6], value[i, 0])
    worker.close()
    assert not any(worker.held().values()), worker.held()


# -- in place: a host cache and a store that serves reads from memory (file://'s page cache) -----------------
@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("bpv", [1, 2])
def test_in_place_loads_land_bytes_exact_in_the_cache(
    runtime: Runtime, bpv: int, ascending: bool, tmp_path: Path
) -> None:
    """Whole values are read straight into their blocks (no staging, no scatter: the device refuses new
    tensors and ``_scatter`` must not run for them); a second request wanting the same value gets the owner's
    blocks copied; a partial value goes through staging; a corrupt one is a load error of its blocks."""
    worker, keys, caches = _worker(runtime, bpv, f"file://{tmp_path}/store")
    assert isinstance(worker.landing, InPlaceLanding) and worker.layout is not None
    values = [torch.randn(len(LAYERS), bpv, 2, 16, 8) for _ in range(4)]
    hashes = [bytes([v + 1]) * 32 for v in range(4)]
    runtime.run(
        worker.store.put([(keys.store_key(h, 0), val) for h, val in zip(hashes, values, strict=True)])
    )
    bad = worker.store.backend.path_for(keys.store_key(hashes[3], 0))  # type: ignore[attr-defined]
    with open(bad, "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    whole = tuple(range(bpv))

    def block(v: int, j: int) -> int:
        return 10 + v * bpv + j if ascending else 24 - v * bpv - j

    refs = [ValueRef(hashes[v], whole, (tuple(block(v, j) for j in whole),)) for v in (0, 1, 3)]
    other = ValueRef(hashes[0], whole, (tuple(2 + j for j in whole),))  # another request, same value
    partial = [ValueRef(hashes[2], (bpv - 1,), ((6,),))] if bpv > 1 else []
    scattered: list[ValueRef] = []
    real_scatter = worker.layout.scatter
    worker.layout.scatter = lambda value, ref: (scattered.append(ref), real_scatter(value, ref))[1]  # type: ignore[method-assign]
    worker.start_load_kv(
        AsyncConnKVMetadata(loads=[LoadSpec("r", tuple(refs + partial)), LoadSpec("s", (other,))])
    )
    _receive(worker, "r", "s")
    assert worker.get_block_ids_with_load_errors() == {block(3, j) for j in whole}
    for i, name in enumerate(LAYERS):
        for v in (0, 1):
            for j in whole:
                assert torch.equal(caches[name][block(v, j)], values[v][i, j]), (name, v, j)
        for j in whole:
            assert torch.equal(caches[name][2 + j], values[0][i, j]), (name, "other", j)
        if bpv > 1:
            assert torch.equal(caches[name][6], values[2][i, bpv - 1])
    assert sorted(map(id, scattered)) == sorted(map(id, [other, *partial]))  # only these were copied
    stats = worker._stats.data
    assert stats["loads_in_place"] == 2 and stats["load_failures"] == 1
    deadline = time.monotonic() + 10
    while worker.held()["deletes"] and time.monotonic() < deadline:  # the corrupt value's removal
        time.sleep(0.001)
    assert not worker.store.backend.path_for(keys.store_key(hashes[3], 0)).exists()  # type: ignore[attr-defined]
    worker.close()
    assert not any(worker.held().values()), worker.held()


@pytest.mark.parametrize("bpv", [1, 3])
def test_in_place_loads_with_k_and_v_apart_land_in_each_half(
    runtime: Runtime, bpv: int, tmp_path: Path
) -> None:
    """With the ``[2, num_blocks, ...]`` layout a value's blocks are two pieces per run of ids in each layer
    (K's, then V's); runs of consecutive ids and lone ids mixed must each land at their own blocks."""
    worker, keys, caches = _worker(runtime, bpv, f"file://{tmp_path}/store", kv_outer=True)
    assert isinstance(worker.landing, InPlaceLanding) and worker.landing.outer == 2
    value = torch.randn(len(LAYERS), 2, bpv, 16, 8)
    key_hash = b"\x07" * 32
    runtime.run(worker.store.put([(keys.store_key(key_hash, 0), value)]))
    ids = (9, 10, 4) if bpv == 3 else (17,)  # 3: a run of two, then a lone block
    worker.start_load_kv(
        AsyncConnKVMetadata(loads=[LoadSpec("r", (ValueRef(key_hash, tuple(range(bpv)), (ids,)),))])
    )
    _receive(worker, "r")
    assert worker._stats.data["loads_in_place"] == 1
    assert not worker.get_block_ids_with_load_errors()
    for i, name in enumerate(LAYERS):
        for j, b in enumerate(ids):
            assert torch.equal(caches[name][:, b], value[i, :, j]), (name, j)
    untouched = [b for b in range(NUM_BLOCKS) if b not in ids]
    assert all(not caches[n][:, untouched].any() for n in LAYERS)
    worker.close()


def test_a_request_finished_while_its_in_place_read_runs_is_reported_after_the_read(
    runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM frees a request finished while loading once it is in ``finished_recving``; an in-place read may
    be writing its blocks until it ends, so the report waits for it (without load errors), however often the
    request is said to be finished meanwhile."""
    worker, keys, _ = _worker(runtime, 1, f"file://{tmp_path}/store")
    value = torch.randn(len(LAYERS), 1, 2, 16, 8)
    runtime.run(worker.store.put([(keys.store_key(b"\x01" * 32, 0), value)]))
    backend_type = type(worker.store.backend)
    real = backend_type._read_many  # type: ignore[attr-defined]
    started, release = threading.Event(), threading.Event()

    def gated(self: object, reads: object, cached_only: bool = False) -> object:
        started.set()
        assert release.wait(10)
        return real(self, reads, cached_only)

    monkeypatch.setattr(backend_type, "_read_many", gated)
    ref = ValueRef(b"\x01" * 32, (0,), ((5,),))
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", (ref,))]))
    assert started.wait(5)
    for _ in range(5):
        _, recving = worker.get_finished({"r"}, finished_via_recv=frozenset({"r"}), step_tokens=0)
        assert not recving  # its blocks may still be written
    release.set()
    _receive(worker, "r")
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.held()["fetches"] == 0 and worker.held()["req_loads"] == 0
    worker.close()
    assert not any(worker.held().values()), worker.held()


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_sync_load_is_in_when_start_load_kv_returns_and_a_failed_one_fails_the_steps_saves(
    runtime: Runtime, tmp_path: Path, where: str
) -> None:
    """``kv_sync_loads``: vLLM runs the forward right after ``start_load_kv``, so the values must be in the
    cache when it returns (in place from ``file://``, through staging from ``memory://``); a missing value is
    a load error of its blocks the same step and the request is never reported in ``finished_recving``; no
    value that step planned to save is saved -- that request's were computed on top of the missing one, and
    another request's may have been too (vLLM's prefix cache shares blocks) -- and both requests are still
    reported in ``finished_sending`` when they finish. The next step saves again."""
    url = f"file://{tmp_path}/store" if where == "file" else None
    worker, keys, caches = _worker(runtime, 1, url)
    values = [torch.randn(len(LAYERS), 1, 2, 16, 8) for _ in range(2)]
    hashes = [bytes([v + 1]) * 32 for v in range(3)]  # the third is not in the store
    runtime.run(
        worker.store.put([(keys.store_key(h, 0), val) for h, val in zip(hashes, values, strict=False)])
    )
    refs = tuple(ValueRef(hashes[v], (0,), ((10 + v,),)) for v in range(3))
    for cache in caches.values():
        cache[20:22].normal_()
    saves = [
        SaveSpec("r", (ValueRef(b"\x09" * 32, (0,), ((20,),)),)),
        SaveSpec("q", (ValueRef(b"\x0a" * 32, (0,), ((21,),)),)),
    ]
    meta = AsyncConnKVMetadata(loads=[LoadSpec("r", refs, sync=True)], saves=saves, step_tokens=40)
    worker.start_load_kv(meta)
    for i, name in enumerate(LAYERS):  # in now, without a single poll more
        for v in range(2):
            assert torch.equal(caches[name][10 + v], values[v][i, 0]), (name, v)
    assert worker.get_block_ids_with_load_errors() == {12}
    worker.save(meta)
    assert worker.get_finished(set(), step_tokens=40) == (None, None)  # a sync load is never reported
    sending: set[str] = set()
    deadline = time.monotonic() + 10
    while sending != {"r", "q"} and time.monotonic() < deadline:
        got, _ = worker.get_finished({"r", "q"} - sending)
        sending |= got or set()
        time.sleep(0.001)
    assert sending == {"r", "q"}
    present = runtime.run(
        worker.store.exists([keys.store_key(b"\x09" * 32, 0), keys.store_key(b"\x0a" * 32, 0)])
    )
    assert present == [False, False]
    later = AsyncConnKVMetadata(
        saves=[SaveSpec("p", (ValueRef(b"\x0b" * 32, (0,), ((22,),)),))], step_tokens=1
    )
    worker.start_load_kv(later)
    worker.save(later)
    deadline = time.monotonic() + 10
    while worker.saver.pending("p") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert runtime.run(worker.store.exists([keys.store_key(b"\x0b" * 32, 0)])) == [True]
    while worker.get_finished({"p"})[0] != {"p"} and time.monotonic() < deadline:
        time.sleep(0.001)
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_sync_load_past_its_timeout_fails_its_blocks_after_the_in_place_read_ends(
    runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``load_timeout`` a sync load's value fails (its blocks are recomputed), but ``start_load_kv``
    returns only once the in-place read writing those blocks has ended: vLLM's recompute writes them next."""
    worker, keys, _ = _worker(runtime, 1, f"file://{tmp_path}/store")
    worker.load_timeout = 0.5  # the read ends at 0.75 s: past the deadline, well before the give-up at 1 s
    runtime.run(worker.store.put([(keys.store_key(b"\x01" * 32, 0), torch.randn(len(LAYERS), 1, 2, 16, 8))]))
    backend_type = type(worker.store.backend)
    real = backend_type._read_many  # type: ignore[attr-defined]
    ended: list[float] = []

    def slow(self: object, reads: object, cached_only: bool = False) -> object:
        time.sleep(0.75)
        try:
            return real(self, reads, cached_only)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(backend_type, "_read_many", slow)
    ref = ValueRef(b"\x01" * 32, (0,), ((5,),))
    meta = AsyncConnKVMetadata(loads=[LoadSpec("r", (ref,), sync=True)], step_tokens=9)
    worker.start_load_kv(meta)
    returned = time.monotonic()
    assert ended and ended[0] <= returned  # the read had ended
    worker.save(meta)
    assert worker.get_block_ids_with_load_errors() == {5}
    assert worker.get_finished(set(), step_tokens=9) == (None, None)
    worker.close()
    assert not any(worker.held().values()), worker.held()


def _slow_reads(monkeypatch: pytest.MonkeyPatch, worker: KVWorkerSide, seconds: float) -> list[int]:
    """Every store read of ``worker`` takes ``seconds``; returns a list holding the reads running at most."""
    backend_type = type(worker.store.backend)
    real = backend_type.get
    running = [0, 0]  # now, peak

    async def slow(self: object, keys: Any) -> Any:
        running[0] += 1
        running[1] = max(running)
        try:
            await asyncio.sleep(seconds)
            return await real(self, keys)  # type: ignore[arg-type]
        finally:
            running[0] -= 1

    monkeypatch.setattr(backend_type, "get", slow)
    return running


def _put_values(runtime: Runtime, worker: KVWorkerSide, keys: KeySpace, n: int) -> list[ValueRef]:
    values = [(bytes([v + 1]) * 32, torch.randn(len(LAYERS), 1, 2, 16, 8)) for v in range(n)]
    runtime.run(worker.store.put([(keys.store_key(h, 0), val) for h, val in values]))
    return [ValueRef(h, (0,), ((v + 1,),)) for v, (h, _) in enumerate(values)]  # block 0: the null block


def test_a_load_queued_behind_others_does_not_time_out_while_the_store_answers(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt on a healthy store, polled only every 0.4 s (vLLM's thread busy with long steps): its
    values wait for one call slot each, the loop starts each as the previous read ends, and the request
    lands whole although it takes three times ``load_timeout`` -- the deadline measures no progress."""
    worker, keys, _ = _worker(runtime, 1)
    worker.loader.max_inflight = 1
    worker.load_timeout = 0.3
    running = _slow_reads(monkeypatch, worker, 0.05)
    refs = _put_values(runtime, worker, keys, 18)  # 18 x 50 ms = 0.9 s of reads, one at a time
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", tuple(refs))]))
    t0 = time.monotonic()
    got: set[str] = set()
    while not got and time.monotonic() - t0 < 10:
        time.sleep(0.4)  # a long step: no poll meanwhile
        _, recving = worker.get_finished(set(), step_tokens=9)
        got |= recving or set()
    assert got == {"r"}
    assert time.monotonic() - t0 > 3 * worker.load_timeout
    assert worker.get_block_ids_with_load_errors() == set()
    assert running[1] == 1  # one read at a time: the values queued behind each other
    stats = worker.stats()
    assert stats is not None and not stats.data.get("load_failures")
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_load_whose_store_call_hangs_times_out_after_load_timeout(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that does not end (a store that ignores its own timeout): the request fails its blocks
    ``load_timeout`` after the call began and is reported, though the loader is otherwise busy."""
    worker, keys, _ = _worker(runtime, 1)
    worker.load_timeout = 0.3
    _slow_reads(monkeypatch, worker, 3.0)
    refs = _put_values(runtime, worker, keys, 2)
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", tuple(refs))]))
    t0 = time.monotonic()
    _receive(worker, "r")
    assert 0.3 <= time.monotonic() - t0 < 2.5
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_shutdown_bounds_the_wait_for_saves_and_says_how_many_it_abandoned(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine shutdown with saves in flight on a store that stopped answering: ``shutdown`` returns within
    its bound and one line says how many saves were in flight and how many were abandoned."""
    worker, _, caches = _worker(runtime, 1)
    for cache in caches.values():
        cache[20:23].normal_()
    backend_type = type(worker.store.backend)

    async def hung(self: object, items: Any) -> None:
        await asyncio.sleep(30)

    monkeypatch.setattr(backend_type, "put", hung)
    saves = [SaveSpec(f"r{v}", (ValueRef(bytes([v + 20]) * 32, (0,), ((20 + v,),)),)) for v in range(3)]
    meta = AsyncConnKVMetadata(saves=saves, step_tokens=3)
    worker.start_load_kv(meta)
    worker.save(meta)
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="asyncconn.vllm.kv.worker"):
        worker.close(timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    lines = [r.getMessage() for r in caplog.records if "KV connector shutdown" in r.getMessage()]
    assert lines == [
        "KV connector shutdown: 3 saves in flight, 0 finished within 0.3s, 3 abandoned (not in the store; "
        "those prompts are computed again on their next request)"
    ]
    assert not any(worker.held().values()), worker.held()


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_windowed_group_is_not_written_where_it_has_the_null_block(
    runtime: Runtime, tmp_path: Path, store: str
) -> None:
    """A hybrid model: layers 0 and 1 in a sliding-window group that has vLLM's null block (id 0) at the
    value's first position (outside the window at the cut), layer 2 in a full-attention group. The value
    lands whole in layer 2 and only at its second position in layers 0 and 1; block 0 is never written, and
    a failed value never names it as a load error."""
    url = f"file://{tmp_path}/store" if store == "file" else None
    groups = {"layer.0": 0, "layer.1": 0, "layer.2": 1}
    worker, keys, caches = _worker(runtime, 2, url, groups=groups)
    value = torch.randn(len(LAYERS), 2, 2, 16, 8)
    runtime.run(worker.store.put([(keys.store_key(b"\x01" * 32, 0), value)]))
    ref = ValueRef(b"\x01" * 32, (0, 1), ((0, 7), (5, 6)))
    missing = ValueRef(b"\x02" * 32, (0, 1), ((0, 9), (10, 11)))
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", (ref, missing))]))
    _receive(worker, "r")
    assert worker.get_block_ids_with_load_errors() == {9, 10, 11}  # never the null block
    for name in ("layer.0", "layer.1"):
        assert torch.equal(caches[name][7], value[LAYERS.index(name), 1])
        assert not caches[name][0].any()  # the null block: untouched
    assert torch.equal(caches["layer.2"][5], value[2, 0]) and torch.equal(caches["layer.2"][6], value[2, 1])
    assert not caches["layer.2"][0].any()
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_windowed_models_saves_are_gathered_before_save_returns(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM frees a sliding-window group's blocks while the request runs, and the next step may write them
    for another request: the step's blocks are copied on vLLM's thread before ``save`` returns (not later
    on the copy thread), so what is stored is what this step computed even if the blocks change at once."""
    from asyncconn.vllm.kv import saves as saves_module

    groups = {"layer.0": 0, "layer.1": 0, "layer.2": 1}
    worker, keys, caches = _worker(runtime, 1, groups=groups, windowed=True)
    assert isinstance(worker.saves, saves_module.CopyThreadSaves) and worker.saves.windowed
    threads: list[str] = []
    real = saves_module._gather_rows

    def gather(*args: Any) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(saves_module, "_gather_rows", gather)
    for cache in caches.values():
        cache[3:5].normal_()
    want = [torch.stack([caches[n][b].clone() for n in LAYERS]).unsqueeze(1) for b in (3, 4)]
    saves = [
        SaveSpec(
            "r", (ValueRef(b"\x05" * 32, (0,), ((3,), (3,))), ValueRef(b"\x06" * 32, (0,), ((4,), (4,))))
        )
    ]
    meta = AsyncConnKVMetadata(saves=saves, step_tokens=2)
    worker.start_load_kv(meta)
    worker.save(meta)
    assert threads == [threading.current_thread().name]
    for cache in caches.values():  # the next step reuses the blocks at once
        cache[3:5].zero_()
    deadline = time.monotonic() + 10
    while worker.get_finished({"r"})[0] != {"r"}:
        assert time.monotonic() < deadline, "saves not reported"
        time.sleep(0.001)
    got = runtime.run(worker.store.get([keys.store_key(b"\x05" * 32, 0), keys.store_key(b"\x06" * 32, 0)]))
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want, strict=True))
    worker.close()
    assert not any(worker.held().values()), worker.held()


class _SavesEndingLate:
    """A save tracker whose last save of ``rid`` completes while the worker asks ``pending`` (the tracker
    moves on in every call): what a real tracker does when a put lands between two of its calls."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.calls: list[str] = []
        self.finished: set[str] = set()
        self.requests = {rid}

    def pending(self, rid: str) -> int:
        self.calls.append("pending")
        if rid in self.requests:
            self.finished.add(rid)  # the last put lands now
        return 0

    def poll(self) -> set[str]:
        self.calls.append("poll")
        done, self.finished = self.finished, set()
        self.requests -= done
        return done


def test_a_request_reported_saved_is_forgotten_by_the_tracker_in_the_same_step(runtime: Runtime) -> None:
    """A request is reported in ``finished_sending`` only once the tracker has forgotten it too: an idle
    engine takes no further step in which a later ``poll`` would."""
    worker, _, _ = _worker(runtime, 1)
    real = worker.saver
    try:
        late = _SavesEndingLate("r")
        worker.saver = late  # type: ignore[assignment]
        worker._finishing.add("r")
        sending, _ = worker.get_finished(set())
        assert sending == {"r"}
        assert late.requests == set(), late.calls
    finally:
        worker.saver = real
        worker.close()


@pytest.mark.parametrize("num_groups", [1, 2])
def test_a_failed_load_is_reported_as_blocks_with_one_group_and_as_the_request_with_several(
    runtime: Runtime, num_groups: int
) -> None:
    """One KV cache group: the failed value's blocks (``get_block_ids_with_load_errors``), vLLM keeps the
    prefix before them. Several: block ids are per group and vLLM 0.32 stops its engine on them, so the
    request is reported (``failed_recving``) in the step that reports it received, and no block id. A load
    that did not fail is reported in neither."""
    worker, keys, _ = _worker(runtime, 1, num_groups=num_groups)
    (good,) = _put_values(runtime, worker, keys, 1)
    missing = ValueRef(b"\x09" * 32, (0,), ((5,),))
    worker.start_load_kv(
        AsyncConnKVMetadata(loads=[LoadSpec("bad", (good, missing)), LoadSpec("ok", (good,))])
    )
    _receive(worker, "bad", "ok")
    blocks, requests = worker.get_block_ids_with_load_errors(), worker.take_failed_recving()
    if num_groups == 1:
        assert (blocks, requests) == ({5}, set())
    else:
        assert (blocks, requests) == (set(), {"bad"})
    assert worker.take_failed_recving() == set()  # reported once
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_value_the_store_lost_since_its_lookup_is_reported_removed(runtime: Runtime) -> None:
    """With KV events on, a load that finds its value gone (a miss: the store let it go after the lookup
    found it) reports the key as removed, so routers hear of evictions a store never reports itself
    (Mooncake's); the value that loaded is not reported."""
    worker, keys, _ = _worker(runtime, 1, events=True)
    (good,) = _put_values(runtime, worker, keys, 1)
    missing = ValueRef(b"\x09" * 32, (0,), ((5,),))
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", (good, missing))]))
    _receive(worker, "r")
    report = worker.events_report()
    assert report is not None and report.removed == [keys.store_key(missing.value_hash, 0)]
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_over_a_host_tier_only_values_the_tier_holds_are_read_in_place(runtime: Runtime) -> None:
    """A host tier in front of a store that cannot serve reads from memory (here ``memory://``, as a remote
    store): a value the tier does not hold goes straight through staging (an in-place try would come back
    ``NOT_CACHED`` and be fetched again a poll later); once the tier holds it, it is read into the blocks."""
    worker, keys, caches = _worker(runtime, 1, host_cache_bytes=64 << 20)
    tier = worker.store.host_tier
    assert tier is not None and isinstance(worker.landings[0], InPlaceLanding)
    values = [torch.randn(len(LAYERS), 1, 2, 16, 8) for _ in range(4)]
    hashes = [bytes([v + 1]) * 32 for v in range(4)]
    runtime.run(worker.store.put([(keys.store_key(h, 0), v) for h, v in zip(hashes, values, strict=True)]))
    tier.lru.clear()  # cold: only the store has them

    def load(rid: str, first_block: int) -> None:
        refs = tuple(ValueRef(h, (0,), ((first_block + v,),)) for v, h in enumerate(hashes))
        worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec(rid, refs)]))
        _receive(worker, rid)
        assert worker.get_block_ids_with_load_errors() == set()
        for i, name in enumerate(LAYERS):
            for v in range(4):
                assert torch.equal(caches[name][first_block + v], values[v][i, 0]), (rid, name, v)

    load("cold", 4)
    totals = worker.loader.totals()
    assert totals.get("reads_in_place", 0) == 0 and totals.get("loaded_in_place", 0) == 0, totals
    assert tier.stats.misses == 4 and len(tier.lru) == 4  # read from the store, kept by the tier
    load("warm", 12)
    totals = worker.loader.totals()
    assert totals["loaded_in_place"] == 4, totals
    assert tier.stats.hits == 4
    worker.close()
    assert not any(worker.held().values()), worker.held()


def test_a_worker_close_keeps_to_one_deadline_whatever_hangs(runtime: Runtime) -> None:
    """vLLM terminates a worker that has not exited within its grace: the close's steps (cancel loads, let
    saves finish, close the store) share one deadline, whatever each of them waits for. Here the store
    hangs on every put and on its close: the close takes its timeout and the bounded last steps, not a
    timeout per step; the save it gave up is counted as failed."""
    from asyncconn.deadline import STORE_CLOSE_FLOOR_S
    from asyncconn.transfer import Failure
    from asyncconn.transfer.saver import CLOSE_CANCEL_S
    from asyncconn.vllm.shutdown import worker_close_budget
    from tests.transfer.fakes import GatedBackend

    class HungClose(GatedBackend):
        async def close(self) -> None:
            await self.gate.wait()

    backend = HungClose()  # its gate stays shut: puts and close hang
    identity = KVIdentity("worker-close", "", "float32", "default", 16, 2, 8, tuple(LAYERS), 1, 1)
    store = TensorStore(backend, name="hung")
    pool = PinnedPool(8 << 20)
    worker = KVWorkerSide(
        KeySpace(identity),
        store=store,
        loader=StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=pool),
        saver=SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=pool),
        runtime=runtime,
        layers=LAYERS,
        group_of_layer=dict.fromkeys(LAYERS, 0),
        num_blocks=NUM_BLOCKS,
    )
    worker.saver.submit("r", "k", torch.zeros(256))
    worker.saver.flush()
    assert backend.entered.wait(5)  # the put is hung in the store
    timeout = 1.0
    started = time.monotonic()
    worker.close(timeout)
    took = time.monotonic() - started
    assert took < timeout + CLOSE_CANCEL_S + STORE_CLOSE_FLOOR_S + 0.5, took  # one timeout, not three
    assert worker.saver.failures[Failure.STORE_ERROR] == 1
    assert pool.buffers_out == 0
    runtime.call_soon(backend.gate.set)
    # What the facade gives it: vLLM's grace (5 s unless VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) less a margin.
    assert 1.0 <= worker_close_budget() < 5.0
