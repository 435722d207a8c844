"""``mooncake://`` on a real ``mooncake_master`` (loopback ports, started by the fixtures).

The contract suite (tests/backends/test_contract.py) runs on it too; these tests cover Mooncake's own failure
modes: eviction under memory pressure, a master frozen, killed and restarted, the bounded thread pool and
reads into caller memory that must be finished before a cancelled call returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from asyncconn_backends.mooncake.backend import _GATHER_MIN, MooncakeBackend
from asyncconn_backends.mooncake.layout import (
    FLAG_SELF_CHECKED,
    HEADER_SIZE,
    checksum,
    classify,
    code_name,
    pack_header,
    parse_header,
)

from asyncconn.backend import open_backend
from asyncconn.exceptions import (
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
)
from asyncconn.store import Fetch, TensorStore
from tests.servers_distributed import MooncakeMaster


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
    assert parse_header(pack_header(0, 7)) == (0, 7, 0)
    assert parse_header(pack_header(5 << 30)) == (5 << 30, 0, 0)
    assert parse_header(pack_header(9, flags=FLAG_SELF_CHECKED)) == (9, 0, FLAG_SELF_CHECKED)
    assert len(pack_header(1)) == HEADER_SIZE
    assert parse_header(pack_header(3, flags=2)) is None  # a flag this build does not know
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
        assert not task.done(), "the frozen master answered: pause() returned before it was stopped"
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

        async def read(name: str) -> str:
            out = torch.empty(10_000)
            try:
                if await store.get_into(name, out):
                    assert torch.equal(out, values[name])  # a hit is always the whole value
                    return "hit"
                return "miss"
            except BackendError as exc:
                assert isinstance(exc, (BackendUnavailable, BackendTimeout)), exc
                return "error"

        async def traffic() -> None:
            for round_ in range(60):
                # A single put and read, then a batch put (one batch_remove + one gathered insert) and
                # concurrent reads (the first alone, the others coalesced into one request).
                names = [f"k{round_ % 8}"] if round_ % 2 else [f"k{(round_ + i) % 8}" for i in range(4)]
                try:
                    await store.put([(name, values[name]) for name in names])
                except BackendError as exc:
                    assert isinstance(exc, (BackendUnavailable, BackendTimeout)), exc
                    seen.append("error")
                seen.extend(await asyncio.gather(*(read(name) for name in names)))
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
    """Values >= 4 MiB go by remove + gathered insert (no staging copy); they still replace, at any size."""
    assert backend.gather_puts  # TCP
    big = torch.randint(0, 255, (_GATHER_MIN,), dtype=torch.uint8)
    small = big[: _GATHER_MIN // 2].clone()
    for value in (big, big.flip(0), small, torch.zeros(_GATHER_MIN + 1, dtype=torch.uint8)):
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
        t = torch.full((_GATHER_MIN // 4,), fill)  # gathered: frame header + payload
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
    tears = {"left": 0, "min_keys": 1}

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
            if tears["left"] and len(keys) >= tears["min_keys"]:
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
    # In a coalesced request (the first read goes alone, the next two together): the torn one is re-read
    # alone, and every reader gets the whole value.
    await backend.put([(f"c{i}", value) for i in range(3)])
    dests = [bytearray(len(value)) for _ in range(3)]
    tears.update(left=1, min_keys=2)  # only a request of two keys or more: the batch's first key (c1)
    got = await asyncio.gather(*(backend.get_into(f"c{i}", [memoryview(dests[i])]) for i in range(3)))
    assert got == [len(value)] * 3 and tears["left"] == 0 and all(d == value for d in dests)


async def test_workers_start_lazily_and_a_withdrawn_call_never_runs() -> None:
    """The backend's own worker threads: one thread serves sequential calls; a queued call whose caller
    gave up is withdrawn (never run); a running one is outlasted; shutdown stops every thread."""
    from asyncconn_backends.mooncake.pool import Job, Workers

    workers = Workers(1, "test-workers")
    loop = asyncio.get_running_loop()
    for i in range(5):
        job = Job(lambda x: x * 2, (i,), loop)
        assert workers.submit(job)
        assert await job.future == i * 2
    assert workers.thread_count() == 1
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    blocker = Job(lambda: (started.set(), gate.wait(10), ran.append("blocker")), (), loop)
    queued = Job(lambda: ran.append("queued"), (), loop)
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
    failing = Job(lambda: 1 // 0, (), loop)
    assert workers.submit(failing)
    with pytest.raises(ZeroDivisionError):
        await failing.future
    await asyncio.to_thread(workers.shutdown)
    assert workers.thread_count() == 0 and not workers.submit(Job(int, (), loop))
    assert ran == ["blocker"]


async def test_racing_gathered_writers_never_leave_a_torn_value(backend: MooncakeBackend) -> None:
    """The contract suite's racing test, with writable 4 MiB values: the remove + gathered insert path."""
    values = [torch.randint(0, 256, (_GATHER_MIN,), dtype=torch.uint8) for _ in range(4)]
    wanted = {v.numpy().tobytes() for v in values}
    seen: list[bytes] = []

    async def writer(v: torch.Tensor) -> None:
        for _ in range(5):
            await backend.put([("contested", [memoryview(v.numpy())])])

    async def reader(direct: bool) -> None:
        dest = bytearray(_GATHER_MIN)
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


