"""Page-table exports per KV cache group: stacked tables in one call (each group's pages
exactly what the one-group export of its own table gives), a window group's pages
without its released ones (``skip_released``), and ``SchedulerOutput``'s per-group
exports. What a kernel reads through them is checked by content in the scheduler's
oracle (``oracle.page_table_reads``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import GroupSpec, InvalidArgumentError, KVCacheManager
from kvblocks.page_tables import flash_attention_page_table, flashinfer_page_table
from kvblocks.scheduler import (
    ModelStepResult,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

BS = 4


def _decoding_manager() -> tuple[KVCacheManager, np.ndarray, np.ndarray]:
    """Three groups (full, window 6, chunked 8), four sequences of different lengths with
    this step's token reserved; their ids and lengths (query included)."""
    m = KVCacheManager(
        128,
        BS,
        groups=[
            GroupSpec.full_attention(),
            GroupSpec.sliding_window(6),
            GroupSpec.chunked_local_attention(8),
        ],
    )
    ids = np.array([3, 1, 7, 5], dtype=np.int64)
    for sid, n in zip(ids.tolist(), [13, 1, 20, 8], strict=True):
        m.add_sequence(sid, list(range(100 * sid, 100 * sid + n)))
        assert m.allocate_slots(sid, n - 1) is not None
        m.commit(sid, n - 1)
        assert m.allocate_slots(sid, 1) is not None
    lens = np.array([m.num_tokens(int(s)) for s in ids], dtype=np.int32)
    return m, ids, lens


@pytest.mark.parametrize("persistent", [False, True])
def test_stacked_group_tables_export_each_groups_pages(persistent: bool) -> None:
    m, ids, lens = _decoding_manager()
    if persistent:
        tables = np.zeros((m.num_groups, 9, 12), dtype=np.int32)
        rows = np.array([8, 0, 4, 2], dtype=np.int64)
        m.update_group_block_tables(tables, ids, rows)
    else:
        tables = m.group_block_tables(ids)
        rows = None
    assert tables.shape[0] == 3
    fi = flashinfer_page_table(tables, lens, BS, rows=rows)
    fa = flash_attention_page_table(tables, lens, BS, rows=rows)
    assert fi.kv_indices.shape == (3, int(fi.kv_indptr[-1]))
    assert fi.kv_indices.flags.c_contiguous and fa.block_table.flags.c_contiguous
    for g in range(3):
        one_fi = flashinfer_page_table(tables[g], lens, BS, rows=rows)
        one_fa = flash_attention_page_table(tables[g], lens, BS, rows=rows)
        np.testing.assert_array_equal(fi.kv_indices[g], one_fi.kv_indices)
        np.testing.assert_array_equal(fi.kv_indptr, one_fi.kv_indptr)
        np.testing.assert_array_equal(fi.kv_last_page_len, one_fi.kv_last_page_len)
        np.testing.assert_array_equal(fa.block_table[g], one_fa.block_table)
        # Each group's pages are that group's table, null (released) entries in place.
        for i, sid in enumerate(ids.tolist()):
            pages = fi.kv_indices[g, fi.kv_indptr[i] : fi.kv_indptr[i + 1]]
            np.testing.assert_array_equal(pages, m.block_table(sid, group=g))
    # The window and chunked groups export released entries as the null block.
    assert (fi.kv_indices[1] == 0).any() and (fi.kv_indices[2] == 0).any()
    assert not (fi.kv_indices[0] == 0).any()


def test_uniform_stacked_rows_are_cut_per_group() -> None:
    tables = np.arange(1, 25, dtype=np.int32).reshape(2, 3, 4)
    lens = np.array([5, 8, 6], dtype=np.int32)  # two blocks each
    fi = flashinfer_page_table(tables, lens, BS)
    np.testing.assert_array_equal(fi.kv_indices, tables[:, :, :2].reshape(2, -1))
    fa = flash_attention_page_table(tables, lens, BS)
    assert fa.block_table is tables


def test_skip_released_exports_each_rows_pages_from_its_first_held_block() -> None:
    table = np.array([[0, 0, 5, 6, 9], [3, 4, 0, 0, 0], [0, 7, 8, 0, 0]], dtype=np.int32)
    lens = np.array([15, 8, 9], dtype=np.int32)  # 4, 2 and 3 pages
    qsl = np.array([0, 1, 3, 4], dtype=np.int32)
    fi = flashinfer_page_table(table, lens, BS, qsl, skip_released=True)
    np.testing.assert_array_equal(fi.kv_indices, [5, 6, 3, 4, 7, 8])
    np.testing.assert_array_equal(fi.kv_indptr, [0, 2, 4, 6])
    np.testing.assert_array_equal(fi.kv_start, [8, 0, 4])
    np.testing.assert_array_equal(fi.kv_last_page_len, [3, 4, 1])
    assert fi.kv_start is not None and fi.kv_start.dtype == np.int32
    # FlashInfer reads seq_len - kv_start tokens: the pages' count and last length.
    seen = (np.diff(fi.kv_indptr) - 1) * BS + fi.kv_last_page_len
    np.testing.assert_array_equal(seen, lens - fi.kv_start)
    # The same through rows of a persistent table; and in place, no kv_start.
    persistent = np.zeros((6, 5), dtype=np.int32)
    rows = np.array([4, 0, 2])
    persistent[rows] = table
    again = flashinfer_page_table(persistent, lens, BS, qsl, rows=rows, skip_released=True)
    np.testing.assert_array_equal(again.kv_indices, fi.kv_indices)
    np.testing.assert_array_equal(again.kv_start, fi.kv_start)
    assert flashinfer_page_table(table, lens, BS).kv_start is None


