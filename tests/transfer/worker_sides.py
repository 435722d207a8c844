"""The connectors' worker sides driven end to end without an engine: KV blocks saved from and loaded into a
paged KV cache, an EC item saved, prefetched and installed. Used by the tests on CPU and on CUDA, in-process
and in a child process where vLLM cannot be imported (``python -m tests.transfer.worker_sides WHERE``).

Nothing here needs a server: the store is ``memory://``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
import uuid
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # not at run time: block_vllm must run before asyncconn is imported
    from asyncconn.runtime import Runtime
    from asyncconn.vllm.kv.worker import KVWorkerSide

HANG_GUARD = 10.0  # seconds


class _BlockVllm(importlib.abc.MetaPathFinder):
    """A finder that makes ``vllm`` unimportable, as on a machine where it is not installed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by the test)", name=fullname)
        return None


def block_vllm() -> None:
    """From now on ``import vllm`` fails as if vLLM were not installed (call before importing asyncconn)."""
    if any(name == "vllm" or name.startswith("vllm.") for name in sys.modules):
        raise RuntimeError("vllm is imported already: block it before anything imports it")
    sys.meta_path.insert(0, _BlockVllm())


def _sync(where: str) -> None:
    if where == "cuda":
        torch.cuda.synchronize()


def kv_worker(
    where: str, runtime: Runtime, *, copy_thread: bool | None = None
) -> tuple[KVWorkerSide, dict[str, torch.Tensor]]:
    """A :class:`KVWorkerSide` over ``memory://`` with a registered ``[2, 64, 16, 8, 128]`` fp16 cache of 4
    layers, its loader and save tracker on side streams of their own (``copy_thread``: the tracker's
    default, or a CPU tracker without its copy thread, which saves the way CUDA does)."""
    from asyncconn.store import TensorStore
    from asyncconn.transfer import PinnedPool, SaveTracker, StreamLoader, engine_devices
    from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
    from asyncconn.vllm.kv.worker import KVWorkerSide

    layers = [f"layer.{i}" for i in range(4)]
    identity = KVIdentity("worker-sides", "", "float16", "default", 16, 8, 128, tuple(layers), 1, 2)
    store = runtime.run(TensorStore.open(f"memory://kv-sides-{uuid.uuid4().hex[:8]}"), timeout=10)
    load_device, save_device = engine_devices(where)
    pool = PinnedPool(64 << 20, device=load_device)
    worker = KVWorkerSide(
        KeySpace(identity),
        store=store,
        loader=StreamLoader(store, runtime=runtime, device=load_device, pool=pool, rows=True),
        saver=SaveTracker(store, runtime=runtime, device=save_device, pool=pool, copy_thread=copy_thread),
        runtime=runtime,
        layers=layers,
        group_of_layer=dict.fromkeys(layers, 0),
        num_blocks=64,
    )
    caches = {n: torch.randn(2, 64, 16, 8, 128, device=where, dtype=torch.float16) for n in layers}
    worker.register_kv_caches(caches)
    return worker, caches


def saves_reported(worker: KVWorkerSide, rid: str) -> None:
    """Poll ``get_finished`` (telling the worker ``rid`` is finished) until it reports ``rid``'s saves."""
    sent: set[str] = set()
    deadline = time.monotonic() + HANG_GUARD
    while rid not in sent and time.monotonic() < deadline:
        done, _ = worker.get_finished({rid} if not sent else set())
        sent |= done or set()
        time.sleep(0.001)
    assert sent == {rid}, "the saves were not reported"


