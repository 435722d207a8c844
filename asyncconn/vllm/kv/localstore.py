"""Hits served by the local store (``local_store_url``), counted as vLLM's ``disk`` source.

vLLM asks where a request's external tokens come from (``get_external_cache_hit_sources``) on the scheduler
thread, right after the load is planned and before it starts. The local store is a ``file://`` directory on
this host, in front of the shared store (:mod:`asyncconn.layered`): a value it holds is read from the local
disk, one it lacks from the shared store. So the scheduler asks the local store too, beside the shared
store's prefix lookup and in the same way -- an asynchronous EXISTS lookup of the same keys through its own
:class:`~asyncconn.lookup.client.LookupClient` (``file://``'s ``exists`` on the runtime loop and the
store's threads, never on vLLM's thread):

- both questions are sent together; a request whose shared answer is in waits for the local one like for
  any lookup ("ask me next step"), bounded by ``lookup_timeout`` (past it, or when the local store fails,
  the local answer is "nothing held": its tokens are counted under the shared store's source);
- when the load is planned, the tokens of the planned values whose every key the local store holds are
  the request's ``disk`` tokens; the host tier (``host_cache_bytes``) sits in front of both stores and holds
  what this host read or wrote last, which the local store holds too, so the tier's ``host`` tokens are
  taken out of them;
- the answer lives until the load is planned, the request is preempted or finishes, or the scheduler
  closes.

Only the split is exact up to what changes between the question and the read (a value the local store's
sweep removes meanwhile is read from the shared store, but was counted as ``disk``). A model whose
windowed layers are stored apart (:mod:`asyncconn.vllm.kv.parts`) is not split: its hits are counted under
the shared store's source. Under pipeline parallelism the question names every stage's keys of a value
(:mod:`asyncconn.vllm.kv.stages`), and is asked only once every stage's key space is known.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncconn.lookup.client import LookupClient

__all__ = ["LocalStoreHits"]


class LocalStoreHits:
    """The scheduler's questions to the local store and, per request, the ``disk`` tokens of its load.

    Used from vLLM's scheduler thread only (the lookup client's own contract)."""

    def __init__(self, lookup: LookupClient[tuple[bool, ...]], keys_per_value: int) -> None:
        self.lookup = lookup
        self.keys_per_value = keys_per_value
        self._answers: dict[str, tuple[bool, ...]] = {}  # request id -> the local answer, until planned
        self._tokens: dict[str, int] = {}  # request id -> disk tokens of its planned load, until asked

    def ask(self, rid: str, keys: Sequence[bytes]) -> None:
        """Send the local question beside the shared one (the same keys); a no-op while one is answered or
        in flight for ``rid``."""
        if rid not in self._answers and not self.lookup.pending(rid):
            self.lookup.submit(rid, keys)

    def answered(self, rid: str) -> bool:
        """Whether the local answer is in (or was never asked: nothing to wait for)."""
        if rid in self._answers or not self.lookup.pending(rid):
            return True
        answer = self.lookup.poll(rid)
        if answer is None:
            return False
        self._answers[rid] = answer
        return True

    def planned(self, rid: str, values: Sequence[tuple[int, int]]) -> None:
        """``rid``'s load is planned: ``values`` are (value index, tokens loaded) of each value it reads.
        Counts the tokens of those the local store holds; the answer is dropped."""
        answer = self._answers.pop(rid, ())
        per = self.keys_per_value
        tokens = sum(
            count
            for index, count in values
            if (index + 1) * per <= len(answer) and all(answer[index * per : (index + 1) * per])
        )
        if tokens:
            self._tokens[rid] = tokens
        else:
            self._tokens.pop(rid, None)

    def take_tokens(self, rid: str) -> int:
        """The tokens of ``rid``'s last planned load the local store holds (asked once, right after)."""
        return self._tokens.pop(rid, 0)

    def release(self, rid: str) -> None:
        """Forget ``rid`` (preempted, finished): its answer, its count and its question in flight."""
        self._answers.pop(rid, None)
        self._tokens.pop(rid, None)
        self.lookup.discard(rid)

    def wait(self, timeout: float) -> None:
        """On a step with nothing scheduled: let the loop answer (see ``LookupClient.wait``)."""
        if self.lookup.outstanding():
            self.lookup.wait(timeout)

    def held(self) -> dict[str, int]:
        out = {f"local_store_lookup_{k}": v for k, v in self.lookup.held().items()}
        out["local_store_answers"] = len(self._answers)
        out["local_store_tokens"] = len(self._tokens)
        return out

    def close(self) -> None:
        self._answers.clear()
        self._tokens.clear()
        self.lookup.close()
