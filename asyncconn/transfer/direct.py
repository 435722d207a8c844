"""The loader's one hook for destinations the store reads straight into (no staging buffer, no device copy).

A kind of destination registers a :class:`DirectLoads` for its type (:func:`register`); every
:class:`~asyncconn.transfer.loader.StreamLoader` makes one of each when it is built and hands such loads to
it: whether this loader can take them, how they are grouped into store calls, the call itself, and the
counters they add to :meth:`~asyncconn.transfer.loader.StreamLoader.totals`. The in-place loads of a host
KV cache (:mod:`asyncconn.transfer.in_place`) are the one kind today.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncconn.store import Fetch

if TYPE_CHECKING:
    from asyncconn.transfer.loader import StreamLoader

__all__ = ["DIRECT_LOADS", "DirectLoads", "register"]


class DirectLoads(abc.ABC):
    """How one :class:`StreamLoader` loads one kind of direct destination. Called on the loader's threads:
    :meth:`check`, :meth:`started`, :meth:`landed` and :meth:`totals` on the worker, :meth:`read` on the
    loop."""

    #: Whether this kind's store calls take the loader's call slots (``max_inflight``) as staged reads do:
    #: reads that wait on a network; memory copies need none.
    held: bool = False

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    @abc.abstractmethod
    def check(self, dest: Any) -> None:
        """Raise :class:`~asyncconn.exceptions.TransferError` when this loader cannot load into ``dest``."""

    @abc.abstractmethod
    def nbytes(self, dest: Any) -> int:
        """The bytes ``dest`` receives."""

    @abc.abstractmethod
    def group_limit(self, total: int) -> int:
        """The bytes one store call reads, for a batch of ``total`` bytes of such loads."""

    @abc.abstractmethod
    async def read(self, items: Sequence[tuple[str, Any]]) -> list[Fetch]:
        """One store call reading ``items`` (key, destination) straight into their destinations."""

    @abc.abstractmethod
    def started(self) -> None:
        """A load of this kind was handed to the loop."""

    @abc.abstractmethod
    def landed(self, dest: Any) -> None:
        """A load of this kind succeeded."""

    @abc.abstractmethod
    def totals(self) -> dict[str, int]:
        """This kind's running totals, merged into the loader's."""


#: Destination type -> how a loader loads it; filled by :func:`register`.
DIRECT_LOADS: dict[type, Callable[[StreamLoader], DirectLoads]] = {}


def register(dest_type: type, loads: Callable[[StreamLoader], DirectLoads]) -> None:
    """Load destinations of ``dest_type`` with ``loads(loader)`` (one per loader)."""
    DIRECT_LOADS[dest_type] = loads