def kv_round_trip(where: str, *, copy_thread: bool | None = None, sync: bool = False) -> None:
    """KV values saved from blocks 4..7 of a ``[2, num_blocks, ...]`` cache, the blocks rewritten at once
    (preemption), then loaded back into blocks 40..43 while the default stream computes: equal bytes.
    ``sync``: a sync load (``kv_sync_loads``), read from the default stream as soon as ``start_load_kv``
    returns -- as vLLM's forward does -- and never reported."""
    from asyncconn.runtime import Runtime
    from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef

    runtime = Runtime(name=f"kv-sides-{where}").start()
    try:
        worker, caches = kv_worker(where, runtime, copy_thread=copy_thread)
        layers = list(caches)
        hashes = [bytes([i]) * 32 for i in range(2)]
        saved = {n: c[:, 4:8].clone() for n, c in caches.items()}
        refs = tuple(ValueRef(hashes[v], (0, 1), ((4 + 2 * v, 5 + 2 * v),)) for v in range(2))
        worker.save(AsyncConnKVMetadata(saves=[SaveSpec("r1", refs)]))
        worker.handle_preemptions(AsyncConnKVMetadata(preempted=frozenset({"r1"})))
        for n in layers:  # the blocks are reused right away: the snapshot must not see this
            caches[n][:, 4:8].zero_()
        saves_reported(worker, "r1")

        side = 2048 if where == "cuda" else 64
        a = torch.randn(side, side, device=where)
        targets = tuple(ValueRef(hashes[v], (0, 1), ((40 + 2 * v, 41 + 2 * v),)) for v in range(2))
        if sync:
            worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r2", targets, sync=True)]))
            loaded = {n: caches[n][:, 40:44].clone() for n in layers}  # queued after the load's writes
            assert worker.get_finished(set()) == (None, None)  # a sync load is never reported
        else:
            worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r2", targets)]))
            for _ in range(10):
                a = a @ a  # default-stream work while the loads run on the loader's side stream
                a = a / a.norm()
            received: set[str] = set()
            deadline = time.monotonic() + HANG_GUARD
            while "r2" not in received and time.monotonic() < deadline:
                _, got = worker.get_finished(set())
                received |= got or set()
                time.sleep(0.001)
            assert received == {"r2"}, "the loads were not reported"
            loaded = {n: caches[n][:, 40:44] for n in layers}
        assert worker.get_block_ids_with_load_errors() == set()
        _sync(where)
        for n in layers:
            assert torch.equal(loaded[n], saved[n]), f"{n}: not the saved bytes"
        worker.close()
        assert not any(worker.held().values()), worker.held()
        copier = worker.saver.copy_thread  # CPU: the snapshots ran there; close joined it
        expected = where == "cpu" and copy_thread is not False
        assert (copier is not None) == expected and (copier is None or not copier.alive)
    finally:
        runtime.close()


def kv_one_polls_loads(where: str) -> list[int]:
    """Six values saved from blocks 0..11, then loaded in one step by three requests into scattered,
    reversed blocks -- one request wants only the second block of a value, two want the same value -- and
    collected by one poll after every copy has ended: each block holds exactly its saved bytes. Returns the
    sizes of the batches the worker scattered (CUDA: one of seven; CPU scatters from the lent staging
    buffer, value by value, so none)."""
    from asyncconn.runtime import Runtime
    from asyncconn.vllm.kv.loads import DeviceLanding, HostLanding
    from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef

    runtime = Runtime(name=f"kv-batch-{where}").start()
    try:
        worker, caches = kv_worker(where, runtime)
        hashes = [bytes([10 + v]) * 32 for v in range(6)]
        saved = {n: c[:, 0:12].clone() for n, c in caches.items()}
        refs = tuple(ValueRef(hashes[v], (0, 1), ((2 * v, 2 * v + 1),)) for v in range(6))
        worker.save(AsyncConnKVMetadata(saves=[SaveSpec("w", refs)]))
        saves_reported(worker, "w")

        # (request, value, its block positions, the blocks they go to)
        plan = [
            ("r1", 0, (0, 1), (40, 33)),
            ("r1", 1, (0, 1), (30, 31)),
            ("r1", 2, (0, 1), (63, 13)),
            ("r1", 3, (0, 1), (50, 49)),
            ("r2", 4, (0, 1), (20, 21)),
            ("r2", 5, (1,), (25,)),
            ("r3", 0, (0, 1), (36, 37)),
        ]
        loads: dict[str, list[ValueRef]] = {}
        for rid, v, positions, blocks in plan:
            loads.setdefault(rid, []).append(ValueRef(hashes[v], positions, (blocks,)))
        sizes: list[int] = []
        landing = worker.landing
        assert isinstance(landing, DeviceLanding if where == "cuda" else HostLanding)
        if isinstance(landing, DeviceLanding):  # the only landing that holds values for the end of a poll
            batch_of_one_poll = landing.flush

            def spy() -> None:
                if landing.batch:  # what one poll hands over, written together
                    sizes.append(len(landing.batch))
                batch_of_one_poll()

            setattr(landing, "flush", spy)  # an instance-level spy
        worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec(r, tuple(v)) for r, v in loads.items()]))
        assert worker.loader.wait(HANG_GUARD), "the fetches did not land"
        worker.poll()  # every value is in staging: their copies are issued together
        _sync(where)
        received: set[str] = set()
        deadline = time.monotonic() + HANG_GUARD
        while received != set(loads) and time.monotonic() < deadline:
            _, got = worker.get_finished(set())
            received |= got or set()
        assert received == set(loads), "the loads were not reported"
        assert worker.get_block_ids_with_load_errors() == set()
        _sync(where)
        for n, cache in caches.items():
            for rid, v, positions, blocks in plan:
                for p, b in zip(positions, blocks, strict=True):
                    assert torch.equal(cache[:, b], saved[n][:, 2 * v + p]), f"{n} block {b} ({rid})"
        worker.close()
        assert not any(worker.held().values()), worker.held()
        return sizes
    finally:
        runtime.close()