async def test_an_object_an_upsert_has_not_written_yet_is_a_miss_on_every_read_path(
    backend: MooncakeBackend,
) -> None:
    """Mooncake 0.3.13 serves a read racing an ``upsert`` of the key an object whose bytes are not written
    yet: all zeros, header included (the contract suite's racing test saw one in 16 of 100 rounds). Written
    here on purpose, under our key, with the exact size of a value: every read path makes it a miss. Before,
    ``get`` handed the zeros up (header and all) and ``get_into`` answered "the value landed"."""
    size = 64 << 10
    value = bytes(range(256)) * (size // 256)
    await backend.put([("whole", value)])
    assert backend._store.upsert(backend._key("unwritten"), bytes(HEADER_SIZE + size)) == 0
    unwritten, whole = await backend.get(["unwritten", "whole"])
    assert unwritten is None and whole is not None and b"".join(bytes(c) for c in whole) == value
    dest = bytearray(b"\xee" * size)
    assert await backend.get_into("unwritten", [memoryview(dest)]) is None
    fed: list[bytes] = []
    assert await backend.get_into("unwritten", [memoryview(dest)], lambda p: fed.append(bytes(p))) is None
    assert fed == []  # the sink never sees bytes that failed the header check
    # Read together (the first alone, the others in one request): each answered as alone.
    dests = [bytearray(size) for _ in range(4)]
    keys = ["whole", "unwritten"] * 2
    reads = (backend.get_into(k, [memoryview(d)]) for k, d in zip(keys, dests, strict=True))
    got = await asyncio.gather(*reads)
    assert got == [size, None, size, None] and dests[0] == dests[2] == value
    # TensorStore on top: a miss, never a tensor.
    store = TensorStore(backend, timeout=10)
    assert await store.get(["unwritten"]) == [None]
    assert not await store.get_into("unwritten", torch.empty(size // 4, dtype=torch.float32))


async def test_an_upsert_that_lost_its_object_to_a_racing_writer_is_retried(
    backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four writers of one key: Mooncake 0.3.13 sometimes ends an ``upsert_parts`` with OBJECT_NOT_FOUND (a
    racing upsert replaced the object it was writing). Nothing was written: the put tries again instead of
    failing."""
    lost = {"left": 2}

    class Racing:
        def __init__(self, store: Any) -> None:
            self._real = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def upsert_parts(self, *args: Any, **kwargs: Any) -> int:
            if lost["left"]:
                lost["left"] -= 1
                return -704  # OBJECT_NOT_FOUND, as "Failed to end upsert operation" answers it
            code: int = self._real.upsert_parts(*args, **kwargs)
            return code

    monkeypatch.setattr(backend, "_store", Racing(backend._store))
    await backend.put([("k", b"v" * 1000)])
    (got,) = await backend.get(["k"])
    assert lost["left"] == 0 and got is not None and b"".join(bytes(c) for c in got) == b"v" * 1000


async def test_frames_are_stored_self_checked_and_a_damaged_one_is_a_corrupt_miss(
    backend: MooncakeBackend,
) -> None:
    """``TensorStore`` hands frames over as ``SelfChecked``: stored without a checksum of ours (the frame
    has its own), while plain values keep it. A frame damaged in the store is still caught, by the reader."""
    raw = backend._store
    store = TensorStore(backend, timeout=10)
    for size in (1 << 10, _GATHER_MIN):  # an upserted value and a gathered one
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
        key = f"sc{size}"
        await store.put([(key, tensor)])
        stored = bytes(raw.get(backend._key(key)))
        header = parse_header(stored)
        assert header is not None and header[1:] == (0, FLAG_SELF_CHECKED)
        out = torch.empty_like(tensor)
        assert await store.read_into(key, out) is Fetch.HIT and torch.equal(out, tensor)
        (got,) = await store.get([key])
        assert got is not None and torch.equal(got, tensor)
        # One payload byte flipped in the store (a frame still claiming its old checksum): never a tensor.
        damaged = bytearray(stored)
        damaged[-1] ^= 0xFF
        assert raw.upsert(backend._key(key), bytes(damaged)) == 0
        corrupt = store.stats.corrupt
        assert await store.read_into(key, out) is Fetch.CORRUPT
        assert await store.get([key]) == [None]
        assert store.stats.corrupt == corrupt + 2
    # A plain value (not a frame) keeps the backend's own checksum.
    await backend.put([("plain", b"abc" * 1000)])
    header = parse_header(bytes(raw.get(backend._key("plain"))))
    assert header is not None and header[1:] == (checksum([b"abc" * 1000]), 0)


async def test_a_batch_is_written_together_and_what_it_missed_one_by_one(
    backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several values go as one batch remove + one gathered insert; they replace existing values; a value
    the batch insert did not write (a busy answer) is written again on its own; a batch naming one key twice
    is written in order (the last value wins)."""
    calls: list[str] = []
    refuse = {"left": 0}

    class Counting:
        def __init__(self, store: Any) -> None:
            self._real = store

        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(self._real, name)

        def batch_put_from_multi_buffers(self, keys: list[str], *args: Any) -> list[int]:
            calls.append("batch_put_from_multi_buffers")
            codes: list[int] = self._real.batch_put_from_multi_buffers(keys, *args)
            if refuse["left"]:
                refuse["left"] -= 1
                self._real.remove(keys[0], True)
                codes[0] = -714  # OBJECT_REPLICA_BUSY: may pass, so it is retried alone
            return codes

    monkeypatch.setattr(backend, "_store", Counting(backend._store))
    values = [torch.full((64 << 10,), i, dtype=torch.uint8) for i in range(8)]
    for round_ in range(2):  # fresh keys, then the same keys replaced
        calls.clear()
        batch = [(f"b{i}", [memoryview((v + round_).numpy())]) for i, v in enumerate(values)]
        await backend.put(batch)
        assert calls.count("batch_remove") == 1 and calls.count("batch_put_from_multi_buffers") == 1
        assert "upsert_parts" not in calls and "remove" not in calls
        got = await backend.get([k for k, _ in batch])
        assert [b"".join(bytes(c) for c in g or ()) for g in got] == [bytes(p[0]) for _, p in batch]
    calls.clear()
    refuse["left"] = 1
    await backend.put([(f"b{i}", b"x%d" % i) for i in range(3)])
    assert calls.count("batch_put_from_multi_buffers") == 2  # the batch, then b0 alone
    assert [b"".join(bytes(c) for c in g or ()) for g in await backend.get(["b0", "b1", "b2"])] == [
        b"x0",
        b"x1",
        b"x2",
    ]
    await backend.put([("dup", b"first"), ("dup", b"second")])
    (got,) = await backend.get(["dup"])
    assert got is not None and b"".join(bytes(c) for c in got) == b"second"


async def test_reads_queued_together_go_as_one_request_and_each_is_answered_as_alone(
    backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first direct read of a loop iteration goes alone; the others started in that iteration share one
    ``batch_get_into_multi_buffers``. A miss, a destination of the wrong size and a foreign value among them
    get the answers they would get alone (a torn one is covered by the tearing test below), and a read
    cancelled before its batch is sent is withdrawn without disturbing the others."""
    requests: list[int] = []

    class Counting:
        def __init__(self, store: Any) -> None:
            self._real = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> list[int]:
            requests.append(len(keys))
            result: list[int] = self._real.batch_get_into_multi_buffers(keys, *args)
            return result

    values = {f"r{i}": bytes([i]) * (1000 + i) for i in range(12)}
    await backend.put(list(values.items()))
    assert backend._store.upsert(backend._key("foreign"), b"not ours" * 100) == 0
    monkeypatch.setattr(backend, "_store", Counting(backend._store))
    dests = {k: bytearray(len(v)) for k, v in values.items()}
    wrong = bytearray(10)
    foreign = bytearray(800 - HEADER_SIZE)
    missing = bytearray(10)
    got = await asyncio.gather(
        *(backend.get_into(k, [memoryview(d)]) for k, d in dests.items()),
        backend.get_into("r0", [memoryview(wrong)]),
        backend.get_into("foreign", [memoryview(foreign)]),
        backend.get_into("absent", [memoryview(missing)]),
    )
    # The foreign object has exactly the size asked for, but no header of ours: a miss, not "it landed".
    assert got == [len(v) for v in values.values()] + [1000, None, None]
    assert all(dests[k] == v for k, v in values.items())
    # The first read alone, then one request for the 14 others (r0 again among them: distinct from the first
    # read's request); the odd ones (wrong size, foreign) are answered from that request, not read again.
    assert sorted(requests) == [1, 14]
    # 40 reads at once: split into requests of at most _READ_BATCH names
    await backend.put([(f"m{i}", b"%04d" % i) for i in range(40)])
    requests.clear()
    many = [bytearray(4) for _ in range(40)]
    got = await asyncio.gather(*(backend.get_into(f"m{i}", [memoryview(m)]) for i, m in enumerate(many)))
    assert got == [4] * 40 and [bytes(m) for m in many] == [b"%04d" % i for i in range(40)]
    assert sorted(requests) == [1, 7, 32]
    # A read cancelled before its batch was sent: withdrawn; the others in that batch are unaffected. (The
    # send is delayed one more loop iteration here, so the cancellation lands first.)
    loop = asyncio.get_running_loop()
    send = backend._send_reads
    monkeypatch.setattr(backend, "_send_reads", lambda reads: loop.call_soon(send, reads))
    requests.clear()
    lead = asyncio.ensure_future(backend.get_into("r5", [memoryview(dests["r5"])]))  # goes alone
    doomed = asyncio.ensure_future(backend.get_into("r1", [memoryview(bytearray(1001))]))
    kept = asyncio.ensure_future(backend.get_into("r2", [memoryview(dests["r2"])]))
    await asyncio.sleep(0)  # all three started, the batch of the last two not yet sent
    doomed.cancel()
    assert await kept == 1002 and await lead == 1005 and doomed.cancelled()
    assert requests == [1, 1] and backend.jobs_in_flight() == 0  # the batch held only kept
    # Cancelled after the send: it waits for the request to end (its buffer is Mooncake's until then).
    monkeypatch.setattr(backend, "_send_reads", send)
    requests.clear()
    lead = asyncio.ensure_future(backend.get_into("r5", [memoryview(dests["r5"])]))
    late = asyncio.ensure_future(backend.get_into("r3", [memoryview(dests["r3"])]))
    other = asyncio.ensure_future(backend.get_into("r4", [memoryview(dests["r4"])]))
    for _ in range(2):
        await asyncio.sleep(0)
    late.cancel()
    assert await other == 1004 and await lead == 1005
    with pytest.raises(asyncio.CancelledError):
        await late
    assert sorted(requests) == [1, 2] and backend.jobs_in_flight() == 0 and dests["r3"] == values["r3"]


async def test_the_side_by_side_benchmark_runs(mooncake_master: MooncakeMaster) -> None:
    """``asyncconn bench mooncake`` (the figures in docs/benchmarks.md), tiny sizes: it runs and
    reports every ratio it promises."""
    from asyncconn_tools.bench.mooncake import _bench

    url = mooncake_master.url(segment="64MiB", buffer="32MiB", timeout="5s", prefix=_prefix())
    out = await _bench(url, [64 << 10], 1, 2, 2, 4, 4 << 10)
    (size,) = out["sizes"]
    assert size["put_vs_raw_put"] > 0 and size["get_vs_raw_get"] > 0 and size["clients_2_get_vs_raw_get"] > 0
    assert out["batch"]["values"] == 4 and out["batch"]["get_vs_raw_get"] > 0
    close = out["close"]
    assert 0 < close["longest_stall_ms"] <= close["seconds"] * 1e3 + 50  # the ticker ran during the close
