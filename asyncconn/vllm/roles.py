"""The role a connector facade was built for, and the one side object that role holds.

vLLM builds each connector for one role -- scheduler or worker -- and then calls only that role's methods.
A facade holds the matching side object and delegates to it; a method of the other role reaching it is a
misuse of the object in its state, answered by :class:`RuntimeStateError` naming what happened. The KV and
EC facades share this so that the answer, and the wording, are the same for both.
"""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

from asyncconn.exceptions import RuntimeStateError

__all__ = ["RoleSides"]

S = TypeVar("S")
W = TypeVar("W")


class RoleSides(Generic[S, W]):
    """Mixin for a connector facade: ``scheduler_side`` and ``worker_side``, one of them set.

    Why not :class:`ConfigError` for the wrong role: no setting is wrong -- vLLM fixed the role when it built
    the object, and a method of the other role was called on it.
    """

    #: "KV" or "EC", for the error message.
    connector_kind: ClassVar[str]
    _scheduler: S | None
    _worker: W | None

    @property
    def scheduler_side(self) -> S:
        """The scheduler side; :class:`RuntimeStateError` on a worker-role connector."""
        if self._scheduler is None:
            raise RuntimeStateError(
                f"a scheduler-side {self.connector_kind} method was called on a worker-side connector"
            )
        return self._scheduler

    @property
    def worker_side(self) -> W:
        """The worker side; :class:`RuntimeStateError` on a scheduler-role connector."""
        if self._worker is None:
            raise RuntimeStateError(
                f"a worker-side {self.connector_kind} method was called on a scheduler-side connector"
            )
        return self._worker
