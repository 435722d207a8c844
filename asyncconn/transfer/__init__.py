"""Worker-side transfer engines: a pinned staging pool, the stream loader (H2D) and the save tracker (D2H).

Both engines are driven by polling from vLLM's worker thread, which owns the device state; store I/O runs on
the runtime loop. On a machine without CUDA the same API runs on CPU tensors: the loader's copies inline,
the save tracker's on its copy thread (the CPU's "side stream").
"""

from __future__ import annotations

from typing import Any

from asyncconn._deprecated import renamed_attribute
from asyncconn.scattered import RemoteScattered, Scattered
from asyncconn.transfer import in_place  # noqa: F401  (registers the in-place loads with the loader)
from asyncconn.transfer._device import (
    LOAD_PRIORITY,
    SAVE_PRIORITY,
    CpuDevice,
    CudaDevice,
    TransferDevice,
    default_device,
    engine_devices,
)
from asyncconn.transfer.dest import TensorSpec
from asyncconn.transfer.failures import Failure
from asyncconn.transfer.lazy import LazyTensor, Pieces, Shared, Slice
from asyncconn.transfer.loader import LoadResult, StreamLoader
from asyncconn.transfer.pool import PinnedBuffer, PinnedPool
from asyncconn.transfer.saver import SaveTracker, ShutdownReport

__all__ = [
    "LOAD_PRIORITY",
    "SAVE_PRIORITY",
    "CpuDevice",
    "CudaDevice",
    "Failure",
    "LazyTensor",
    "LoadResult",
    "Pieces",
    "PinnedBuffer",
    "PinnedPool",
    "RemoteScattered",
    "SaveTracker",
    "Scattered",
    "Shared",
    "ShutdownReport",
    "Slice",
    "StreamLoader",
    "TensorSpec",
    "TransferDevice",
    "default_device",
    "engine_devices",
]


def __getattr__(name: str) -> Any:
    """Old names, kept for one release: they warn (docs/transfer.md, "Deprecated names")."""
    return renamed_attribute(__name__, {"NewTensor": ("TensorSpec", TensorSpec)}, name)
