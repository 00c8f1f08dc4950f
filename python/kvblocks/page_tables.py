"""Page tables in the layouts FlashInfer and FlashAttention kernels take.

The block manager and the scheduler describe a step's KV cache as a 2-D block table
(``[S, B]`` int32, padded with the null block) plus ``seq_lens`` and ``query_start_loc``.
The attention libraries engines pair with want other forms:

* FlashInfer (``BatchDecodeWithPagedKVCacheWrapper.plan``,
  ``BatchPrefillWithPagedKVCacheWrapper.plan``): a CSR page list, ``kv_indptr`` [S+1],
  ``kv_indices`` [nnz] and ``kv_last_page_len`` [S], plus ``qo_indptr`` [S+1] for a batch
  with more than one query token per sequence (:class:`FlashInferPageTable`).
* FlashAttention (``flash_attn_with_kvcache`` / ``flash_attn_varlen_func`` with
  ``block_table``): ``block_table`` [S, max_blocks], ``cache_seqlens`` [S], and for the
  varlen form ``cu_seqlens_q`` / ``max_seqlen_q`` (:class:`FlashAttentionPageTable`).

Every array is C-contiguous int32, so ``torch.from_numpy`` wraps it without a copy. The
builders are whole-array NumPy or one Rust call (no per-sequence Python loop); where the
input already has the output's layout they return it, or a view of it, instead of
copying (documented per field). The table may be a per-step ``[S, B]`` table (row ``i`` =
sequence ``i``) or a persistent ``[max_seqs, max_blocks]`` table with ``rows`` giving each
sequence's row.

A manager with several KV cache groups (``KVCacheManager(groups=...)``) has one table per
group: pass them stacked, ``[G, S, B]`` (``KVCacheManager.group_block_tables``) or
``[G, max_seqs, max_blocks]`` (``update_group_block_tables``). A sequence's tables have
the same length in every group, so the lengths, ``kv_indptr`` and ``kv_last_page_len``
are shared and only the page ids are per group: ``kv_indices`` is ``[G, nnz]`` and
FlashAttention's ``block_table`` ``[G, S, B]``, row ``g`` for the layers of group ``g``
(a window or chunked group's released entries are the null block, which its kernels,
run with the group's window, never read).

For one window or chunked group's table, ``flashinfer_page_table(...,
skip_released=True)`` exports only the pages from each sequence's first held block on
(its leading null entries, the blocks no query of the step sees, are dropped) and
records where they start in ``kv_start``: FlashInfer then reads ``seq_len - kv_start``
tokens per sequence. Its causal and ``window_left`` masks depend only on the distance
between a query and a key, and both shift by ``kv_start``, so the kernel computes the
same attention over fewer pages (kvblocks writes K after RoPE, at absolute positions; a
kernel applying RoPE itself would need ``kv_start`` as the offset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks._core import gather_row_prefixes
from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int

__all__ = [
    "FlashAttentionPageTable",
    "FlashInferPageTable",
    "flash_attention_page_table",
    "flashinfer_page_table",
]

_I32 = npt.NDArray[np.int32]
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class FlashInferPageTable:
    """FlashInfer's paged-KV CSR form of one step (pass the fields to ``plan``).

    Sequence ``i`` owns the pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` (the first
    ``ceil(seq_lens[i] / page_size)`` entries of its block-table row, in order; padding
    and null-block entries past them are not exported) and holds
    ``(num_pages - 1) * page_size + kv_last_page_len[i]`` tokens.

    Attributes:
        kv_indptr: int32 [S+1] prefix sums of the page counts; ``kv_indptr[0] == 0``.
        kv_indices: int32 [nnz] page (block) ids, sequence after sequence (``[G, nnz]``,
            one row per KV cache group, for stacked group tables). When every sequence
            uses every column of a per-step table this is a flat view of that table (no
            copy): do not write to it.
        kv_last_page_len: int32 [S] tokens in each sequence's last page, in
            ``[1, page_size]`` (``page_size`` for a length that is a multiple of it);
            ``0`` for a sequence of length 0, which has no pages (FlashInfer reads the
            length of a sequence with an empty page range as 0).
        qo_indptr: int32 [S+1] query prefix sums (the step's ``query_start_loc``) for the
            prefill wrapper; ``None`` when none was given (decode: one query each).
        page_size: tokens per page (the manager's ``block_size``).

        kv_start: int32 [S] the position of each sequence's first exported token (a
            multiple of ``page_size``) when built with ``skip_released=True``: sequence
            ``i``'s pages hold its tokens ``[kv_start[i], seq_len[i])``, and FlashInfer
            sees ``seq_len[i] - kv_start[i]`` of them. ``None`` when every sequence's
            pages start at position 0.

    With a sliding window, blocks the manager released stay in the table as the null block
    and are exported in place by default (positions must not shift): run the kernel with
    the window (FlashInfer's ``window_left``) so that it never reads them. The same holds
    for FlashAttention's ``window_size``. ``skip_released=True`` drops them instead (see
    the module docs).
    """

    kv_indptr: _I32
    kv_indices: _I32
    kv_last_page_len: _I32
    qo_indptr: _I32 | None
    page_size: int
    kv_start: _I32 | None = None

    @property
    def num_seqs(self) -> int:
        """``S``: sequences in the batch."""
        return int(self.kv_last_page_len.shape[0])


@dataclass(frozen=True)
class FlashAttentionPageTable:
    """FlashAttention's paged-KV arguments of one step.

    ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., block_table=...)``
    for decode; ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, block_table=...)`` (``seqused_k=cache_seqlens`` where the
    version takes it) for a mixed batch. Token ``t < cache_seqlens[i]`` of sequence ``i``
    lives in block ``block_table[i, t // block_size]`` at offset ``t % block_size``;
    entries past a sequence's last block are padding the kernels never read. The cache
    must be viewed as ``[num_blocks, block_size, num_kv_heads, head_size]``
    (``key_cache.permute(0, 2, 1, 3)`` of a kvblocks cache).

    Attributes:
        block_table: int32 [S, max_blocks] (``[G, S, max_blocks]`` for stacked group
            tables). For a per-step table it is that table itself (no copy: do not write
            to it); for a persistent table with ``rows``, a gathered copy of the rows,
            cut to the columns the batch uses.
        cache_seqlens: int32 [S] context length of each sequence (``seq_lens``; the
            given array itself when it is already C-contiguous int32).
        cu_seqlens_q: int32 [S+1] query prefix sums (``query_start_loc``), ``None`` when
            none was given (decode: one query per sequence).
        max_seqlen_q: longest query (``1`` when ``cu_seqlens_q`` is ``None``; ``0`` for an
            empty batch).
        cu_seqlens_k: int32 [S+1] prefix sums of ``cache_seqlens``.
        max_seqlen_k: longest context (``0`` for an empty batch).
    """

    block_table: _I32
    cache_seqlens: _I32
    cu_seqlens_q: _I32 | None
    max_seqlen_q: int
    cu_seqlens_k: _I32
    max_seqlen_k: int

    @property
    def num_seqs(self) -> int:
        """``S``: sequences in the batch."""
        return int(self.cache_seqlens.shape[0])


@dataclass(frozen=True)
class _Checked:
    table: _I32
    seq_lens: _I32
    num_blocks: npt.NDArray[np.int64]  # pages each sequence uses
    rows: npt.NDArray[np.intp] | None
    query_start_loc: _I32 | None


def _int_vector(name: str, value: Any, length: int | None) -> npt.NDArray[Any]:
    if not isinstance(value, np.ndarray):
        raise InvalidArgumentError(f"{name} must be a NumPy integer array, got {type(value)}")
    if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
        raise InvalidArgumentError(
            f"{name} must be a 1-D integer array, got shape {value.shape} dtype {value.dtype}"
        )
    if length is not None and value.shape[0] != length:
        raise InvalidArgumentError(f"{name} has {value.shape[0]} entries, expected {length}")
    return value


def _as_int32(values: npt.NDArray[Any]) -> _I32:
    """``values`` itself when already C-contiguous int32 (zero copy), else a converted copy."""
    return np.ascontiguousarray(values, dtype=np.int32)


def _check(
    block_tables: Any,
    seq_lens: Any,
    block_size: Any,
    query_start_loc: Any,
    rows: Any,
) -> _Checked:
    block_size = check_int(block_size, "block_size", minimum=1, maximum=_INT32_MAX, numpy=True)
    if not isinstance(block_tables, np.ndarray):
        raise InvalidArgumentError(
            f"block_tables must be a NumPy int32 array, got {type(block_tables)}"
        )
    if block_tables.ndim not in (2, 3) or block_tables.dtype != np.int32:
        raise InvalidArgumentError(
            "block_tables must be a 2-D (or, one per KV cache group, 3-D) int32 array, got "
            f"shape {block_tables.shape} dtype {block_tables.dtype}"
        )
    if block_tables.ndim == 3 and block_tables.shape[0] == 0:
        raise InvalidArgumentError(
            "stacked block_tables must hold at least one KV cache group's table, got shape "
            f"{block_tables.shape}"
        )
    lens = _int_vector("seq_lens", seq_lens, None)
    num_seqs = lens.shape[0]
    table_rows, width = block_tables.shape[-2:]
    checked_rows: npt.NDArray[np.intp] | None = None
    if rows is None:
        if table_rows != num_seqs:
            raise InvalidArgumentError(
                f"block_tables has {table_rows} rows but seq_lens {num_seqs} entries; "
                "pass rows= to index a persistent table"
            )
    else:
        r = _int_vector("rows", rows, num_seqs)
        if num_seqs and (int(r.min()) < 0 or int(r.max()) >= table_rows):
            raise InvalidArgumentError(
                f"rows must be in [0, {table_rows}) (block_tables rows), got range "
                f"[{int(r.min())}, {int(r.max())}]"
            )
        checked_rows = r.astype(np.intp, copy=False)
    capacity = width * int(block_size)
    if num_seqs and (int(lens.min()) < 0 or int(lens.max()) > capacity):
        raise InvalidArgumentError(
            f"seq_lens must be in [0, {capacity}] (block table capacity: {width} blocks * "
            f"block_size {block_size}), got range [{int(lens.min())}, {int(lens.max())}]"
        )
    if num_seqs and int(lens.max()) > _INT32_MAX:
        raise InvalidArgumentError("seq_lens must fit in int32")
    qsl = None
    if query_start_loc is not None:
        q = _int_vector("query_start_loc", query_start_loc, num_seqs + 1)
        q_lens = np.diff(q.astype(np.int64, copy=False))
        if int(q[0]) != 0:
            raise InvalidArgumentError(f"query_start_loc[0] must be 0, got {int(q[0])}")
        if num_seqs and int(q_lens.min()) < 0:
            raise InvalidArgumentError("query_start_loc must be non-decreasing")
        if int(q[-1]) > _INT32_MAX:
            raise InvalidArgumentError("query_start_loc must fit in int32")
        over = np.flatnonzero(q_lens > lens)
        if over.size:
            s = int(over[0])
            raise InvalidArgumentError(
                f"sequence {s} has {int(q_lens[s])} query tokens but seq_lens "
                f"{int(lens[s])}; seq_lens must include the query tokens"
            )
        qsl = _as_int32(q)
    # int64 so that rounding up a length near 2**31 cannot wrap.
    blocks = (lens.astype(np.int64) + (int(block_size) - 1)) // int(block_size)
    return _Checked(block_tables, _as_int32(lens), blocks, checked_rows, qsl)


def flashinfer_page_table(
    block_tables: _I32,
    seq_lens: npt.NDArray[np.integer[Any]],
    block_size: int,
    query_start_loc: npt.NDArray[np.integer[Any]] | None = None,
    *,
    rows: npt.NDArray[np.integer[Any]] | None = None,
    skip_released: bool = False,
) -> FlashInferPageTable:
    """Build FlashInfer's CSR page table from 2-D block tables.

    Args:
        block_tables: int32 ``[S, B]`` per-step table, or ``[max_seqs, max_blocks]``
            persistent table with ``rows``; stacked ``[G, ...]`` for ``G`` KV cache
            groups (then ``kv_indices`` is ``[G, nnz]``). Entries past each sequence's
            ``ceil(seq_len / block_size)`` blocks are ignored; block ids are exported as
            given (not range-checked: the table comes from the manager).
        seq_lens: integer ``[S]`` context length of each sequence (including this step's
            query tokens), at most ``B * block_size``.
        block_size: tokens per block (FlashInfer's ``page_size``).
        query_start_loc: integer ``[S+1]`` query prefix sums, exported as ``qo_indptr``
            (each sequence's query length must not exceed its ``seq_len``).
        rows: integer ``[S]`` row of each sequence in a persistent ``block_tables``.
        skip_released: export each sequence's pages from its first non-null entry on and
            set ``kv_start`` (a window or chunked group's table: its leading null
            entries are blocks no query of the step sees). One group's 2-D table only:
            the groups' page counts differ.

    Raises:
        InvalidArgumentError: wrong type, dtype or shape, a length outside the table's
            capacity, a row outside the table, or a malformed ``query_start_loc``; with
            ``skip_released``, stacked tables or a sequence of positive length whose
            pages are all the null block.
    """
    if not isinstance(skip_released, bool):
        raise InvalidArgumentError(f"skip_released must be a bool, got {skip_released!r}")
    c = _check(block_tables, seq_lens, block_size, query_start_loc, rows)
    if skip_released:
        return _visible_pages(c, int(block_size))
    num_seqs = c.seq_lens.shape[0]
    nnz = int(c.num_blocks.sum())
    if nnz > _INT32_MAX:
        raise InvalidArgumentError(f"{nnz} pages do not fit FlashInfer's int32 indptr")
    kv_indptr = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(c.num_blocks, out=kv_indptr[1:], dtype=np.int32)
    # (len - 1) % size + 1 maps multiples of the page size to a full page, not 0.
    last = (c.seq_lens - 1) % np.int32(block_size) + 1
    last[c.seq_lens == 0] = 0
    used = int(c.num_blocks.max()) if num_seqs else 0
    grouped = c.table.ndim == 3
    if used == 0:
        # No pages: nothing to gather (and no table to copy, however wide).
        kv_indices = np.zeros((c.table.shape[0], 0) if grouped else 0, dtype=np.int32)
    elif c.rows is None and (num_seqs == 0 or int(c.num_blocks.min()) == used):
        # Every sequence uses the same columns: the rows cut to them are the CSR list
        # already (no copy when they are the whole of a C-contiguous per-step table).
        cut = np.ascontiguousarray(c.table[..., :used])
        kv_indices = cut.reshape(cut.shape[0], -1) if grouped else cut.reshape(-1)
    elif not grouped:
        # One memcpy per row prefix in Rust: NumPy has no ragged copy, and a boolean mask
        # moves one element at a time (slower than a Python loop over long rows).
        kv_indices = gather_row_prefixes(np.ascontiguousarray(c.table), c.num_blocks, c.rows)
    else:
        # Every group's rows in one gather over the stacked tables.
        groups, table_rows, width = c.table.shape
        rows = np.arange(num_seqs, dtype=np.intp) if c.rows is None else c.rows
        all_rows = (np.arange(groups, dtype=np.intp)[:, None] * table_rows + rows).reshape(-1)
        flat = np.ascontiguousarray(c.table).reshape(groups * table_rows, width)
        gathered = gather_row_prefixes(flat, np.tile(c.num_blocks, groups), all_rows)
        kv_indices = gathered.reshape(groups, nnz)
    return FlashInferPageTable(
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last.astype(np.int32, copy=False),
        qo_indptr=c.query_start_loc,
        page_size=int(block_size),
    )


def _visible_pages(c: _Checked, block_size: int) -> FlashInferPageTable:
    """FlashInfer's CSR form of one group's table without each row's leading nulls."""
    if c.table.ndim != 2:
        raise InvalidArgumentError(
            "skip_released takes one group's 2-D table (the groups' page counts differ): "
            f"got shape {c.table.shape}"
        )
    num_seqs = c.seq_lens.shape[0]
    used = int(c.num_blocks.max()) if num_seqs else 0
    rows = np.arange(num_seqs, dtype=np.intp) if c.rows is None else c.rows
    pages = c.table[rows, :used]  # [S, used], a gathered copy
    cols = np.arange(used, dtype=np.int64)[None, :]
    in_use = cols < c.num_blocks[:, None]
    held = (pages != 0) & in_use
    has_page = held.any(axis=1)
    empty = np.flatnonzero(~has_page & (c.num_blocks > 0))
    if empty.size:
        s = int(empty[0])
        raise InvalidArgumentError(
            f"sequence {s} has {int(c.seq_lens[s])} tokens but only null pages: not a "
            "KV table (a recurrent-state group's?)"
        )
    # argmax of a row with no column (every length 0) is an error: nothing to skip there.
    first_held = held.argmax(axis=1) if used else np.zeros(num_seqs, dtype=np.int64)
    first = np.where(has_page, first_held, c.num_blocks)
    if c.query_start_loc is not None:
        seen = c.seq_lens - first * block_size
        over = np.flatnonzero(np.diff(c.query_start_loc) > seen)
        if over.size:
            s = int(over[0])
            raise InvalidArgumentError(
                f"sequence {s}'s query tokens reach into its leading null pages: the table "
                "released blocks the step writes"
            )
    # Row-major boolean indexing keeps sequence order: the CSR list.
    kv_indices = np.ascontiguousarray(pages[in_use & (cols >= first[:, None])], dtype=np.int32)
    kv_indptr = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(c.num_blocks - first, out=kv_indptr[1:], dtype=np.int32)
    last = (c.seq_lens - 1) % np.int32(block_size) + 1
    last[c.seq_lens == 0] = 0
    return FlashInferPageTable(
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last.astype(np.int32, copy=False),
        qo_indptr=c.query_start_loc,
        page_size=block_size,
        kv_start=(first * block_size).astype(np.int32),
    )


def flash_attention_page_table(
    block_tables: _I32,
    seq_lens: npt.NDArray[np.integer[Any]],
    block_size: int,
    query_start_loc: npt.NDArray[np.integer[Any]] | None = None,
    *,
    rows: npt.NDArray[np.integer[Any]] | None = None,
) -> FlashAttentionPageTable:
    """Build FlashAttention's ``block_table`` / ``cache_seqlens`` arguments.

    Arguments and errors as :func:`flashinfer_page_table`; ``block_size`` is the cache's
    ``page_block_size`` (FlashAttention 2 requires a multiple of 256 there, FlashAttention
    3 takes any size).
    """
    c = _check(block_tables, seq_lens, block_size, query_start_loc, rows)
    num_seqs = c.seq_lens.shape[0]
    if c.rows is None:
        table = c.table if c.table.flags.c_contiguous else np.ascontiguousarray(c.table)
    else:
        # Keep at least one column: kernels index block_table[:, 0] for any batch shape.
        used = max(int(c.num_blocks.max()) if num_seqs else 0, min(1, c.table.shape[-1]))
        table = np.ascontiguousarray(c.table[..., c.rows, :used])
    total_k = int(c.seq_lens.sum(dtype=np.int64))
    if total_k > _INT32_MAX:
        raise InvalidArgumentError(f"{total_k} context tokens do not fit int32 cu_seqlens_k")
    cu_seqlens_k = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(c.seq_lens, out=cu_seqlens_k[1:], dtype=np.int32)
    if c.query_start_loc is None:
        max_seqlen_q = 1 if num_seqs else 0
    else:
        max_seqlen_q = int(np.diff(c.query_start_loc).max()) if num_seqs else 0
    return FlashAttentionPageTable(
        block_table=table,
        cache_seqlens=c.seq_lens,
        cu_seqlens_q=c.query_start_loc,
        max_seqlen_q=max_seqlen_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=int(c.seq_lens.max()) if num_seqs else 0,
    )