def test_skip_released_rejects_what_it_cannot_export() -> None:
    tables = np.ones((2, 1, 2), dtype=np.int32)
    lens = np.array([5], dtype=np.int32)
    with pytest.raises(InvalidArgumentError, match="2-D"):
        flashinfer_page_table(tables, lens, BS, skip_released=True)
    with pytest.raises(InvalidArgumentError, match="null pages"):
        flashinfer_page_table(np.zeros((1, 2), np.int32), lens, BS, skip_released=True)
    # Query tokens in a released page: the table is not one the step can run with.
    with pytest.raises(InvalidArgumentError, match="query tokens"):
        flashinfer_page_table(
            np.array([[0, 2]], np.int32), lens, BS, np.array([0, 3]), skip_released=True
        )
    with pytest.raises(InvalidArgumentError, match="skip_released"):
        flashinfer_page_table(tables[0], lens, BS, skip_released=1)  # type: ignore[arg-type]


def _hybrid_step() -> tuple[KVCacheManager, SchedulerOutput]:
    m = KVCacheManager(64, BS, groups=[GroupSpec.full_attention(), GroupSpec.sliding_window(6)])
    sched = Scheduler(m, SchedulerConfig(max_num_batched_tokens=64))
    for i, n in enumerate([13, 22, 5]):
        sched.add_request(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4)))
    out = sched.schedule()
    sched.update(out, ModelStepResult(np.full(int(out.sample_counts.sum()), 7, np.int64)))
    return m, sched.schedule()


def test_scheduler_output_exports_every_group() -> None:
    _, out = _hybrid_step()
    assert out.num_groups == 2 and out.num_seqs == 3
    tables = out.group_block_tables
    all_fi = out.group_flashinfer_page_tables(BS)
    all_fa = out.group_flash_attention_page_tables(BS)
    for g in range(2):
        want = flashinfer_page_table(tables[g], out.seq_lens, BS, out.query_start_loc)
        for got in (out.flashinfer_page_table(BS, g), all_fi[g]):
            np.testing.assert_array_equal(got.kv_indices, want.kv_indices)
            np.testing.assert_array_equal(got.kv_indptr, want.kv_indptr)
            np.testing.assert_array_equal(got.qo_indptr, want.qo_indptr)
        want_fa = flash_attention_page_table(tables[g], out.seq_lens, BS, out.query_start_loc)
        for got_fa in (out.flash_attention_page_table(BS, g), all_fa[g]):
            used = want_fa.block_table.shape[1]
            np.testing.assert_array_equal(got_fa.block_table[:, :used], want_fa.block_table)
            assert not got_fa.block_table[:, used:].any()
            np.testing.assert_array_equal(got_fa.cache_seqlens, want_fa.cache_seqlens)
        skipped = out.flashinfer_page_table(BS, g, skip_released=True)
        assert skipped.kv_start is not None
        assert (skipped.kv_start > 0).any() == (g == 1)
    # Group 1's pages are the window's: no null block once the released ones are skipped.
    assert (all_fi[1].kv_indices == 0).any()
    assert not (out.group_flashinfer_page_tables(BS, skip_released=True)[1].kv_indices == 0).any()
    # Group 0 is what the single-group calls gave.
    np.testing.assert_array_equal(out.flash_attention_page_table(BS).block_table, out.block_tables)


@pytest.mark.parametrize("group", [-1, 2, True, "1", 1.0])
def test_a_group_outside_the_step_is_rejected(group: object) -> None:
    _, out = _hybrid_step()
    for call in (out.flashinfer_page_table, out.flash_attention_page_table):
        with pytest.raises(InvalidArgumentError, match="group"):
            call(BS, group)  # type: ignore[arg-type]


