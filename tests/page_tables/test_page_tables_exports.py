"""FlashInfer / FlashAttention page-table exports on hand-built tables, exact arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvblocks
from kvblocks import InvalidArgumentError
from kvblocks.page_tables import (
    FlashAttentionPageTable,
    FlashInferPageTable,
    flash_attention_page_table,
    flashinfer_page_table,
)
from kvblocks.scheduler import SchedulerOutput

BS = 4
# seq 0: 8 tokens = two full blocks (length a multiple of the block size)
# seq 1: 1 token (one block, one slot used)
# seq 2: 6 tokens (a full block and 2 slots)
# seq 3: 0 tokens (a padded batch row: no pages)
# Unused entries hold the null block 0.
TABLE = np.array([[5, 6, 0, 0], [7, 0, 0, 0], [1, 2, 0, 0], [0, 0, 0, 0]], dtype=np.int32)
LENS = np.array([8, 1, 6, 0], dtype=np.int32)
# Mixed batch: seqs 0 and 1 decode one token, seq 2 computes a 3-token chunk, seq 3 none.
QSL = np.array([0, 1, 2, 5, 5], dtype=np.int32)


def _i32(*values: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.array(values, dtype=np.int32)


def _assert_exact(actual: np.ndarray[Any, Any] | None, expected: np.ndarray[Any, Any]) -> None:
    assert actual is not None
    assert actual.dtype == np.int32
    assert actual.flags.c_contiguous
    np.testing.assert_array_equal(actual, expected, strict=True)


def test_flashinfer_csr_exact() -> None:
    pt = flashinfer_page_table(TABLE, LENS, BS, QSL)
    assert isinstance(pt, FlashInferPageTable)
    _assert_exact(pt.kv_indptr, _i32(0, 2, 3, 5, 5))
    _assert_exact(pt.kv_indices, _i32(5, 6, 7, 1, 2))
    _assert_exact(pt.kv_last_page_len, _i32(4, 1, 2, 0))
    _assert_exact(pt.qo_indptr, QSL)
    assert pt.page_size == BS and pt.num_seqs == 4


def test_flashinfer_last_page_len_every_residue() -> None:
    lens = np.arange(1, 3 * BS + 1, dtype=np.int32)
    table = np.arange(1, lens.size * 3 + 1, dtype=np.int32).reshape(lens.size, 3)
    pt = flashinfer_page_table(table, lens, BS)
    # FlashInfer's length formula gives back every length; last page len is in [1, BS].
    pages = np.diff(pt.kv_indptr)
    np.testing.assert_array_equal((pages - 1) * BS + pt.kv_last_page_len, lens)
    _assert_exact(pt.kv_last_page_len, (lens - 1) % BS + 1)
    _assert_exact(pages.astype(np.int32), (lens + BS - 1) // BS)
    assert pt.qo_indptr is None


def test_flash_attention_exact() -> None:
    pt = flash_attention_page_table(TABLE, LENS, BS, QSL)
    assert isinstance(pt, FlashAttentionPageTable)
    _assert_exact(pt.block_table, TABLE)
    _assert_exact(pt.cache_seqlens, LENS)
    _assert_exact(pt.cu_seqlens_q, QSL)
    _assert_exact(pt.cu_seqlens_k, _i32(0, 8, 9, 15, 15))
    assert pt.max_seqlen_q == 3 and pt.max_seqlen_k == 8 and pt.num_seqs == 4


def test_flash_attention_decode_defaults() -> None:
    pt = flash_attention_page_table(TABLE, LENS, BS)
    assert pt.cu_seqlens_q is None and pt.max_seqlen_q == 1


def test_persistent_table_rows_skip_stale_entries() -> None:
    # A persistent [max_seqs, max_blocks] table: rows 4, 0, 2, 5 are the batch; the other
    # rows and the columns past each sequence's blocks hold stale ids (99) never exported.
    persistent = np.full((6, 5), 99, dtype=np.int32)
    persistent[4, :2] = [5, 6]
    persistent[0, :1] = [7]
    persistent[2, :2] = [1, 2]
    rows = np.array([4, 0, 2, 5], dtype=np.int64)
    fi = flashinfer_page_table(persistent, LENS, BS, QSL, rows=rows)
    _assert_exact(fi.kv_indptr, _i32(0, 2, 3, 5, 5))
    _assert_exact(fi.kv_indices, _i32(5, 6, 7, 1, 2))
    _assert_exact(fi.kv_last_page_len, _i32(4, 1, 2, 0))
    fa = flash_attention_page_table(persistent, LENS, BS, QSL, rows=rows)
    # Gathered and cut to the widest sequence's 2 blocks; past-the-end entries are padding.
    _assert_exact(fa.block_table, persistent[rows, :2])
    for seq, n in enumerate([2, 1, 2, 0]):
        np.testing.assert_array_equal(fa.block_table[seq, :n], TABLE[seq, :n])
    _assert_exact(fa.cache_seqlens, LENS)


def test_uniform_full_rows_are_a_view_of_the_table() -> None:
    table = np.arange(1, 13, dtype=np.int32).reshape(3, 4)
    lens = np.array([16, 13, 14], dtype=np.int32)  # all four blocks each
    fi = flashinfer_page_table(table, lens, BS)
    assert np.shares_memory(fi.kv_indices, table)
    _assert_exact(fi.kv_indices, table.reshape(-1))
    _assert_exact(fi.kv_last_page_len, _i32(4, 1, 2))
    # Same block counts but a narrower batch: a cut copy, still exact.
    fi = flashinfer_page_table(table, np.array([5, 8, 6], dtype=np.int32), BS)
    assert not np.shares_memory(fi.kv_indices, table)
    _assert_exact(fi.kv_indices, table[:, :2].reshape(-1))
    fa = flash_attention_page_table(table, lens, BS)
    assert fa.block_table is table


def test_int64_inputs_are_converted() -> None:
    pt = flashinfer_page_table(TABLE, LENS.astype(np.int64), BS, QSL.astype(np.int64))
    _assert_exact(pt.kv_last_page_len, _i32(4, 1, 2, 0))
    _assert_exact(pt.qo_indptr, QSL)


def test_empty_batch() -> None:
    table = np.zeros((0, 3), dtype=np.int32)
    lens = np.zeros(0, dtype=np.int32)
    fi = flashinfer_page_table(table, lens, BS, np.zeros(1, dtype=np.int32))
    _assert_exact(fi.kv_indptr, _i32(0))
    assert fi.kv_indices.shape == (0,) and fi.kv_last_page_len.shape == (0,)
    fa = flash_attention_page_table(table, lens, BS, np.zeros(1, dtype=np.int32))
    assert fa.max_seqlen_q == 0 and fa.max_seqlen_k == 0
    _assert_exact(fa.cu_seqlens_k, _i32(0))


def test_zero_copy_into_torch() -> None:
    torch = pytest.importorskip("torch")
    persistent = np.zeros((6, 5), dtype=np.int32)
    rows = np.array([4, 0, 2, 5], dtype=np.int32)
    for kwargs in ({}, {"rows": rows}):
        table = persistent if kwargs else TABLE
        fi = flashinfer_page_table(table, LENS, BS, QSL, **kwargs)
        fa = flash_attention_page_table(table, LENS, BS, QSL, **kwargs)
        arrays = [fi.kv_indptr, fi.kv_indices, fi.kv_last_page_len, fi.qo_indptr]
        arrays += [fa.block_table, fa.cache_seqlens, fa.cu_seqlens_q, fa.cu_seqlens_k]
        for array in arrays:
            assert array is not None and array.flags.c_contiguous and array.dtype == np.int32
            tensor = torch.from_numpy(array)
            assert tensor.dtype == torch.int32
            assert tensor.data_ptr() == array.ctypes.data


def test_scheduler_output_methods() -> None:
    out = SchedulerOutput.empty(4)
    out.block_tables, out.seq_lens, out.query_start_loc = TABLE, LENS, QSL
    fi = out.flashinfer_page_table(BS)
    _assert_exact(fi.kv_indices, _i32(5, 6, 7, 1, 2))
    _assert_exact(fi.qo_indptr, QSL)
    fa = out.flash_attention_page_table(BS)
    _assert_exact(fa.cu_seqlens_k, _i32(0, 8, 9, 15, 15))
    assert kvblocks.FlashInferPageTable is FlashInferPageTable


_BAD: list[tuple[str, dict[str, Any]]] = [
    ("table not an array", {"block_tables": TABLE.tolist()}),
    ("table int64", {"block_tables": TABLE.astype(np.int64)}),
    ("table 1-D", {"block_tables": TABLE.reshape(-1)}),
    ("lens float", {"seq_lens": LENS.astype(np.float32)}),
    ("lens 2-D", {"seq_lens": LENS.reshape(2, 2)}),
    ("lens count", {"seq_lens": LENS[:3]}),
    ("lens over capacity", {"seq_lens": _i32(8, 1, 17, 0)}),
    ("lens negative", {"seq_lens": _i32(8, -1, 6, 0)}),
    ("block size 0", {"block_size": 0}),
    ("block size bool", {"block_size": True}),
    ("block size float", {"block_size": 4.0}),
    ("qsl count", {"query_start_loc": QSL[:4]}),
    ("qsl start", {"query_start_loc": _i32(1, 2, 3, 5, 5)}),
    ("qsl decreasing", {"query_start_loc": _i32(0, 2, 1, 5, 5)}),
    ("query longer than seq", {"query_start_loc": _i32(0, 1, 3, 5, 5)}),
    ("rows count", {"rows": _i32(0, 1)}),
    ("rows out of table", {"rows": _i32(0, 1, 2, 4)}),
    ("rows negative", {"rows": _i32(0, 1, 2, -1)}),
    ("rows float", {"rows": np.zeros(4)}),
]


@pytest.mark.parametrize("build", [flashinfer_page_table, flash_attention_page_table])
@pytest.mark.parametrize(("case", "override"), _BAD, ids=[case for case, _ in _BAD])
def test_bad_input_raises(build: Any, case: str, override: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "block_tables": TABLE,
        "seq_lens": LENS,
        "block_size": BS,
        "query_start_loc": QSL,
    }
    args.update(override)
    with pytest.raises(InvalidArgumentError):
        build(**args)


def test_lengths_at_capacity_are_accepted() -> None:
    lens = _i32(16, 16, 16, 16)
    pt = flashinfer_page_table(TABLE, lens, BS)
    assert int(pt.kv_indptr[-1]) == 16


def test_non_contiguous_table_gives_contiguous_exports() -> None:
    wide = np.zeros((4, 9), dtype=np.int32)
    wide[:, ::2][:, :4] = TABLE  # the table as a strided view
    view = wide[:, ::2][:, :4]
    assert not view.flags.c_contiguous
    fi = flashinfer_page_table(view, LENS, BS, QSL)
    _assert_exact(fi.kv_indices, _i32(5, 6, 7, 1, 2))
    fa = flash_attention_page_table(view, LENS, BS, QSL)
    _assert_exact(fa.block_table, TABLE)
    full = np.asfortranarray(np.arange(1, 13, dtype=np.int32).reshape(3, 4))
    fi = flashinfer_page_table(full, np.array([16, 13, 14], dtype=np.int32), BS)
    _assert_exact(fi.kv_indices, np.arange(1, 13, dtype=np.int32))
