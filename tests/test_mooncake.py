"""``mooncake://`` on a real ``mooncake_master`` (loopback ports, started by the fixtures).

The contract suite (tests/test_contract.py) runs on it too; these tests cover Mooncake's own failure
modes: eviction under memory pressure, a master frozen, killed and restarted, the bounded thread pool and
reads into caller memory that must be finished before a cancelled call returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from asyncconn.backend import open_backend
from asyncconn.exceptions import (
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
)
from asyncconn.store import Fetch, TensorStore
from backends._mooncake_layout import HEADER_SIZE, classify, code_name, pack_header, parse_header
from backends.mooncake import MooncakeBackend
from tests.servers_distributed import MooncakeMaster, find_mooncake_master


@pytest.fixture
def private_master() -> Iterator[MooncakeMaster]:
    """A master of our own, for tests that freeze, kill or restart it."""
    import mooncake.store  # noqa: F401  (installed by the README's test command; missing must fail)

    if find_mooncake_master() is None:
        pytest.fail("mooncake_master is not installed")
    master = MooncakeMaster().start()
    try:
        yield master
    finally:
        master.resume()
        master.stop()


@pytest.fixture
async def backend(mooncake_master: MooncakeMaster) -> AsyncIterator[MooncakeBackend]:
    b = await open_backend(
        mooncake_master.url(segment="128MiB", buffer="64MiB", timeout="3s", prefix=_prefix())
    )
    assert isinstance(b, MooncakeBackend)
    try:
        yield b
    finally:
        await b.close()
    assert b.thread_count() == 0 and b.jobs_in_flight() == 0


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}/"


def test_header_round_trip_and_foreign_bytes() -> None:
    assert parse_header(pack_header(0, 7)) == (0, 7) and parse_header(pack_header(5 << 30)) == (5 << 30, 0)
    assert len(pack_header(1)) == HEADER_SIZE
    assert parse_header(b"ACNF" + bytes(40)) is None  # a bare frame: not ours
    assert parse_header(pack_header(3)[:-1]) is None  # too short
    bumped = bytearray(pack_header(3))
    bumped[4] = 99  # a layout version this build does not know
    assert parse_header(bumped) is None


def test_status_codes_are_classified() -> None:
    for miss in (-704, -703, -707, -710, -712):
        assert classify(miss).miss and not classify(miss).retry
    for busy in (-200, -706, -714):
        assert classify(busy).retry and not classify(busy).miss
    assert classify(-900).unavailable and not classify(-600).unavailable
    assert "OBJECT_NOT_FOUND" in code_name(-704) and "(-12345)" in code_name(-12345)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("protocol=tcp", "'metadata' is required"),
        ("metadata=http://127.0.0.1:1/metadata&protocol=udp", "'protocol'"),
        ("metadata=http://127.0.0.1:1/metadata&segment=lots", "'segment'"),
        ("metadata=http://127.0.0.1:1/metadata&chunk_size=1MiB", "unknown parameter 'chunk_size'"),
    ],
)
async def test_bad_urls_name_the_problem(query: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        await open_backend(f"mooncake://127.0.0.1:50051?{query}")


async def test_two_masters_are_refused() -> None:
    with pytest.raises(ConfigError, match="one master"):
        await open_backend("mooncake://127.0.0.1:1,127.0.0.1:2?metadata=http://127.0.0.1:3/metadata")


async def test_a_missing_extra_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import of it now raises ImportError
    with pytest.raises(BackendNotInstalled, match=r"asyncconn\[mooncake\]"):
        await open_backend("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:3/metadata")


async def test_values_land_in_caller_memory_and_batches(backend: MooncakeBackend) -> None:
    store = TensorStore(backend, timeout=10)
    tensors = {f"t{i}": torch.randn(1000 * (i + 1)) for i in range(5)}
    await store.put(tensors.items())
    assert await backend.exists([*tensors, "absent"]) == [True] * 5 + [False]
    for name, tensor in tensors.items():
        out = torch.empty_like(tensor)
        assert await store.get_into(name, out) and torch.equal(out, tensor)
    # A value read into a destination of the wrong size is reported, and the destination is untouched.
    small = bytearray(b"\xee" * 64)
    length = await backend.get_into("t0", [memoryview(small)])
    assert length is not None and length > 64 and small == b"\xee" * 64
    large = bytearray(b"\xee" * 100_000)
    assert await backend.get_into("t0", [memoryview(large)]) == length and large == b"\xee" * 100_000


async def test_a_value_larger_than_the_transfer_buffer_is_refused_by_name(
    mooncake_master: MooncakeMaster,
) -> None:
    b = await open_backend(mooncake_master.url(segment="32MiB", buffer="1MiB", prefix=_prefix()))
    try:
        with pytest.raises(BackendError, match="'buffer'"):
            await b.put([("ok", b"x" * 1000), ("big", b"x" * (2 << 20))])
        assert await b.exists(["big"]) == [False]
    finally:
        await b.close()


async def test_eviction_under_memory_pressure_is_a_miss_never_a_torn_value(
    mooncake_master: MooncakeMaster,
) -> None:
    # A pool of 24 MiB (this client's segment; the contract tests' clients are closed by now) and 48
    # values of 1 MiB: the master evicts, and every read is the exact value or a miss.
    b = await open_backend(
        mooncake_master.url(segment="24MiB", buffer="16MiB", timeout="10s", prefix=_prefix())
    )
    try:
        store = TensorStore(b, timeout=15)
        tensors = {f"e{i}": torch.full((1 << 18,), float(i)) for i in range(48)}  # 1 MiB each
        for name, tensor in tensors.items():
            await store.put([(name, tensor)])
        got = await store.get(list(tensors))
        hits = [g is not None for g in got]
        assert not all(hits), "nothing was evicted: the test did not apply pressure"
        assert any(hits)
        for (name, tensor), value in zip(tensors.items(), got, strict=True):
            assert value is None or torch.equal(value, tensor), name
        for name, tensor in tensors.items():
            out = torch.zeros_like(tensor)
            if await store.get_into(name, out):
                assert torch.equal(out, tensor), name
        assert store.stats.corrupt == 0
    finally:
        await b.close()


async def test_frozen_master_times_out_and_a_cancelled_read_lets_go_of_the_buffer(
    private_master: MooncakeMaster,
) -> None:
    b = await open_backend(private_master.url(segment="32MiB", buffer="16MiB", timeout="1s"))
    assert isinstance(b, MooncakeBackend)
    try:
        await b.put([("v", b"x" * 4096)])
        private_master.pause()
        dest = bytearray(4096)
        task = asyncio.ensure_future(b.get_into("v", [memoryview(dest)]))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # It returned only once Mooncake was done with ``dest``: no call of ours is still running.
        assert b.jobs_in_flight() == 0
        with pytest.raises(BackendTimeout):
            await b.exists(["v"])
        private_master.resume()
        for _ in range(50):  # the pool's threads may still be stuck on the calls that timed out
            try:
                assert await b.exists(["v"]) == [True]
                break
            except BackendTimeout:
                await asyncio.sleep(0.1)
    finally:
        await b.close()
    assert b.thread_count() == 0 and b.jobs_in_flight() == 0


async def test_master_killed_and_restarted_mid_run(private_master: MooncakeMaster) -> None:
    b = await open_backend(private_master.url(segment="32MiB", buffer="16MiB", timeout="2s"))
    assert isinstance(b, MooncakeBackend)
    store = TensorStore(b, timeout=5)
    values = {f"k{i}": torch.full((10_000,), float(i)) for i in range(8)}
    try:
        await store.put(values.items())
        seen: list[str] = []

        async def traffic() -> None:
            for round_ in range(60):
                name = f"k{round_ % 8}"
                try:
                    await store.put([(name, values[name])])
                    out = torch.empty(10_000)
                    if await store.get_into(name, out):
                        assert torch.equal(out, values[name])  # a hit is always the whole value
                        seen.append("hit")
                    else:
                        seen.append("miss")
                except BackendError as exc:
                    assert isinstance(exc, (BackendUnavailable, BackendTimeout)), exc
                    seen.append("error")
                await asyncio.sleep(0.02)

        running = asyncio.ensure_future(traffic())
        await asyncio.sleep(0.3)
        await asyncio.to_thread(private_master.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(private_master.start)  # same ports
        await asyncio.wait_for(running, 120)  # a hang guard, not a timing assertion
        assert "error" in seen or "miss" in seen, seen
        # Recovery: the client re-registers with the new master; writes and reads work again.
        for _ in range(50):
            try:
                await store.put([("after", values["k1"])])
                break
            except BackendError:
                await asyncio.sleep(0.2)
        out = torch.empty(10_000)
        assert await store.get_into("after", out) and torch.equal(out, values["k1"])
    finally:
        await b.close()
    assert b.thread_count() == 0 and b.jobs_in_flight() == 0


async def test_calls_run_on_a_bounded_pool(mooncake_master: MooncakeMaster) -> None:
    b = await open_backend(
        mooncake_master.url(segment="32MiB", buffer="16MiB", workers="2", prefix=_prefix())
    )
    assert isinstance(b, MooncakeBackend)
    try:
        await b.put([(f"p{i}", bytes([i]) * 1000) for i in range(20)])
        results = await asyncio.gather(*(b.get([f"p{i}"]) for i in range(20)))
        assert [bytes(r[0][0]) for r in results if r[0]] == [bytes([i]) * 1000 for i in range(20)]
        assert 1 <= b.thread_count() <= 2
        assert await b.delete([f"p{i}" for i in range(20)] + ["absent"]) == 20
    finally:
        await b.close()
    assert b.thread_count() == 0 and b.jobs_in_flight() == 0
    with pytest.raises(BackendUnavailable, match="closed"):
        await b.exists(["p1"])


async def test_large_puts_replace_from_caller_memory_and_small_ones_upsert(backend: MooncakeBackend) -> None:
    """Values >= 1 MiB go by remove + gathered insert (no staging copy); they still replace, at any size."""
    assert backend.gather_puts  # TCP
    big = torch.randint(0, 255, (2 << 20,), dtype=torch.uint8)
    for value in (big, big.flip(0), big[: 1 << 20].clone(), torch.zeros(3 << 20, dtype=torch.uint8)):
        await backend.put([("g", [memoryview(value.numpy())])])
        (got,) = await backend.get(["g"])
        assert got is not None and b"".join(bytes(c) for c in got) == value.numpy().tobytes()
        dest = torch.empty_like(value)
        assert await backend.get_into("g", [memoryview(dest.numpy())]) == value.numel()
        assert torch.equal(dest, value)
    # A large read-only value (no address for a gathered insert) and a small one are upserted instead.
    for value_bytes in (bytes(big.numpy()), b"small"):
        await backend.put([("g", value_bytes)])
        (got,) = await backend.get(["g"])
        assert got is not None and b"".join(bytes(c) for c in got) == value_bytes
    # Through the tensor store (frame header read-only bytes + tensor payload), overwritten in place.
    store = TensorStore(backend, timeout=10)
    for fill in (1.0, 2.0):
        t = torch.full((1 << 19,), fill)  # 2 MiB
        await store.put([("frame", t)])
        out = torch.empty_like(t)
        assert await store.get_into("frame", out) and torch.equal(out, t)


async def test_a_read_torn_by_a_racing_write_is_never_handed_on(
    backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose bytes do not match the header's checksum is re-read once, or, once a sink has seen
    it, reported as a miss: the sink is never fed a torn value as if it were whole."""
    value = bytes(range(256)) * 4096  # 1 MiB
    await backend.put([("v", value)])
    tears = {"left": 0}

    class Tearing:
        """The real client, except that a read's landed bytes are overwritten mid-value while tears last."""

        def __init__(self, store: Any) -> None:
            self._real = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def batch_get_into_multi_buffers(
            self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
        ) -> list[int]:
            codes: list[int] = self._real.batch_get_into_multi_buffers(keys, ptrs, sizes)
            if tears["left"]:
                tears["left"] -= 1
                largest = max(range(len(sizes[0])), key=lambda i: sizes[0][i])  # the value, not a header
                ctypes.memset(ptrs[0][largest] + 1000, 0xAB, 4096)  # a racing writer's bytes, mid-value
            return codes

    monkeypatch.setattr(backend, "_store", Tearing(backend._store))
    dest = bytearray(len(value))
    tears["left"] = 1  # torn once: the re-read is whole
    assert await backend.get_into("v", [memoryview(dest)]) == len(value) and dest == value
    tears["left"] = 2  # torn twice in a row: a miss
    assert await backend.get_into("v", [memoryview(dest)]) is None
    fed: list[bytes] = []
    tears["left"] = 1  # with a sink: the first read was fed to it, so a miss, with nothing more fed after
    assert await backend.get_into("v", [memoryview(dest)], lambda piece: fed.append(bytes(piece))) is None
    assert b"".join(fed) != value and tears["left"] == 0
    fed.clear()
    assert await backend.get_into("v", [memoryview(dest)], lambda piece: fed.append(bytes(piece))) == len(
        value
    )
    assert b"".join(fed) == value and len(fed) > 1  # handed on in pieces, in order
    # TensorStore's frame verifier checks every byte itself, so the backend skips its own pass: a torn read
    # then fails the frame checksum -- a corrupt miss, never a tensor.
    store = TensorStore(backend, timeout=10)
    tensor = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    await store.put([("t", tensor)])
    out = torch.zeros_like(tensor)
    tears["left"] = 1
    assert await store.read_into("t", out) is Fetch.CORRUPT
    assert tears["left"] == 0 and store.stats.corrupt == 1
    assert await store.read_into("t", out) is Fetch.HIT and torch.equal(out, tensor)