def test_a_single_group_step_has_group_zero_only() -> None:
    m = KVCacheManager(32, BS)
    sched = Scheduler(m, SchedulerConfig())
    sched.add_request(Request("r", list(range(1, 10)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_groups == 1
    assert len(out.group_flashinfer_page_tables(BS)) == 1
    np.testing.assert_array_equal(
        out.group_flash_attention_page_tables(BS)[0].block_table, out.block_tables
    )
    with pytest.raises(InvalidArgumentError, match="group"):
        out.flashinfer_page_table(BS, 1)


def test_skip_released_of_empty_sequences_and_batches() -> None:
    for lens in (np.zeros(2, np.int32), np.zeros(0, np.int32)):
        table = np.zeros((len(lens), 3), np.int32)
        fi = flashinfer_page_table(table, lens, BS, skip_released=True)
        assert fi.kv_indices.size == 0 and fi.kv_start is not None
        np.testing.assert_array_equal(fi.kv_indptr, np.zeros(len(lens) + 1))
        np.testing.assert_array_equal(fi.kv_start, np.zeros(len(lens)))


@pytest.mark.parametrize("build", [flashinfer_page_table, flash_attention_page_table])
@pytest.mark.parametrize("lens", [[4, 4], [4, 8]])
def test_a_stack_of_no_group_tables_is_rejected(build: object, lens: list[int]) -> None:
    # A [0, S, B] stack: FlashInfer's export raised a bare ValueError (reshape) for equal
    # lengths and returned indptr naming pages of an empty kv_indices for ragged ones;
    # FlashAttention's returned a block table of no group.
    with pytest.raises(InvalidArgumentError, match="at least one"):
        build(np.zeros((0, 2, 4), np.int32), np.array(lens), 4)  # type: ignore[operator]


@pytest.mark.parametrize("groups", [(), (2,)])
def test_rows_of_a_zero_width_table_export_no_pages(groups: tuple[int, ...]) -> None:
    # Empty sequences in a persistent table of no columns: with rows= the export raised
    # "rows[0] = 0 is outside the table's 0 rows" (the gather saw no rows in no entries).
    table = np.zeros((*groups, 3, 0), np.int32)
    lens, rows = np.array([0, 0]), np.array([2, 0])
    pt = flashinfer_page_table(table, lens, 4, rows=rows)
    assert pt.kv_indptr.tolist() == [0, 0, 0] and pt.kv_last_page_len.tolist() == [0, 0]
    assert pt.kv_indices.shape == (*groups, 0) and pt.kv_indices.dtype == np.int32


def _hand_built(**fields: object) -> SchedulerOutput:
    """A one-sequence, three-token record built by hand (no scheduler), ``fields`` added."""
    i32, i64 = np.int32, np.int64
    return SchedulerOutput(
        seq_ids=np.array([1], i64),
        num_scheduled_tokens=np.array([3], i32),
        input_token_ids=np.array([1, 2, 3], i64),
        positions=np.array([0, 1, 2], i64),
        slot_mapping=np.array([4, 5, 6], i64),
        query_start_loc=np.array([0, 3], i32),
        seq_lens=np.array([3], i32),
        block_tables=np.array([[1]], i32),
        logits_indices=np.array([2], i64),
        sample_seq_ids=np.array([1], i64),
        sample_request_ids=["r"],
        sample_counts=np.array([1], i32),
        temperature=np.zeros(1, np.float32),
        top_p=np.ones(1, np.float32),
        top_k=np.zeros(1, i32),
        seeds=np.full(1, -1, i64),
        **fields,  # type: ignore[arg-type]
    )


_SLOTS = np.array([[4, 5, 6], [8, 9, 10]], np.int64)
_TABLES = np.ones((3, 1, 1), np.int32)  # three groups' persistent tables, one row


@pytest.mark.parametrize(
    "fields",
    [
        {"group_slot_mappings": _SLOTS},  # two groups of slots, one of tables
        {"group_slot_mappings": _SLOTS, "group_block_table": _TABLES},  # two and three
        {"group_slot_mappings": _SLOTS[:1], "group_block_table": _TABLES},  # one and three
        {"group_slot_mappings": _SLOTS[0]},  # 1-D: its three tokens read as three groups
        {"group_slot_mappings": _SLOTS[:1, :2]},  # two tokens of three
        {"group_block_table": _TABLES[0]},  # 2-D: its one row read as one group
    ],
)
def test_a_hand_built_record_whose_groups_disagree_is_rejected(
    fields: dict[str, object],
) -> None:
    # Two slot-mapping rows beside one group of tables raised IndexError from the
    # exports; a 1-D slot mapping was taken as one group per token.
    out = _hand_built(block_table_rows=np.array([0], np.int32), **fields)
    calls = [
        lambda: out.num_groups,
        lambda: out.flashinfer_page_table(BS, 1),
        lambda: out.flash_attention_page_table(BS, 1),
        lambda: out.group_flashinfer_page_tables(BS),
        lambda: out.group_flash_attention_page_tables(BS),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=r"group_(slot_mappings|block_table)"):
            call()


def test_a_hand_built_record_with_consistent_groups_exports_them() -> None:
    out = _hand_built(group_slot_mappings=_SLOTS[:1])
    assert out.num_groups == 1 and len(out.group_flashinfer_page_tables(BS)) == 1
    both = _hand_built(
        group_slot_mappings=_SLOTS,
        group_block_table=np.array([[[1]], [[2]]], np.int32),
        block_table_rows=np.array([0], np.int32),
    )
    assert both.num_groups == 2
    assert both.flashinfer_page_table(BS, 1).kv_indices.tolist() == [2]
