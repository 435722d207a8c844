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

from collections.abc import Iterator, Mapping, Sequence

from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["StageSpaces"]


class StageSpaces:
    """The key spaces of a pipeline's ``stages``, the first given, the others learnt. Scheduler thread."""

    def __init__(self, first: KeySpace, stages: int = 1) -> None:
        self.stages = max(stages, 1)
        self._spaces: dict[int, KeySpace] = {0: first}

    @property
    def first(self) -> KeySpace:
        return self._spaces[0]

    @property
    def complete(self) -> bool:
        """Whether every stage's key space is known."""
        return len(self._spaces) == self.stages

    def reset(self, first: KeySpace) -> None:
        """A new first stage (a simulator's TP override): the later stages are learnt again."""
        self._spaces = {0: first}

    def learn(self, layers: Mapping[int, Sequence[str]]) -> bool:
        """Later stages' layers, as their workers reported them; True when a stage's space is new."""
        new = False
        for stage, names in layers.items():
            if 0 < stage < self.stages and stage not in self._spaces:
                self._spaces[stage] = self.first.of_layers(names)
                new = True
        return new

    def items(self) -> Iterator[tuple[int, KeySpace]]:
        """(stage, key space) of every stage known, first stage first."""
        return iter(sorted(self._spaces.items()))

    def with_first(self, first: KeySpace) -> Iterator[tuple[int, KeySpace]]:
        """:meth:`items` with ``first`` as the first stage's space (a part of its values, where they are
        stored in parts: then there is one stage)."""
        for stage, space in self.items():
            yield stage, first if stage == 0 else space

    def keys_of(self, value_hashes: Sequence[bytes]) -> Iterator[tuple[str, bytes]]:
        """(store key, value hash) of every known stage's distinct keys of ``value_hashes``."""
        for _, space in self.items():
            for rank in range(space.keys_per_value):
                yield from zip(space.store_keys(value_hashes, rank), value_hashes, strict=True)
