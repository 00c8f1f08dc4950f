"""The scheduler's persistent block table: row allocation, growth and the delta helpers.

The content side (the engine reading KV through the table) is level (b) of the content
oracle; these are the bookkeeping cases it reaches only rarely.
"""

from __future__ import annotations

import numpy as np

from kvblocks import KVCacheManager
from kvblocks.scheduler.block_table import (
    INITIAL_COLUMNS,
    PersistentBlockTable,
    TableWrites,
    apply_delta,
    delta_indices,
)
from oracle.reference_manager import ReferenceKVCacheManager


def _manager(cls: type, ids: list[int], length: int) -> object:
    m = cls(4096, 4, watermark=0.0, enable_prefix_caching=False)
    for sid in ids:
        m.add_sequence(sid, list(range(length)))
        assert m.allocate_slots(sid, length) is not None
        m.commit(sid, length, [1])
    return m


def _check(bt: PersistentBlockTable, m: object, ids: list[int]) -> None:
    for sid in ids:
        want = m.block_table(sid)  # type: ignore[attr-defined]
        row = bt.table[bt.row_of(sid)]
        assert (row[: len(want)] == want).all() and not row[len(want) :].any(), sid


def test_rows_grow_keep_content_and_are_reused() -> None:
    ids = [3, 1500, 7, 2100, 9]  # ids past the initial id map
    m = _manager(KVCacheManager, ids, 10)
    bt = PersistentBlockTable(m, num_rows=2, block_size=4)
    seq = np.array(ids[:2], dtype=np.int64)
    rows = bt.assign(seq)
    bt.sync(seq, rows, np.array([11, 11], np.int32))
    bt.step_done()
    first = bt.table
    seq = np.array(ids, dtype=np.int64)
    rows = bt.assign(seq)  # three more: the table doubles its rows, twice
    assert bt.table.shape[0] == 8 and bt.reallocated and bt.table is not first
    assert rows[:2].tolist() == [0, 1] and len(set(rows.tolist())) == 5
    delta = bt.sync(seq, rows, np.full(5, 11, np.int32))
    assert delta.rows.tolist() == rows[2:].tolist(), "rows 0 and 1 kept their content"
    _check(bt, m, ids)
    bt.release([1500, 7, 12345])  # an id without a row is ignored
    assert bt.num_held_rows() == 3 and bt.row_of(1500) == -1
    rows2 = bt.assign(np.array([7], np.int64))
    assert rows2[0] in (rows[1], rows[2])  # a released row is reused


def test_a_decode_batch_keeps_its_rows_until_a_row_moves() -> None:
    """allocate_decodes under a batch key reuses the batch's rows only while no row was
    given or taken back: a stale copy would sync sequence 3 into a row it left."""
    ids = [3, 5]
    m = _manager(KVCacheManager, ids, 10)
    bt = PersistentBlockTable(m, num_rows=4, block_size=4)
    seq = np.array(ids, dtype=np.int64)
    lens = np.full(2, 11, dtype=np.int64)
    bt.assign(seq)
    done = bt.allocate_decodes(seq, lens, 0, batch_key=(0, 2))
    assert done is not None and done[0] == 2 and done[1] is not None
    first = done[1].rows
    assert first.tolist() == [bt.row_of(3), bt.row_of(5)]
    again = bt.allocate_decodes(seq, lens, 0, batch_key=(0, 2))
    assert again is not None and again[1] is not None
    assert again[1].rows.tolist() == first.tolist() and again[1].rows is not first
    bt.release([3])
    bt.assign(np.array([9], dtype=np.int64))  # takes the row sequence 3 left
    moved_to = bt.assign(seq)
    assert moved_to[0] != first[0]
    moved = bt.allocate_decodes(seq, lens, 0, batch_key=(0, 2))
    assert moved is not None and moved[1] is not None
    assert moved[1].rows.tolist() == moved_to.tolist()
    _check(bt, m, ids)


def test_columns_grow_to_the_longest_table() -> None:
    m = _manager(KVCacheManager, [0, 1], 4 * INITIAL_COLUMNS + 30)
    bt = PersistentBlockTable(m, num_rows=4, block_size=4, num_lookahead_tokens=3)
    seq = np.array([0, 1], np.int64)
    bt.sync(seq, bt.assign(seq), np.full(2, 4 * INITIAL_COLUMNS + 31, np.int32))
    assert bt.table.shape[1] >= INITIAL_COLUMNS * 2
    _check(bt, m, [0, 1])


def test_a_manager_without_update_block_table_gets_whole_rows() -> None:
    ids = [0, 1, 2]
    fast = _manager(KVCacheManager, ids, 21)
    ref = _manager(ReferenceKVCacheManager, ids, 21)
    a = PersistentBlockTable(fast, 4, 4)
    b = PersistentBlockTable(ref, 4, 4)
    seq = np.array(ids, np.int64)
    for step in range(6):
        lens = np.full(3, 22 + step, np.int32)
        a.sync(seq, a.assign(seq), lens)
        d = b.sync(seq, b.assign(seq), lens)
        assert isinstance(d, TableWrites) and d.reset.all()
        np.testing.assert_array_equal(a.table, b.table)
        for m in (fast, ref):
            assert m.allocate_slots_batch(seq, 1).num_served == 3
            m.commit_batch(seq, 1, np.ones(3, np.int64))


def test_delta_helpers_patch_a_copy() -> None:
    delta = TableWrites(
        rows=np.array([2, 0], np.int32),
        start_cols=np.array([1, 0], np.int32),
        indptr=np.array([0, 2, 3], np.int64),
        block_ids=np.array([5, 6, 9], np.int32),
        reset=np.array([False, True]),
    )
    rows, cols = delta_indices(delta)
    assert rows.tolist() == [2, 2, 0] and cols.tolist() == [1, 2, 0]
    table = np.full((3, 4), 7, np.int32)
    apply_delta(table, delta)
    assert table.tolist() == [[9, 0, 0, 0], [7, 7, 7, 7], [7, 5, 6, 7]]
    empty = TableWrites.empty()
    apply_delta(table, empty)
    assert len(empty) == 0 and delta_indices(empty)[0].size == 0
