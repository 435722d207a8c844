"""One save on its way to the store, and where its snapshot is staged.

A :class:`Save` is the unit the :class:`~asyncconn.transfer.saver.SaveTracker` moves through its threads:
the caller's source until the snapshot, then a staging buffer of its own or a slice of a :class:`Span`
(one buffer shared by a step's ``submit_many`` values), then the frame header once the copy thread has
encoded it. These are plain records with no locks: each has one owner thread at a time, and the modules
that hand them over (:mod:`asyncconn.transfer.snapshot`, :mod:`asyncconn.transfer.puts`) say how.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from asyncconn.transfer._device import Event
from asyncconn.transfer.lazy import LazyTensor, Pieces
from asyncconn.transfer.pool import PinnedBuffer

__all__ = ["Save", "Source", "Span", "aligned"]

Source = torch.Tensor | LazyTensor


class Span:
    """One staging buffer shared by a step's ``submit_many`` saves (one pool acquire for them all); back in
    the pool once the last of them is complete. ``refs`` is counted down by the worker thread only."""

    __slots__ = ("buf", "refs")

    def __init__(self, buf: PinnedBuffer, refs: int) -> None:
        self.buf = buf
        self.refs = refs


class Save:
    """One value to save: its key and source until snapshotted, then where its bytes are staged."""

    __slots__ = (
        "buf",
        "dtype",
        "event",
        "header",
        "ident",
        "index",
        "key",
        "offset",
        "producer",
        "request_id",
        "shape",
        "source",
        "span",
    )

    def __init__(
        self, request_id: str, key: str, source: Source | Pieces, producer: Event | None, index: int = 0
    ) -> None:
        self.request_id = request_id
        self.key = key
        self.ident: Hashable = key  # duplicates are detected by this (``submit_many`` may name it otherwise)
        # The caller's tensor (or lazy source; or the Pieces it is piece ``index`` of), until snapshotted.
        self.source: Source | Pieces | None = source
        self.index = index
        self.dtype = source.dtype
        self.shape = tuple(source.shape)
        self.producer = producer  # "the kernels that wrote the tensor", recorded at submit (CUDA path)
        self.buf: PinnedBuffer | None = None  # a staging buffer of its own, or
        self.span: Span | None = None  # bytes ``offset ..`` of a buffer shared with other saves
        self.offset = 0
        self.event: Event | None = None  # the snapshot copy (CUDA path)
        self.header: bytes | None = None  # the staged bytes' frame header, when the copy thread made it

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def staging(self) -> torch.Tensor:
        """The staged bytes as a tensor of the source's dtype and shape."""
        if self.span is not None:
            start = self.offset
            raw = self.span.buf.storage[start : start + self.nbytes()]
            return raw.view(self.dtype).view(self.shape)
        assert self.buf is not None
        return self.buf.view(self.dtype, self.shape)


def aligned(nbytes: int) -> int:
    """Bytes a save takes in a shared staging buffer: rounded up to 64, so every view is aligned."""
    return (nbytes + 63) & ~63
