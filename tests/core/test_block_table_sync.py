"""``update_block_table`` / ``block_table_delta``: a persistent block table kept by
incremental writes, and every bad argument refused with nothing written or consumed.

The content check of the same API under random operations is level (a) of the content
oracle (``test_content_oracle.py``); these are the hand-built cases and hostile inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvblocks
from kvblocks import KVCacheManager


def _running(m: KVCacheManager, sid: int, prompt: list[int]) -> None:
    """Add ``sid`` and compute its prompt, sampling one token."""
    m.add_sequence(sid, prompt)
    assert m.allocate_slots(sid, len(prompt)) is not None
    m.commit(sid, len(prompt), [99])


def _decode(m: KVCacheManager, sid: int, steps: int) -> None:
    for t in range(steps):
        assert m.allocate_slots(sid, 1) is not None
        m.commit(sid, 1, [t])


@pytest.fixture
def m() -> KVCacheManager:
    mgr = KVCacheManager(64, 4, num_cpu_blocks=32, watermark=0.0)
    _running(mgr, 1, list(range(10)))
    _running(mgr, 2, list(range(20, 26)))
    return mgr


def _row_ok(table: np.ndarray, row: int, m: KVCacheManager, sid: int) -> None:
    want = m.block_table(sid)
    np.testing.assert_array_equal(table[row, : len(want)], want)
    assert not table[row, len(want) :].any()


def test_first_sync_writes_rows_whole_and_pads_them(m: KVCacheManager) -> None:
    table = np.full((4, 8), 77, dtype=np.int32)
    delta = m.update_block_table(table, np.array([1, 2]), np.array([3, 0], np.int32))
    _row_ok(table, 3, m, 1)
    _row_ok(table, 0, m, 2)
    assert (table[[1, 2]] == 77).all(), "rows not listed must not be touched"
    assert delta.rows.tolist() == [3, 0] and delta.reset.tolist() == [True, True]
    assert delta.start_cols.tolist() == [0, 0]
    assert delta.indptr.tolist() == [0, 3, 5]
    assert delta.block_ids.dtype == np.int32 and delta.rows.dtype == np.int32
    assert delta.indptr.dtype == np.int64 and delta.reset.dtype == np.bool_
    assert len(delta) == 2 and "BlockTableDelta" in repr(delta)


def test_later_syncs_write_only_the_new_entries(m: KVCacheManager) -> None:
    table = np.zeros((4, 8), dtype=np.int32)
    m.update_block_table(table, [1, 2], [0, 1])
    assert len(m.update_block_table(table, [1, 2], [0, 1])) == 0
    _decode(m, 1, 3)  # 11 -> 14 tokens: one new block
    table[0, 3:] = 55  # past the table: a sync that rewrote the row would clear it
    delta = m.update_block_table(table, [1, 2], [0, 1])
    assert delta.rows.tolist() == [0] and delta.start_cols.tolist() == [3]
    assert delta.reset.tolist() == [False]
    assert delta.block_ids.tolist() == [int(m.block_table(1)[3])]
    assert table[0, 4:].tolist() == [55] * 4, "an incremental sync wrote past the new entry"


def test_a_reused_or_new_row_is_written_whole(m: KVCacheManager) -> None:
    table = np.zeros((4, 8), dtype=np.int32)
    m.update_block_table(table, [1], [0])
    m.update_block_table(table, [2], [0])  # another sequence takes row 0
    delta = m.update_block_table(table, [1], [0])
    assert delta.reset.tolist() == [True]
    _row_ok(table, 0, m, 1)
    assert m.update_block_table(table, [1], [2]).reset.tolist() == [True]
    _row_ok(table, 2, m, 1)
    assert m.update_block_table(table, [1], [2], full=True).reset.tolist() == [True]


def test_copy_on_write_and_swap_in_rewrite_the_entries(m: KVCacheManager) -> None:
    table = np.zeros((4, 8), dtype=np.int32)
    m.update_block_table(table, [1, 2], [0, 1])
    m.fork(1, 3)
    assert m.allocate_slots(1, 0, num_lookahead_tokens=1) is not None  # CoW of block 2
    assert len(m.take_copy_on_writes()) == 1
    m.update_block_table(table, [1, 3], [0, 2])
    _row_ok(table, 0, m, 1)
    _row_ok(table, 2, m, 3)
    m.commit(1, 0)
    m.swap_out([2])
    _running(m, 4, list(range(40, 52)))  # takes the freed GPU blocks
    m.swap_in([2])
    delta = m.update_block_table(table, [2, 4], [1, 3])
    assert delta.reset.tolist() == [False, True]
    _row_ok(table, 1, m, 2)
    _row_ok(table, 3, m, 4)


def test_block_table_delta_matches_the_in_place_writes(m: KVCacheManager) -> None:
    twin = KVCacheManager(64, 4, num_cpu_blocks=32, watermark=0.0)
    _running(twin, 1, list(range(10)))
    _running(twin, 2, list(range(20, 26)))
    table = np.zeros((4, 8), dtype=np.int32)
    for step in range(6):
        a = m.update_block_table(table, [1, 2], [step % 2, 2])
        b = twin.block_table_delta([1, 2], [step % 2, 2], max_rows=4, max_blocks=8)
        for name in ("rows", "start_cols", "indptr", "block_ids", "reset"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        _decode(m, 1, 2)
        _decode(twin, 1, 2)


def _hostile_tables() -> list[tuple[str, object]]:
    base = np.zeros((4, 16), dtype=np.int32)
    read_only = np.zeros((4, 8), dtype=np.int32)
    read_only.flags.writeable = False
    return [
        ("int64", np.zeros((4, 8), dtype=np.int64)),
        ("uint32", np.zeros((4, 8), dtype=np.uint32)),
        ("float", np.zeros((4, 8))),
        ("1-D", np.zeros(32, dtype=np.int32)),
        ("3-D", np.zeros((4, 8, 1), dtype=np.int32)),
        ("strided", base[:, ::2]),
        ("fortran", np.asfortranarray(np.zeros((4, 8), dtype=np.int32))),
        ("read-only", read_only),
        ("too narrow", np.zeros((4, 2), dtype=np.int32)),
        ("list", [[0] * 8] * 4),
        ("none", None),
    ]


@pytest.mark.parametrize("name", [n for n, _ in _hostile_tables()])
def test_bad_tables_are_refused_with_nothing_changed(m: KVCacheManager, name: str) -> None:
    bad = dict(_hostile_tables())[name]
    before = np.array(bad, copy=True) if bad is not None else None
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.update_block_table(bad, [1], [0])
    if before is not None:
        np.testing.assert_array_equal(np.asarray(bad), before)
    # Nothing was consumed: the next good sync still writes the whole table.
    table = np.zeros((4, 8), dtype=np.int32)
    assert m.update_block_table(table, [1], [0]).reset.tolist() == [True]
    _row_ok(table, 0, m, 1)


@pytest.mark.parametrize(
    ("seq_ids", "rows", "error"),
    [
        ([1], [4], kvblocks.InvalidArgumentError),  # row out of range
        ([1], [-1], kvblocks.InvalidArgumentError),
        ([1, 2], [1, 1], kvblocks.InvalidArgumentError),  # duplicate row
        ([1, 1], [0, 1], kvblocks.InvalidArgumentError),  # duplicate sequence
        ([1, 2], [0], kvblocks.InvalidArgumentError),  # lengths differ
        ([1], ["a"], kvblocks.InvalidArgumentError),
        ([1], [0.5], kvblocks.InvalidArgumentError),
        ([1, 9], [0, 1], kvblocks.UnknownSequenceError),
    ],
)
def test_bad_rows_and_ids_are_refused_with_nothing_changed(
    m: KVCacheManager, seq_ids: list[int], rows: list[object], error: type[Exception]
) -> None:
    table = np.full((4, 8), 5, dtype=np.int32)
    with pytest.raises(error):
        m.update_block_table(table, seq_ids, rows)
    assert (table == 5).all()
    with pytest.raises(error):
        m.block_table_delta(seq_ids, rows, max_rows=4, max_blocks=8)
    m.check_invariants()
    assert m.update_block_table(table, [1, 2], [0, 1]).reset.tolist() == [True, True]


def test_swapped_sequences_and_bad_shapes_are_refused(m: KVCacheManager) -> None:
    table = np.full((4, 8), 5, dtype=np.int32)
    m.swap_out([2])
    with pytest.raises(kvblocks.SequenceStateError):
        m.update_block_table(table, [1, 2], [0, 1])
    assert (table == 5).all()
    for kwargs in ({"max_rows": -1, "max_blocks": 8}, {"max_rows": 4, "max_blocks": 2}):
        with pytest.raises(kvblocks.InvalidArgumentError):
            m.block_table_delta([1], [0], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.update_block_table(table, [1], [0], full="yes")  # type: ignore[arg-type]
    assert m.update_block_table(table, [1], [0]).reset.tolist() == [True]


def test_decode_sync_writes_as_update_block_table_and_gives_the_decode_slots(
    m: KVCacheManager,
) -> None:
    twin = KVCacheManager(64, 4, num_cpu_blocks=32, watermark=0.0)
    _running(twin, 1, list(range(10)))
    _running(twin, 2, list(range(20, 26)))
    table = np.zeros((4, 8), dtype=np.int32)
    twin_table = np.zeros((4, 8), dtype=np.int32)
    ids = np.array([2, 1], dtype=np.int64)
    for step in range(7):
        for mgr in (m, twin):
            mgr.allocate_slots_batch(ids, 1)
        rows = np.array([step % 2, 3], dtype=np.int32)
        positions = np.array([m.num_tokens(int(s)) - 1 for s in ids], dtype=np.int64)
        delta, slots = m.update_decode_block_table(table, ids, rows, positions)
        want = twin.update_block_table(twin_table, ids, rows)
        np.testing.assert_array_equal(table, twin_table)
        for name in ("rows", "start_cols", "indptr", "block_ids", "reset"):
            np.testing.assert_array_equal(getattr(delta, name), getattr(want, name))
        # The slot of each token the step computes, as slot_mapping gives it.
        assert slots.dtype == np.int64
        np.testing.assert_array_equal(slots, twin.slot_mapping(ids, 1))
        for mgr in (m, twin):
            mgr.commit_batch(ids, 1, np.array([7, 8]))


@pytest.mark.parametrize("positions", [[3], [3, 4, 5], [3, 32], [-1, 3]])
def test_decode_sync_refuses_bad_positions_with_nothing_changed(
    m: KVCacheManager, positions: list[int]
) -> None:
    table = np.full((4, 8), 5, dtype=np.int32)
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.update_decode_block_table(table, [1, 2], [0, 1], positions)
    assert (table == 5).all()
    # Nothing was consumed: the next sync still writes both tables whole.
    assert m.update_block_table(table, [1, 2], [0, 1]).reset.tolist() == [True, True]


def test_decode_step_allocates_syncs_and_gives_the_slots_in_one_call(m: KVCacheManager) -> None:
    twin = KVCacheManager(64, 4, num_cpu_blocks=32, watermark=0.0)
    _running(twin, 1, list(range(10)))
    _running(twin, 2, list(range(20, 26)))
    table = np.zeros((4, 8), dtype=np.int32)
    twin_table = np.zeros((4, 8), dtype=np.int32)
    ids = np.array([2, 1], dtype=np.int64)
    for step in range(7):
        rows = np.array([step % 2, 3], dtype=np.int32)
        positions = np.array([m.num_tokens(int(s)) - 1 for s in ids], dtype=np.int64)
        served, synced = m.allocate_decode_step(table, ids, rows, positions)
        assert twin.allocate_slots_batch(ids, 1).num_served == served == 2
        assert synced is not None
        delta, slots = synced
        want = twin.update_block_table(twin_table, ids, rows)
        np.testing.assert_array_equal(table, twin_table)
        for name in ("rows", "start_cols", "indptr", "block_ids", "reset"):
            np.testing.assert_array_equal(getattr(delta, name), getattr(want, name))
        assert slots.dtype == np.int64
        np.testing.assert_array_equal(slots, twin.slot_mapping(ids, 1))
        for mgr in (m, twin):
            mgr.commit_batch(ids, 1, np.array([7, 8]))


def test_decode_step_syncs_nothing_when_the_table_is_too_narrow(m: KVCacheManager) -> None:
    table = np.full((4, 2), 5, dtype=np.int32)  # 8 tokens: sequence 1 needs a third block
    positions = [m.num_tokens(1) - 1, m.num_tokens(2) - 1]
    served, synced = m.allocate_decode_step(table, [1, 2], [0, 1], positions)
    assert (served, synced) == (2, None)
    assert (table == 5).all()
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.allocate_decode_step(table, [1, 2], [0, 0], positions)  # a row twice


def _positions_outside(m: KVCacheManager, reserved: bool) -> list[list[int]]:
    """Positions of sequence 1 (beside sequence 2's next token) inside a 16-column table
    but in no block sequence 1 holds (after its step's reservation when ``reserved``):
    past its table, far past it."""
    bs = m.block_size
    blocks = len(m.block_table(1)) + (0 if reserved else 1)  # the step may add a block
    return [[blocks * bs + off, m.num_tokens(2) - 1] for off in (0, bs - 1, 5 * bs)]


def test_decode_sync_refuses_positions_outside_the_sequences_table(m: KVCacheManager) -> None:
    # They were read from the row's null padding: a slot of the null block, where the
    # token's K/V would have been written and lost.
    ids = np.array([1, 2], dtype=np.int64)
    m.allocate_slots_batch(ids, 1)
    for positions in _positions_outside(m, reserved=True):
        table = np.full((4, 16), 5, dtype=np.int32)
        with pytest.raises(kvblocks.InvalidArgumentError, match="position"):
            m.update_decode_block_table(table, ids, [0, 1], positions)
        assert (table == 5).all()
    # Nothing was consumed: the next sync still writes both tables whole.
    assert m.update_block_table(table, [1, 2], [0, 1]).reset.tolist() == [True, True]


def test_decode_sync_refuses_positions_in_released_window_blocks() -> None:
    m = KVCacheManager(64, 4, sliding_window=4)
    _running(m, 1, list(range(17)))  # blocks 0..2 released: the window sees 14..17
    m.allocate_slots(1, 1)
    assert m.block_table(1)[0] == 0
    table = np.full((2, 8), 5, dtype=np.int32)
    with pytest.raises(kvblocks.InvalidArgumentError, match="position"):
        m.update_decode_block_table(table, [1], [0], [1])
    assert (table == 5).all()
    _, slots = m.update_decode_block_table(table, [1], [0], [17])
    np.testing.assert_array_equal(slots, m.slot_mapping([1], 1))


def test_decode_step_refuses_positions_outside_the_sequences_table(m: KVCacheManager) -> None:
    ids = np.array([1, 2], dtype=np.int64)
    free, tokens = m.num_free_blocks(), [m.num_tokens(1), m.num_tokens(2)]
    for positions in _positions_outside(m, reserved=False):
        table = np.full((4, 16), 5, dtype=np.int32)
        with pytest.raises(kvblocks.InvalidArgumentError, match="position"):
            m.allocate_decode_step(table, ids, [0, 1], positions)
        assert (table == 5).all()
    # Nothing changed: no block taken, no slot reserved (the right positions still work).
    assert m.num_free_blocks() == free
    positions = [t - 1 for t in tokens]
    served, synced = m.allocate_decode_step(table, ids, [0, 1], positions)
    assert served == 2 and synced is not None
    np.testing.assert_array_equal(synced[1], m.slot_mapping(ids, 1))
