"""Worker-side transfer engines: a pinned staging pool, the stream loader (H2D) and the save tracker (D2H).

Both engines are driven by polling from vLLM's worker thread, which owns the device state; store I/O runs on
the runtime loop. On a machine without CUDA the same API runs synchronously on CPU tensors.
"""

from __future__ import annotations

from asyncconn.transfer._device import CpuDevice, CudaDevice, TransferDevice, default_device
from asyncconn.transfer.dest import BlockDest, Destination, NewTensor
from asyncconn.transfer.failures import Failure
from asyncconn.transfer.loader import LoadResult, StreamLoader
from asyncconn.transfer.pool import PinnedBuffer, PinnedPool
from asyncconn.transfer.saver import SaveTracker

__all__ = [
    "BlockDest",
    "CpuDevice",
    "CudaDevice",
    "Destination",
    "Failure",
    "LoadResult",
    "NewTensor",
    "PinnedBuffer",
    "PinnedPool",
    "SaveTracker",
    "StreamLoader",
    "TransferDevice",
    "default_device",
]
