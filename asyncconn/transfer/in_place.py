"""In-place loads: a :class:`~asyncconn.scattered.Scattered` destination, read straight into a host KV cache.

The store reads the value straight into the caller's memory, the pieces in order, and the result is
reported as soon as the read has ended: no staging buffer, no device copy, so a host device only. Two
kinds, by the destination's type:

* :class:`InPlaceLoads` (``Scattered``: a value the store serves from memory, ``file://``'s page cache or
  a host tier): in groups with ``cached_only``, nothing that could wait for a disk. A load not served from
  memory fails ``NOT_CACHED`` (load it another way).
* :class:`RemoteInPlaceLoads` (``RemoteScattered``: a value read from a store whose reads can be abandoned,
  ``redis://``, ``StorageBackend.cancellable_reads``): one store call per value, each in a call slot like a
  staged read, and each stopped at once when its owner lets it go (``StreamLoader.interrupt``).

Plugged into the loader through :mod:`asyncconn.transfer.direct`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncconn.exceptions import TransferError
from asyncconn.scattered import RemoteScattered, Scattered
from asyncconn.store import Fetch
from asyncconn.transfer.direct import DirectLoads, register

if TYPE_CHECKING:
    from asyncconn.transfer.loader import StreamLoader

__all__ = ["IN_PLACE_GROUP_BYTES", "InPlaceLoads", "RemoteInPlaceLoads"]

#: The most bytes one store call reads for in-place loads (``Scattered`` destinations); a batch's in-place
#: loads are cut into as few groups of even size as this allows. Larger than the loader's ``GROUP_BYTES``:
#: nothing waits to copy a value out of staging, so the first values landing early gains nothing, and each
#: call is a hand-off between the loop and the store's threads, which on a small CPU engine were most of a
#: prefix load's time. ``file://`` shares one call's values among its read threads, so a whole prefix up to
#: this size is one call.
IN_PLACE_GROUP_BYTES = 256 << 20


class InPlaceLoads(DirectLoads):
    """A loader's in-place loads: memory copies into the caller's blocks, not held back by
    ``max_inflight`` (which bounds the staging in use)."""

    def __init__(self, loader: StreamLoader) -> None:
        super().__init__(loader)
        self.loaded = 0  # in-place loads that succeeded
        self.reads = 0  # in-place loads started, whatever their outcome

    def check(self, dest: Any) -> None:
        if not self.loader.device.synchronous:
            raise TransferError(
                "an in-place (Scattered) load needs a host device (the memory is the destination)"
            )

    def nbytes(self, dest: Any) -> int:
        assert isinstance(dest, Scattered)
        return dest.nbytes

    def group_limit(self, total: int) -> int:
        """The group size that cuts ``total`` bytes into as few groups of at most
        :data:`IN_PLACE_GROUP_BYTES` as possible, evenly (so the groups, read side by side on the store's
        threads, end together)."""
        groups = max(-(-total // IN_PLACE_GROUP_BYTES), 1)
        return max(-(-total // groups), 1)

    async def read(self, items: Sequence[tuple[str, Any]]) -> list[Fetch]:
        return await self.loader.store.read_into_many(items, cached_only=True)

    def started(self) -> None:
        self.reads += 1

    def landed(self, dest: Any) -> None:
        self.loaded += 1

    def totals(self) -> dict[str, int]:
        return {"loaded_in_place": self.loaded, "reads_in_place": self.reads}


class RemoteInPlaceLoads(InPlaceLoads):
    """In-place loads from a store whose reads can be abandoned (``TensorStore.cancellable_reads``).

    Each value is its own store call, so each can be stopped on its own (``StreamLoader.interrupt``) and a
    request let go of is not held for its neighbours' reads; the calls take the loader's call slots
    (``max_inflight``) as staged reads do, so a long prefix waits for a slot instead of running into the
    store's timeout behind its own values.
    """

    held = True

    def check(self, dest: Any) -> None:
        super().check(dest)
        if not self.loader.store.cancellable_reads:
            name = self.loader.store.name
            raise TransferError(f"{name}: a RemoteScattered load needs reads that stop when cancelled")

    def group_limit(self, total: int) -> int:
        return 1  # every value a group of its own

    async def read(self, items: Sequence[tuple[str, Any]]) -> list[Fetch]:
        return await self.loader.store.read_into_many(items)


register(Scattered, InPlaceLoads)
register(RemoteScattered, RemoteInPlaceLoads)
