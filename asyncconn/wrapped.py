"""The base of a store made of open stores (the host tier; the local disk store in front of the shared one).

Why: such a store is a :class:`StorageBackend` built from backends that are already open, never from a URL,
and the removals it reports are one wrapped store's (what leaves the wrapper alone is still in the store).
Both facts were written out in each wrapper -- a ``from_url`` that refuses, an ``on_removed`` property and
setter forwarding to the wrapped store -- and are written once here instead.
"""

from __future__ import annotations

import abc
from typing import ClassVar, NoReturn

from asyncconn.backend import RemovedHook, StorageBackend
from asyncconn.url import StoreURL

__all__ = ["WrappingBackend"]


class WrappingBackend(StorageBackend):
    """A :class:`StorageBackend` made of open backends: not opened from a URL, and its ``on_removed`` is
    :attr:`removals_from`'s.

    A subclass sets :attr:`built_as` and says which wrapped store reports removals.
    """

    #: How one is built, quoted by ``from_url``'s error, e.g. ``"wraps an open backend: Tier(backend)"``.
    built_as: ClassVar[str]

    @classmethod
    async def from_url(cls, url: StoreURL) -> NoReturn:
        raise TypeError(f"a {cls.__name__} {cls.built_as}")

    @property
    @abc.abstractmethod
    def removals_from(self) -> StorageBackend:
        """The wrapped store whose removals are this one's (hooking :attr:`on_removed` hooks it)."""

    @property  # type: ignore[override]
    def on_removed(self) -> RemovedHook | None:
        """The removals hook of :attr:`removals_from`: what leaves only the wrapper stays in the store."""
        return self.removals_from.on_removed

    @on_removed.setter
    def on_removed(self, hook: RemovedHook | None) -> None:
        self.removals_from.on_removed = hook
