"""The tier's presence checks on the scheduler thread (``TierLookups``), with futures the test answers:
one batch per step, answers kept per request, late answers of forgotten chunks ignored, bounded."""

from __future__ import annotations

import concurrent.futures

from asyncconn.vllm.tier.lookups import TierLookups

Future = concurrent.futures.Future


class Asker:
    def __init__(self) -> None:
        self.asked: list[tuple[list[str], Future[list[bool]]]] = []

    def __call__(self, keys: list[str]) -> Future[list[bool]]:
        future: Future[list[bool]] = Future()
        self.asked.append((keys, future))
        return future

    def answer(self, i: int, present: set[str]) -> None:
        keys, future = self.asked[i]
        future.set_result([k in present for k in keys])


def test_a_steps_chunks_are_asked_once_as_one_batch_and_answered_later() -> None:
    ask = Asker()
    lookups = TierLookups(ask, max_pending=100)
    assert [lookups.lookup(k, "r1") for k in "abc"] == [None, None, None]
    assert lookups.lookup("a", "r2") is None  # another request, same chunk: not asked twice
    assert ask.asked == []  # nothing leaves before the step ends
    lookups.flush()
    assert [keys for keys, _ in ask.asked] == [["a", "b", "c"]]
    assert lookups.lookup("a", "r1") is None and lookups.busy()
    ask.answer(0, {"a", "c"})
    assert [lookups.lookup(k, "r1") for k in "abc"] == [True, False, True]
    lookups.flush()
    assert len(ask.asked) == 1 and not lookups.busy()  # answered chunks are kept, not asked again


def test_released_chunks_are_forgotten_and_a_late_answer_is_ignored() -> None:
    ask = Asker()
    lookups = TierLookups(ask, max_pending=100)
    lookups.lookup("a", "r1")
    lookups.flush()
    lookups.release("r1")  # the request ended before the answer came
    assert lookups.tracked() == 0
    assert lookups.lookup("a", "r2") is None  # asked again, for r2
    lookups.flush()
    ask.answer(0, {"a"})  # the old answer ("present") arrives first...
    assert lookups.lookup("a", "r2") is None  # ...and is not taken for r2's question
    ask.answer(1, set())
    assert lookups.lookup("a", "r2") is False
    lookups.release("r2")
    assert lookups.tracked() == 0 and not lookups.busy()


def test_a_failed_load_makes_its_chunks_misses() -> None:
    ask = Asker()
    lookups = TierLookups(ask, max_pending=100)
    lookups.lookup("a", "r1")
    lookups.flush()
    ask.answer(0, {"a"})
    assert lookups.lookup("a", "r1") is True
    lookups.mark_miss(["a", "unknown"])
    assert lookups.lookup("a", "r1") is False


def test_more_chunks_waiting_than_allowed_are_misses_and_never_asked() -> None:
    ask = Asker()
    lookups = TierLookups(ask, max_pending=2)
    assert [lookups.lookup(k, "r1") for k in "abc"] == [None, None, False]
    lookups.flush()
    assert ask.asked[0][0] == ["a", "b"]
    ask.answer(0, {"a", "b"})
    assert lookups.lookup("c", "r1") is None  # room again: now it is asked


def test_an_asker_that_raises_gives_misses() -> None:
    ask = Asker()
    lookups = TierLookups(ask, max_pending=100)
    lookups.lookup("a", "r1")
    lookups.flush()
    ask.asked[0][1].set_exception(RuntimeError("bug"))
    assert lookups.lookup("a", "r1") is False
    assert not lookups.busy()