def ec_save_prefetch_install(where: str) -> None:
    """A 7 MiB embedding saved by a producer worker, prefetched and installed by a consumer worker: the
    installed tensor is the staged one (no copy on the forward path) and holds the saved bytes."""
    from asyncconn.config import Settings
    from asyncconn.runtime import Runtime
    from asyncconn.transfer import default_device
    from asyncconn.vllm.ec.metadata import ECStepMetadata, ItemRef
    from asyncconn.vllm.ec.worker import ECWorkerSide

    url = f"memory://ec-sides-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_extra_config(
        {"backend_url": url, "pinned_pool_bytes": "64MiB", "ec_max_row_bytes": "8KiB"}
    )
    runtime = Runtime(name=f"ec-sides-{where}").start()
    try:
        producer = ECWorkerSide(
            settings, producer=True, consumer=False, runtime=runtime, device=default_device(where)
        )
        consumer = ECWorkerSide(
            settings, producer=False, consumer=True, runtime=runtime, device=default_device(where)
        )
        emb = torch.randn(1792, 2048, device=where).to(torch.bfloat16)  # 7 MiB
        expected = emb.cpu()
        producer.save_caches({"img": emb}, "img")
        deadline = time.monotonic() + HANG_GUARD
        while producer.has_pending_saves() and time.monotonic() < deadline:
            producer.end_step()
            time.sleep(0.001)
        assert not producer.has_pending_saves(), "the save did not finish"

        cache: dict[str, torch.Tensor] = {}
        consumer.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img", 1792)]))
        deadline = time.monotonic() + HANG_GUARD
        ready: set[str] = set()
        while "img" not in ready and time.monotonic() < deadline:
            consumer.poll()
            report = consumer.report()
            assert not report.failed, report.failed
            ready |= set(report.ready)
            time.sleep(0.001)
        assert ready == {"img"}, "the prefetch did not land"
        staged = consumer._staged["img"]
        consumer.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img", 1792)]))
        assert cache["img"] is staged, "the install copied the staged tensor"
        assert cache["img"].device.type == where
        _sync(where)
        assert torch.equal(cache["img"].cpu().view(torch.uint8), expected.view(torch.uint8))
        cache.clear()
        for worker in (producer, consumer):
            worker.close()
            assert all(v == 0 for v in worker.held().values()), worker.held()
    finally:
        runtime.close()


def main(argv: list[str]) -> int:
    """``python -m tests.transfer.worker_sides WHERE [--block-vllm]``: exit 0 when both round trips pass and
    vLLM was never imported."""
    where = argv[0] if argv else "cpu"
    if "--block-vllm" in argv:
        block_vllm()
    kv_round_trip(where)
    ec_save_prefetch_install(where)
    imported = sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm."))
    if imported:
        print(f"vllm was imported: {imported[:5]}", file=sys.stderr)
        return 1
    print(f"worker sides ok on {where} without vllm")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
