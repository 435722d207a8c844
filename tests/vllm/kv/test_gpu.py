"""KV blocks saved from a ``[2, num_blocks, ...]`` (flash-attention) KV cache and loaded back into other
blocks hold exactly the saved bytes, even though the source blocks are overwritten right after the save (and
vLLM's ``handle_preemptions``, which precedes any reuse of a preempted request's blocks).
On an NVIDIA GPU (``gpu`` marker, skipped without CUDA) through the loader's and the save tracker's side
streams and pinned staging while the default stream keeps computing; the same test runs on the CPU device
everywhere. The worker side needs no vLLM: this runs where vLLM is not installed (the GPU proof machine)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.transfer.worker_sides import kv_one_polls_loads, kv_round_trip, kv_worker, saves_reported

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("where", DEVICES)
def test_blocks_round_trip_through_the_store(where: str) -> None:
    kv_round_trip(where)


@pytest.mark.parametrize("where", DEVICES)
def test_a_sync_load_is_in_its_blocks_for_the_next_kernel_on_the_default_stream(where: str) -> None:
    """``kv_sync_loads``: vLLM's forward runs on the default stream right after ``start_load_kv``."""
    kv_round_trip(where, sync=True)


def test_blocks_round_trip_through_synchronous_snapshots() -> None:
    """CUDA's save flow (the step gathered on vLLM's thread, one snapshot of the stack) on CPU tensors."""
    kv_round_trip("cpu", copy_thread=False)


@pytest.mark.parametrize("where", DEVICES)
def test_one_polls_loads_land_in_their_blocks(where: str) -> None:
    sizes = kv_one_polls_loads(where)
    # the path taken: on CUDA the seven targets in batches (two kernels per layer each), at least one of
    # several values (the loader may hand a value over early); on CPU none
    if where == "cuda":
        assert sum(sizes) == 7 and max(sizes) >= 2, sizes
    else:
        assert sizes == []


def test_a_batch_scatters_as_one_scatter_per_value_would() -> None:
    """The CUDA landing's batch (``CacheLayout.scatter_batch``) on CPU tensors: the same cache bytes as
    ``scatter`` value after value, for whole and partial values at scattered, reversed block ids."""
    from asyncconn.runtime import Runtime
    from asyncconn.vllm.kv.layout import rows_of_one
    from asyncconn.vllm.kv.loads import DeviceLanding
    from asyncconn.vllm.kv.metadata import ValueRef

    runtime = Runtime(name="kv-batch-logic").start()
    try:
        worker, caches = kv_worker("cpu", runtime)
        before = {n: c.clone() for n, c in caches.items()}
        assert worker.layout is not None
        layout = worker.layout
        landing = DeviceLanding(layout)
        shape = layout.value_shape
        rows = torch.randn(5, *shape).half()
        values = [rows[1], rows[4], rows[2], rows[3]]  # two runs of one tensor's rows, and not in order
        refs = [
            ValueRef(b"a" * 32, (0, 1), ((9, 3),)),
            ValueRef(b"b" * 32, (1,), ((40,),)),
            ValueRef(b"c" * 32, (0, 1), ((11, 12),)),
            ValueRef(b"d" * 32, (0, 1), ((63, 1),)),
        ]
        for value, ref in zip(values, refs, strict=True):
            landing.deliver(value, ref, None)
        landing.flush()
        batched = {n: c.clone() for n, c in caches.items()}
        for n, c in caches.items():  # the values as consecutive rows of one tensor, as the loader lands them
            c.copy_(before[n])
        run = rows_of_one([rows[1], rows[2], rows[3]])  # consecutive rows: the tensor itself, no copy
        assert run.data_ptr() == rows[1].data_ptr() and torch.equal(run, rows[1:4])
        apart = rows_of_one([rows[1], rows[3]])
        assert apart.data_ptr() != rows[1].data_ptr() and torch.equal(apart, torch.stack([rows[1], rows[3]]))
        for i, ref in zip((1, 2, 3), (refs[0], refs[2], refs[3]), strict=True):
            landing.deliver(rows[i], ref, None)
        landing.flush()
        for value, ref in ((rows[1], refs[0]), (rows[2], refs[2]), (rows[3], refs[3])):
            for index, (cache, _) in enumerate(layout.caches):
                got = cache.index_select(1, torch.tensor(ref.block_ids[0]))
                assert torch.equal(got, value[index]), ref
        for n, c in caches.items():
            c.copy_(before[n])
        for value, ref in zip(values, refs, strict=True):
            layout.scatter(value, ref)
        assert landing.batch == []
        for n, c in caches.items():
            assert torch.equal(batched[n], c), n
            assert not torch.equal(c, before[n])
        worker.close()
    finally:
        runtime.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_saves_and_loads_never_wait_for_the_default_stream() -> None:
    """With the forward's stream busy for a long while, ``wait_for_save`` (a gather at scattered block ids)
    and the poll that scatters landed values (scattered ids again) return while it is still busy: vLLM's
    thread never waits for the GPU to catch up. The bytes are right once the stream has run."""
    from asyncconn.runtime import Runtime
    from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef

    stream = torch.cuda.current_stream()
    runtime = Runtime(name="kv-no-sync").start()
    try:
        worker, caches = kv_worker("cuda", runtime)
        hashes = [bytes([30 + v]) * 32 for v in range(3)]
        sources = [(9, 2), (17, 5), (60, 1)]
        saved = {n: [c[:, list(b)].clone() for b in sources] for n, c in caches.items()}
        refs = tuple(ValueRef(h, (0, 1), (b,)) for h, b in zip(hashes, sources, strict=True))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the default stream
        worker.save(AsyncConnKVMetadata(saves=[SaveSpec("w", refs)]))
        assert not stream.query(), "wait_for_save waited for the default stream"
        saves_reported(worker, "w")

        targets = [(44, 3), (12, 50), (7, 8)]
        loads = tuple(ValueRef(h, (0, 1), (b,)) for h, b in zip(hashes, targets, strict=True))
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", loads)]))
        assert not stream.query(), "start_load_kv waited for the default stream"
        received: set[str] = set()
        deadline = time.monotonic() + 10
        while "r" not in received and time.monotonic() < deadline:
            torch.cuda.synchronize()  # the copies issued so far have ended: this poll scatters them
            torch.cuda._sleep(100_000_000)  # ~50 ms
            _, got = worker.get_finished(set())
            assert not stream.query(), "a poll that scatters waited for the default stream"
            received |= got or set()
        assert received == {"r"}
        torch.cuda.synchronize()
        for n, c in caches.items():
            for v, b in enumerate(targets):
                assert torch.equal(c[:, list(b)], saved[n][v]), (n, b)
        worker.close()
        assert not any(worker.held().values()), worker.held()
    finally:
        runtime.close()
