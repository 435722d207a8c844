"""The parts a stored value is split into on a hybrid model, and which of them a cut needs.

A model with sliding-window (or chunked-local) groups beside whole-life ones (full attention, MLA) stores a
value in two parts, each under keys of its own (:meth:`KeySpace.of_layers`: the part's layers are in the
namespace): the *whole* part, the whole-life groups' layers, for every prefix value; the *window* part,
the windowed groups' layers, only for the values inside the window at the cut -- the end of what a request
stored. Older windowed blocks are never read again by a request resuming at or after that cut (vLLM
gives it the null block there), so storing them would only cost bytes. A model without windowed groups
has one part, every layer, under the keys it always had.

A hit of ``n`` values needs the whole part of every value below ``n`` and the window part of each value
from :meth:`ValueParts.first_window_value` of ``n`` on (:class:`asyncconn.vllm.kv.groups.Window`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from asyncconn.vllm.kv.groups import GroupLayout, Window
from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["ValueParts", "part_ident"]


@dataclass(frozen=True)
class ValueParts:
    """Each part's key space (``ValueRef.part`` indexes it), which part is which, and the window rule."""

    keys: tuple[KeySpace, ...]
    whole: int | None  # the whole-life part (None: every group is windowed)
    window: int | None  # the windowed part (None: no windowed group)
    rule: Window | None

    @classmethod
    def single(cls, keys: KeySpace) -> ValueParts:
        """One part of every layer (no windowed group)."""
        return cls((keys,), 0, None, None)

    @classmethod
    def of(cls, keys: KeySpace, groups: GroupLayout) -> ValueParts:
        """The parts of ``groups``' values (``keys``: the key space of every layer)."""
        if groups.window is None or not groups.parts:
            return cls.single(keys)
        spaces = tuple(keys.of_layers(part.layers) for part in groups.parts)
        whole = next((i for i, part in enumerate(groups.parts) if not part.windowed), None)
        window = next(i for i, part in enumerate(groups.parts) if part.windowed)
        return cls(spaces, whole, window, groups.window)

    @property
    def split(self) -> bool:
        """Whether the windowed groups are stored apart (only inside the window at the cut)."""
        return self.window is not None

    def first_window_value(self, values: int) -> int:
        """The first value whose window part a request resuming after ``values`` values reads."""
        if self.rule is None:
            return 0
        tpv = self.keys[0].tokens_per_value
        return self.rule.first_block(values * tpv) // self.keys[0].blocks_per_value


def part_ident(part: int, value_hash: bytes) -> Hashable:
    """What the save tracker knows a part's save by: the value hash for part 0 (as ever; KV events name
    values so), ``(part, hash)`` for another part, so the two parts of a value are never one duplicate."""
    return value_hash if part == 0 else (part, value_hash)