async def test_workers_start_lazily_and_a_withdrawn_call_never_runs() -> None:
    """The backend's own worker threads: one thread serves sequential calls; a queued call whose caller
    gave up is withdrawn (never run); a running one is outlasted; shutdown stops every thread."""
    from backends.mooncake import _Job, _Workers

    workers = _Workers(1, "test-workers")
    loop = asyncio.get_running_loop()
    for i in range(5):
        job = _Job(lambda x: x * 2, (i,), loop)
        assert workers.submit(job)
        assert await job.future == i * 2
    assert workers.thread_count() == 1
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    blocker = _Job(lambda: (started.set(), gate.wait(10), ran.append("blocker")), (), loop)
    queued = _Job(lambda: ran.append("queued"), (), loop)
    assert workers.submit(blocker) and workers.submit(queued)
    assert workers.jobs_in_flight() == 2
    assert await asyncio.to_thread(started.wait, 10)  # the blocker runs; "queued" waits behind it
    await workers.outlast(queued)  # still queued behind the blocker: withdrawn at once
    outlasting = asyncio.ensure_future(workers.outlast(blocker))
    await asyncio.sleep(0.05)
    assert not outlasting.done()  # the blocker is running: it is waited for
    gate.set()
    await asyncio.wait_for(outlasting, 10)  # a hang guard, not a timing assertion
    assert ran == ["blocker"] and workers.jobs_in_flight() == 0
    failing = _Job(lambda: 1 // 0, (), loop)
    assert workers.submit(failing)
    with pytest.raises(ZeroDivisionError):
        await failing.future
    await asyncio.to_thread(workers.shutdown)
    assert workers.thread_count() == 0 and not workers.submit(_Job(int, (), loop))
    assert ran == ["blocker"]


async def test_racing_gathered_writers_never_leave_a_torn_value(backend: MooncakeBackend) -> None:
    """The contract suite's racing test, with writable 2 MiB values: the remove + gathered insert path."""
    values = [torch.randint(0, 256, (2 << 20,), dtype=torch.uint8) for _ in range(4)]
    wanted = {v.numpy().tobytes() for v in values}
    seen: list[bytes] = []

    async def writer(v: torch.Tensor) -> None:
        for _ in range(5):
            await backend.put([("contested", [memoryview(v.numpy())])])

    async def reader(direct: bool) -> None:
        dest = bytearray(2 << 20)
        for _ in range(15):
            if direct:
                if await backend.get_into("contested", [memoryview(dest)]) == len(dest):
                    seen.append(bytes(dest))
            else:
                (got,) = await backend.get(["contested"])
                if got is not None:
                    seen.append(b"".join(bytes(c) for c in got))
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(v) for v in values), reader(True), reader(False))
    (final,) = await backend.get(["contested"])
    assert final is not None and b"".join(bytes(c) for c in final) in wanted
    assert all(s in wanted for s in seen)
