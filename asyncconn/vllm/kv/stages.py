"""Every pipeline stage's key space, as the scheduler learns it from the workers.

Under pipeline parallelism each stage saves the KV of its own layers under keys of its own: the layers are in
the key space's namespace (:class:`~asyncconn.vllm.kv.keys.KeySpace`). vLLM hands the scheduler the first
stage's KV cache config only, so it can name the first stage's keys alone -- yet what a later stage's worker
reports (its host tier's keys, its local store's, keys its store removed) is in that stage's key space. So a
later stage's worker names its layers in its reports (``SavedReport.layers``), and the scheduler derives that
stage's key space from them (:meth:`StageSpaces.learn`): the first stage's identity with those layers, the
derivation the worker itself ran. Until every stage is known, a value is not counted as held by every stage
(:attr:`StageSpaces.complete`): never more than the tiers hold.

Values stored in parts (a hybrid model's windowed layers apart, :mod:`asyncconn.vllm.kv.parts`) are not
followed across stages: a stage's parts depend on its own KV cache groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["StageSpaces"]


class StageSpaces:
    """The key spaces of a pipeline's ``stages``, the first given, the others learnt. Scheduler thread."""

    def __init__(self, first: KeySpace, stages: int = 1) -> None:
        self.stages = max(stages, 1)
        #: The first stage's key space (plain attributes: the events' path reads them value by value).
        self.first = first
        #: The key spaces known, in stage order.
        self.known: list[KeySpace] = [first]
        self._spaces: dict[int, KeySpace] = {0: first}

    @property
    def complete(self) -> bool:
        """Whether every stage's key space is known."""
        return len(self._spaces) == self.stages

    def reset(self, first: KeySpace) -> None:
        """A new first stage (a simulator's TP override): the later stages are learnt again."""
        self.first = first
        self.known = [first]
        self._spaces = {0: first}

    def learn(self, layers: Mapping[int, Sequence[str]]) -> bool:
        """Later stages' layers, as their workers reported them; True when a stage's space is new."""
        new = False
        for stage, names in layers.items():
            if 0 < stage < self.stages and stage not in self._spaces:
                self._spaces[stage] = self.first.of_layers(names)
                new = True
        if new:
            self.known = [space for _, space in sorted(self._spaces.items())]
        return new

    def every_stage(self, first: KeySpace) -> list[KeySpace] | None:
        """Every stage's key space in stage order, ``first`` as the first stage's (a part of its values,
        where they are stored in parts: then there is one stage); None while one is not known yet."""
        if len(self.known) != self.stages:
            return None
        return [first, *self.known[1:]] if self.stages > 1 else [first]

    def value_keys(self, first: KeySpace, value_hashes: Sequence[bytes]) -> list[bytes] | None:
        """Every stage's distinct lookup keys of each value, value by value (``first`` as the first stage's,
        see :meth:`every_stage`); None while a stage's key space is not known."""
        spaces = self.every_stage(first)
        if spaces is None:
            return None
        return [
            space.value_key(h, rank)
            for h in value_hashes
            for space in spaces
            for rank in range(space.keys_per_value)
        ]

    def keys_of(self, value_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """(store key, value hash) of every known stage's distinct keys of ``value_hashes``."""
        out: list[tuple[str, bytes]] = []
        for space in self.known:
            for rank in range(space.keys_per_value):
                if len(value_hashes) == 1:  # (one value: the events' path, value by value)
                    out.append((space.store_key(value_hashes[0], rank), value_hashes[0]))
                else:
                    out.extend(zip(space.store_keys(value_hashes, rank), value_hashes, strict=True))
        return out
