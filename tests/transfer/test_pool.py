"""PinnedPool: size classes, reuse, the byte bound, back-pressure and misuse."""

from __future__ import annotations

import pytest
import torch

from asyncconn.exceptions import PoolTooSmall, TransferError
from asyncconn.transfer import CpuDevice, PinnedPool
from asyncconn.transfer.pool import size_class


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(0) == 4096
    assert size_class(1) == 4096
    assert size_class(4096) == 4096
    assert size_class(4097) == 8192
    assert size_class(3 << 20) == 4 << 20
    assert size_class(100, minimum=64) == 128


def test_released_buffers_are_reused_not_reallocated() -> None:
    pool = PinnedPool(1 << 20)
    a = pool.acquire(5000)
    assert a is not None and a.size_class == 8192 and a.nbytes == 5000
    pool.release(a)
    b = pool.acquire(7000)
    assert b is a  # same class, same memory
    assert pool.allocations == 1
    pool.release(b)
    assert pool.buffers_out == 0 and pool.bytes_out == 0


def test_view_is_a_typed_window_on_the_same_memory() -> None:
    pool = PinnedPool(1 << 20)
    buf = pool.acquire(4 * 6)
    assert buf is not None
    view = buf.view(torch.float32, (2, 3))
    view.fill_(1.5)
    assert buf.storage[:24].view(torch.float32).tolist() == [1.5] * 6
    with pytest.raises(TransferError):
        buf.view(torch.float32, (4096,))
    pool.release(buf)


def test_repeated_views_are_one_tensor_and_other_shapes_are_fresh_windows() -> None:
    pool = PinnedPool(1 << 20)
    buf = pool.acquire(4 * 6)
    assert buf is not None
    first = buf.view(torch.float32, (2, 3))
    assert buf.view(torch.float32, [2, 3]) is first  # the loop and the worker view it alike, load after load
    flat = buf.view(torch.float32, (6,))
    as_ints = buf.view(torch.int32, (2, 3))
    assert flat is not first and flat.shape == (6,) and as_ints.dtype == torch.int32
    flat.copy_(torch.arange(6, dtype=torch.float32))
    assert buf.view(torch.float32, (2, 3)).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    pool.release(buf)


def test_full_pool_answers_not_now_then_serves_after_a_release() -> None:
    pool = PinnedPool(16384)
    held = [pool.acquire(4096) for _ in range(4)]
    assert all(b is not None for b in held)
    assert pool.acquire(1) is None
    assert pool.refusals == 1
    assert pool.bytes_reserved <= pool.capacity
    first = held[0]
    assert first is not None
    pool.release(first)
    again = pool.acquire(100)
    assert again is first
    for b in [again, *held[1:]]:
        assert b is not None
        pool.release(b)
    assert pool.buffers_out == 0


def test_idle_buffers_of_another_class_are_dropped_to_make_room() -> None:
    pool = PinnedPool(16384)
    small = [pool.acquire(4096) for _ in range(4)]
    for b in small:
        assert b is not None
        pool.release(b)
    assert pool.bytes_reserved == 16384
    big = pool.acquire(16384)  # needs every byte: all idle 4 KiB buffers go
    assert big is not None and big.size_class == 16384
    assert pool.bytes_reserved == 16384
    pool.release(big)


def test_idle_buffers_are_kept_when_dropping_them_cannot_make_enough_room() -> None:
    pool = PinnedPool(16384)
    held = pool.acquire(8192)
    idle = pool.acquire(4096)
    assert held is not None and idle is not None
    pool.release(idle)
    assert pool.acquire(16384) is None  # 8 KiB are on loan: no way to fit 16 KiB
    assert pool.bytes_reserved == 8192 + 4096  # the idle 4 KiB buffer was not thrown away for nothing
    pool.release(held)


def test_a_request_larger_than_the_whole_pool_raises() -> None:
    pool = PinnedPool(8192)
    with pytest.raises(PoolTooSmall, match="capacity"):
        pool.acquire(8193)


def test_double_release_is_caught() -> None:
    pool = PinnedPool(8192)
    buf = pool.acquire(10)
    assert buf is not None
    pool.release(buf)
    with pytest.raises(TransferError, match="twice"):
        pool.release(buf)
    assert pool.buffers_out == 0


def test_prefill_allocates_idle_buffers_up_to_the_capacity() -> None:
    pool = PinnedPool(5 * 8192)
    assert pool.prefill(5000, 10) == 5  # 8 KiB class, five fit
    assert pool.bytes_reserved == 5 * 8192 and pool.buffers_out == 0
    bufs = [pool.acquire(6000) for _ in range(5)]
    assert pool.allocations == 5  # served from the prefilled buffers
    assert pool.acquire(6000) is None
    for b in bufs:
        assert b is not None
        pool.release(b)


def test_trim_gives_idle_memory_back() -> None:
    pool = PinnedPool(1 << 20)
    bufs = [pool.acquire(4096), pool.acquire(65536)]
    for b in bufs:
        assert b is not None
        pool.release(b)
    assert pool.trim() == 4096 + 65536
    assert pool.bytes_reserved == 0


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(TransferError, match="capacity"):
        PinnedPool(0)
    with pytest.raises(TransferError, match="power of two"):
        PinnedPool(4096, min_class=3000)


def test_cpu_pool_is_not_pinned() -> None:
    # Pinned memory is only requested when CUDA is there to use it (the CPU device allocates plain memory).
    assert PinnedPool(4096).pinned is False


def test_a_lazy_buffer_is_allocated_by_its_first_user_and_counted_at_once() -> None:
    made: list[int] = []

    class Counting(CpuDevice):
        def alloc_host(self, nbytes: int) -> torch.Tensor:
            made.append(nbytes)
            return super().alloc_host(nbytes)

    pool = PinnedPool(1 << 16, device=Counting())
    buf = pool.acquire(5000, lazy=True)
    assert buf is not None and not buf.allocated and made == []
    assert pool.bytes_reserved == pool.bytes_out == 8192 and pool.allocations == 1  # the bytes are taken now
    buf.view(torch.uint8, (5000,)).fill_(7)
    assert buf.allocated and made == [8192]
    pool.release(buf)
    again = pool.acquire(5000)
    assert again is buf and made == [8192]  # reused, not made twice

    untouched = pool.acquire(5000, lazy=True)  # a fresh one (``buf`` is out): left unallocated ...
    assert untouched is not None and untouched is not buf and not untouched.allocated
    pool.release(untouched)
    plain = pool.acquire(5000)  # ... and allocated by the next non-lazy borrower, before it is handed out
    assert plain is untouched and plain.allocated and made == [8192, 8192]
    pool.release(plain)
    pool.release(again)
    assert pool.buffers_out == 0
