"""Removals made by the stores vLLM's scheduler process opened for its own lookups, published as KV events.

A store that removes values by its own doing tells whoever hooked it (``StorageBackend.on_removed``), in the
process where the removal ran. The workers hook their stores (:mod:`asyncconn.vllm.kv.worker`), but the
scheduler's process opens stores too: the shared store, to answer lookups, and with ``local_store_url`` the
local directory, to count ``disk`` hits (and the local recheck's, where there is no such store). A
``file://`` store sweeps (``max_bytes``, ``max_age``) in every process that has it open, one process at a
time, so a sweep that runs in the scheduler's process removes values no worker hears of: without this, a
router would keep them in its view until the engine next looked them up or a recheck asked
(:mod:`asyncconn.vllm.kv.recheck`). (A Redis store that reports the server's removals reports them in every
process that listens; a key heard twice is announced once.)

:class:`OwnRemovals` hooks those stores, buffers what they remove (on the loop thread, bounded like the
workers' buffers) and hands it to the events at the scheduler's next step, as if a worker had reported it.
A store that can hear removals made by other processes too (``file://`` on Linux: ``watch_removals``,
inotify) is asked to: another engine's sweep of a directory this host shares, a value deleted by hand, are
then announced at the next step instead of when a recheck reaches them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncconn.exceptions import RuntimeClosed
from asyncconn.vllm.kv.events import KVEvents, SaveReports
from asyncconn.vllm.kv.localevents import LocalNews, LocalTierEvents

if TYPE_CHECKING:
    from asyncconn.lookup import LookupClient
    from asyncconn.runtime import Runtime

__all__ = ["OwnRemovals"]


class OwnRemovals:
    """The scheduler side's hooks on its own stores. :meth:`hear_shared` / :meth:`hear_local` and
    :meth:`step` run on vLLM's scheduler thread; the hooks on the loop thread (each buffer has its lock)."""

    def __init__(self) -> None:
        self._shared = SaveReports()  # the shared store's removed keys (its ``report_removed`` buffer)
        self._local = LocalNews()  # the local directory's
        # The backends whose ``on_removed`` is ours (with the runtime that owns each), unhooked on close.
        self._hooked: list[tuple[Any, Runtime]] = []

    def hear_shared(self, client: LookupClient[Any] | None) -> None:
        """Hear what the shared store removes: the store ``client`` asks itself (none behind a lookup
        server)."""
        self._hook(client, self._shared.report_removed)

    def hear_local(self, client: LookupClient[Any] | None) -> None:
        """Hear what the local directory's store, the one ``client`` asks, lets go."""
        self._hook(client, self._local_removed)

    def _hook(self, client: LookupClient[Any] | None, hook: Any) -> None:
        store = client.store if client is not None else None
        if client is None or store is None:
            return
        backend: Any = store.backend
        # Feature-detected, as in the workers: a backend without the hook reports nothing.
        if not hasattr(backend, "on_removed") or any(b is backend for b, _ in self._hooked):
            return
        backend.on_removed = hook
        self._hooked.append((backend, client.runtime))
        if hasattr(backend, "watch_removals"):  # on the loop that owns the backend: its client's
            client.runtime.call_soon(backend.watch_removals)

    def _local_removed(self, keys: Sequence[str]) -> None:
        self._local.heard(keys, False)

    def step(self, events: KVEvents | None, local_events: LocalTierEvents | None) -> None:
        """What the stores removed since the last step, into the store's and the local store's events."""
        report = self._shared.take()
        if report is not None and events is not None:
            events.update(report)
        changes = self._local.take()
        if changes and local_events is not None:
            local_events.update_local(changes)

    def held(self) -> dict[str, int]:
        return {"own_removals": self._shared.held() + self._local.held()}

    @property
    def dropped(self) -> int:
        """Keys let go because a buffer was full (counted with the events' ``events_dropped``)."""
        return self._shared.dropped + self._local.dropped

    def close(self) -> None:
        for backend, runtime in self._hooked:
            backend.on_removed = None
            if hasattr(backend, "unwatch_removals"):
                with contextlib.suppress(RuntimeClosed):  # closed with its runtime: nothing to stop
                    runtime.call_soon(backend.unwatch_removals)
        self._hooked.clear()
        self._shared.take()
        self._local.take()
