"""Our helper threads run their torch CPU ops on themselves alone, and never change the caller's setting.

Why it matters: an OpenMP team started by the copy thread (a gather) or the loop thread puts every team of
the process -- vLLM's matmul threads included -- into libgomp's sleep-between-regions mode once their count
exceeds the CPUs (the decode benchmark's main gap on a 2-CPU box).
"""

from __future__ import annotations

import threading

import torch

from asyncconn.transfer._device import single_thread_torch
from asyncconn.transfer.copythread import CopyThread


def test_copy_thread_runs_torch_single_threaded_and_leaves_the_caller_alone() -> None:
    before = torch.get_num_threads()
    thread = CopyThread(name="test-copy")
    thread.start()
    seen: list[int] = []
    done = threading.Event()

    def job() -> None:
        seen.append(torch.get_num_threads())
        done.set()

    thread.post(job)
    assert done.wait(10.0)
    assert thread.close(10.0)
    assert seen == [1]
    assert torch.get_num_threads() == before  # the calling thread's setting is untouched


def test_single_thread_torch_is_per_thread_and_idempotent() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    def run() -> None:
        single_thread_torch()
        single_thread_torch()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10.0)
    assert seen == [1]
    assert torch.get_num_threads() == before
