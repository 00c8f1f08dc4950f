"""The decode column store keeps priority order and its seq-id -> row index."""

from __future__ import annotations

import numpy as np

from kvblocks.scheduler.seq_table import SequenceTable, empty_rows


def _rows(seq_ids: list[int], prio: list[int], arrival: list[float], counter: list[int]):
    rows = empty_rows(len(seq_ids))
    rows["seq_id"][:] = seq_ids
    rows["prio"][:] = prio
    rows["arrival"][:] = arrival
    rows["counter"][:] = counter
    rows["last_token"][:] = [s * 10 for s in seq_ids]
    return rows


def test_rows_stay_sorted_by_priority_arrival_counter_seq() -> None:
    table = SequenceTable()
    table.update(None, [_rows([5, 6], [0, 0], [1.0, 1.0], [1, 1])])
    table.update(None, [_rows([7], [0], [2.0], [2])])  # in order: appended
    assert table["seq_id"].tolist() == [5, 6, 7]
    table.update(None, [_rows([9, 8], [0, 0], [0.5, 1.0], [3, 0])])  # out of order: sorted
    assert table["seq_id"].tolist() == [9, 8, 5, 6, 7]
    table.update(None, [_rows([4], [-1], [9.0], [4])])  # smaller priority value goes first
    assert table["seq_id"].tolist() == [4, 9, 8, 5, 6, 7]
    assert table["last_token"].tolist() == [40, 90, 80, 50, 60, 70]
    ids = np.array([7, 4, 8], dtype=np.int64)
    assert table["seq_id"][table.rows_of(ids)].tolist() == [7, 4, 8]


def test_removal_keeps_order_and_forgets_rows() -> None:
    table = SequenceTable()
    table.update(None, [_rows(list(range(2000, 2010)), [0] * 10, list(range(10)), list(range(10)))])
    table.update(np.array([0, 3, 9]), [])
    assert table["seq_id"].tolist() == [2001, 2002, 2004, 2005, 2006, 2007, 2008]
    assert table.row_of[2000] == -1 and table.row_of[2009] == -1
    assert table.rows_of(np.array([2008, 2001])).tolist() == [6, 0]
