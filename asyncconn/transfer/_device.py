"""The only place that knows whether transfers run on CUDA: streams, events and pinned memory, or plain CPU.

The loader and the save tracker are written against :class:`TransferDevice`, so the same code path runs in
CI without a GPU: :class:`CpuDevice` copies synchronously and hands out events that are always complete,
:class:`CudaDevice` issues every copy on its own side stream with ``non_blocking=True`` from pinned memory and
records a real ``torch.cuda.Event``. Nothing here ever synchronizes: callers find out that a copy is done by
``event.query()``, polled from the worker thread that owns the device object (one owner per structure).

Cross-stream memory reuse (the caching allocator). A device tensor the loader creates is *allocated on the
side stream* (inside ``torch.cuda.stream(side)``), so the allocator only ever hands its memory out again to
side-stream allocations, which are ordered after our copy by the stream itself: no wait on the default stream
is needed before the copy, and the copy overlaps with whatever compute is queued there. When the tensor is
handed to the caller (after its event has fired) :meth:`TransferDevice.hand_over` calls
``tensor.record_stream(current_stream)``, so that when vLLM frees it the allocator waits for the
default-stream work queued by then before reusing the block for the next side-stream copy. The other
choice -- allocate on the default stream and make the side stream ``wait_stream(default)`` -- would
serialize every load behind all the compute queued at the time of the copy, which is exactly the stall this
module exists to remove.

One side stream per engine. A loader and a save tracker each own a device (:func:`engine_devices`), so a
load is never queued behind the snapshot copies a save issued before it, and the loader's stream has the
higher priority (:data:`LOAD_PRIORITY`): a load is what a waiting request waits for, a save is not.

Inference mode. vLLM runs its worker thread under ``torch.inference_mode()``, and a tensor created there is an
*inference tensor*: an in-place write to it from any thread outside inference mode (the loop reading a value
into staging, the copy thread filling a snapshot) raises. Every host buffer is therefore allocated with
inference mode switched off (:func:`_normal_tensors`), whoever asks for it; so are device tensors the engines
create, since a caller outside inference mode may write them later.

A copy given ``after`` (an event recorded on the default stream when the work was submitted, as a save's
snapshot is) waits for the work queued by then only, not for work queued later, so it still overlaps with the
steps that follow. Every CUDA tensor a side-stream copy touches
is ``record_stream``-ed on the side stream, so its owner may free it (a finished request's KV block, a
snapshotted activation) while the copy is still queued without the allocator handing the memory out early.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

__all__ = [
    "DONE",
    "LOAD_PRIORITY",
    "SAVE_PRIORITY",
    "CopyPairs",
    "CpuDevice",
    "CudaDevice",
    "Event",
    "TransferDevice",
    "default_device",
    "engine_devices",
    "single_thread_torch",
]

#: CUDA stream priorities (torch: a lower number is a higher priority; out-of-range values are clamped to
#: the device's range). A load is on the forward path of a waiting request and a save is not, so when both
#: side streams have copies ready the GPU's copy engines take the load's first.
LOAD_PRIORITY = -1
SAVE_PRIORITY = 0


def _normal_tensors() -> torch.inference_mode:
    """A context in which new tensors are normal tensors, even on a thread running under inference mode."""
    return torch.inference_mode(False)


_thread_state = threading.local()
_omp_set: Callable[[int], object] | bool | None = False  # False: not looked up yet; None: none found


def _omp_setter() -> Callable[[int], object] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch uses (its bundled libgomp, else the process's)."""
    global _omp_set
    if _omp_set is False:
        found: Callable[[int], object] | None = None
        candidates = [os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"), None]
        for path in candidates:
            if path is not None and not os.path.exists(path):
                continue
            with contextlib.suppress(OSError, AttributeError):
                found = ctypes.CDLL(path).omp_set_num_threads
                break
        _omp_set = found
    return _omp_set if callable(_omp_set) else None


def single_thread_torch() -> None:
    """Run this thread's own torch CPU ops on this thread alone (OpenMP's per-thread thread count = 1).

    For our helper threads (the save tracker's copy thread, the loop thread). Why: OpenMP gives every
    thread that runs a parallel op a team of its own, and libgomp counts all their threads; once that count
    exceeds the CPUs it stops letting any idle team thread spin and puts them to sleep between parallel
    regions. A gather on the copy thread therefore switched vLLM's own two-thread matmuls on a 2-CPU box
    into that sleeping mode for the engine's whole life (the decode benchmark's main gap). Only the calling
    thread's setting changes (``torch.set_num_threads`` would change the process default, and vLLM's CPU
    worker forbids it). Idempotent and cheap per thread.
    """
    if getattr(_thread_state, "single", False):
        return
    _thread_state.single = True
    torch.get_num_threads()  # torch's lazy per-thread init first, or it would overwrite the setting below
    setter = _omp_setter()
    if setter is not None:
        setter(1)


class Event(Protocol):
    """What the engines need of a CUDA event: a non-blocking completion test."""

    def query(self) -> bool: ...


class _Done:
    """The event of a synchronous (CPU) copy: complete by the time it exists."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "DONE"


DONE: Event = _Done()

#: ``(destination, source)`` pairs copied in order by one call.
CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class TransferDevice(abc.ABC):
    """Copies between pinned host staging and the device, ordered by events and never synchronizing."""

    #: ``torch.device`` that loaded tensors land on.
    device: torch.device
    #: True when staging is already memory of ``device`` (host) and copies finish inside ``copy``: a loader
    #: may then hand out the staging buffer itself to a caller that copies it out at once.
    synchronous: bool = False

    @property
    @abc.abstractmethod
    def pinned(self) -> bool:
        """True when :meth:`alloc_host` returns page-locked memory."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` host buffer of ``nbytes`` (pinned where a GPU makes that worthwhile)."""

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new device tensor that copies may write from the side stream (see the module docstring)."""

    @abc.abstractmethod
    def mark(self) -> Event:
        """An event on the caller's current stream: "the work queued so far" (producer or consumer)."""

    @abc.abstractmethod
    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        """Issue ``dst.copy_(src)`` for each pair on the side stream, after ``after``; return its event."""

    @abc.abstractmethod
    def hand_over(self, tensor: torch.Tensor) -> None:
        """Make a tensor made by :meth:`empty` safe to use and free on the caller's current stream."""

    def sibling(self, *, priority: int = 0) -> TransferDevice:
        """A new device on the same hardware with a side stream of its own (at ``priority`` on CUDA).

        Why: an engine owns its stream. A loader and a save tracker sharing one would queue every load
        behind the save copies issued before it -- on the path of a request waiting for its KV. A device
        class of one's own that a connector's worker should split overrides this.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot make a sibling device")


class CpuDevice(TransferDevice):
    """Synchronous copies on CPU tensors; every event is :data:`DONE`. The CI and no-GPU path."""

    synchronous = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    @property
    def pinned(self) -> bool:
        return False

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        with _normal_tensors():
            return torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        with _normal_tensors():
            return torch.empty(tuple(shape), dtype=dtype)

    def mark(self) -> Event:
        return DONE

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def hand_over(self, tensor: torch.Tensor) -> None:
        return None

    def sibling(self, *, priority: int = 0) -> CpuDevice:
        return CpuDevice()


class CudaDevice(TransferDevice):
    """One side stream per instance (the loader and the save tracker each own one) on one CUDA device.

    ``priority`` is the side stream's (:data:`LOAD_PRIORITY` for a loader, :data:`SAVE_PRIORITY` for a
    save tracker); :attr:`priority` is the one CUDA granted after clamping.
    """

    def __init__(self, device: torch.device | str | int | None = None, *, priority: int = 0) -> None:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaDevice needs a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.stream = torch.cuda.Stream(device=dev, priority=priority)  # type: ignore[no-untyped-call]
        self.priority: int = self.stream.priority

    @property
    def pinned(self) -> bool:
        return True

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # Any thread may ask (the host tier makes its memory on its copy thread): the memory belongs to this
        # device's context, not to the calling thread's current device.
        with _normal_tensors(), torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        with _normal_tensors(), torch.cuda.stream(self.stream):
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def mark(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        with torch.cuda.stream(self.stream):
            if isinstance(after, torch.cuda.Event):
                self.stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # A caller's tensor read or written here may be freed by its owner before the copy ends;
                # this keeps the allocator from reusing its memory until the side stream is past it.
                for t in (dst, src):
                    if t.is_cuda:
                        t.record_stream(self.stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event

    def hand_over(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def sibling(self, *, priority: int = 0) -> CudaDevice:
        return CudaDevice(self.device, priority=priority)


def default_device(device: torch.device | str | int | None = None, *, priority: int = 0) -> TransferDevice:
    """CUDA when asked for (or, with no argument, when available); the synchronous CPU device otherwise.

    Every call makes a new device, so a new side stream (at ``priority``) on CUDA.
    """
    if device is None:
        return CudaDevice(priority=priority) if torch.cuda.is_available() else CpuDevice()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda":
        return CudaDevice(dev, priority=priority)
    if dev.type == "cpu":
        return CpuDevice()
    raise ValueError(f"transfers support cpu and cuda devices, not {dev}")


def engine_devices(
    device: torch.device | str | int | None = None,
) -> tuple[TransferDevice, TransferDevice]:
    """``(loader's, save tracker's)``: the same hardware, a side stream each, loads at the higher priority.

    What a connector's worker hands its two engines; one device for both would put loads behind saves.
    """
    return default_device(device, priority=LOAD_PRIORITY), default_device(device, priority=SAVE_PRIORITY)
