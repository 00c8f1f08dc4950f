"""Page-table exports of stacked KV cache group tables: one call for every group, each
group's pages exactly what the one-group export of its own table gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import GroupSpec, KVCacheManager
from kvblocks.page_tables import flash_attention_page_table, flashinfer_page_table

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
