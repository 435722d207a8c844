from __future__ import annotations

from asyncconn.transfer.runs import runs


def test_runs_cut_ids_where_they_stop_being_consecutive() -> None:
    assert runs([]) == []
    assert runs([7]) == [(7, 1)]
    assert runs([4, 5, 6, 9, 10, 3]) == [(4, 3), (9, 2), (3, 1)]
    assert runs([5, 4, 3]) == [(5, 1), (4, 1), (3, 1)]  # descending ids are not a run
    assert runs([2, 2]) == [(2, 1), (2, 1)]
