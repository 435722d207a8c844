"""The connectors' worker sides without vLLM, and which engine owns which side stream.

The GPU proof machine cannot carry vLLM, so the worker sides (KV loads/saves into a paged cache, EC prefetch
and install) must import and run with torch and our own dependencies only: checked in a child process in
which ``import vllm`` fails. Each worker gives its loader and its save tracker a device of their own (one
side stream each on CUDA, loads at the higher priority), so a load never queues behind save copies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import (
    LOAD_PRIORITY,
    SAVE_PRIORITY,
    CpuDevice,
    CudaDevice,
    PinnedPool,
    SaveTracker,
    StreamLoader,
    engine_devices,
)
from tests.transfer.worker_sides import ec_save_prefetch_install

ROOT = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
WHERE = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.mark.slow  # starts Python subprocesses: seconds each
@pytest.mark.parametrize("where", WHERE)
def test_worker_sides_import_and_run_where_vllm_cannot_be_imported(where: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.transfer.worker_sides", where, "--block-vllm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"worker sides ok on {where} without vllm" in proc.stdout


@pytest.mark.parametrize("where", WHERE)
def test_ec_item_saved_prefetched_and_installed(where: str) -> None:
    ec_save_prefetch_install(where)


def test_engine_devices_are_two_devices() -> None:
    load, save = engine_devices("cpu")
    assert isinstance(load, CpuDevice) and isinstance(save, CpuDevice) and load is not save
    assert isinstance(load.sibling(priority=LOAD_PRIORITY), CpuDevice)
    assert LOAD_PRIORITY < SAVE_PRIORITY  # torch: a lower number is a higher stream priority


def test_ec_worker_gives_its_loader_and_saver_a_device_each(runtime: Runtime) -> None:
    from asyncconn.vllm.ec.worker import ECWorkerSide

    settings = Settings.from_extra_config({"backend_url": "memory://ec-owners", "pinned_pool_bytes": "1MiB"})
    device = CpuDevice()
    worker = ECWorkerSide(settings, producer=True, consumer=True, runtime=runtime, device=device)
    try:
        assert worker.loader is not None and worker.saver is not None
        assert worker.loader.device is not worker.saver.device
        assert device not in (worker.loader.device, worker.saver.device)
    finally:
        worker.close()


def test_kv_worker_refuses_a_loader_and_saver_sharing_a_device(runtime: Runtime, store: TensorStore) -> None:
    from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
    from asyncconn.vllm.kv.worker import KVWorkerSide

    identity = KVIdentity("owners", "", "float16", "default", 16, 8, 128, ("l0",), 1, 2)
    device = CpuDevice()
    pool = PinnedPool(1 << 20, device=device)
    loader = StreamLoader(store, runtime=runtime, device=device, pool=pool)
    saver = SaveTracker(store, runtime=runtime, device=device, pool=pool)
    try:
        with pytest.raises(ConfigError, match="device each"):
            KVWorkerSide(
                KeySpace(identity),
                store=store,
                loader=loader,
                saver=saver,
                runtime=runtime,
                layers=["l0"],
                group_of_layer={"l0": 0},
                num_blocks=8,
            )
    finally:
        loader.close()
        saver.close()


@pytest.mark.gpu
@CUDA
def test_cuda_loads_run_on_a_stream_of_higher_priority_than_saves() -> None:
    load, save = engine_devices("cuda")
    assert isinstance(load, CudaDevice) and isinstance(save, CudaDevice)
    assert load.stream != save.stream
    low, high = torch.cuda.Stream.priority_range()  # type: ignore[no-untyped-call]
    if low != high:  # a device with one priority level cannot order them
        assert load.priority < save.priority, (load.priority, save.priority)
    assert load.sibling(priority=SAVE_PRIORITY).stream != load.stream
