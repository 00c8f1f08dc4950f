"""Page-table exports for FlashInfer / FlashAttention: kvblocks' builders vs a per-sequence loop.

Run with ``pytest benches/page_tables --benchmark-only``. Each group times
:mod:`kvblocks.page_tables` against a straightforward per-sequence Python loop building
the same arrays (asserted equal), in the same run. Batches of 1,024 sequences, block size 16:

* ``uniform-32k``: every sequence at 32,768 tokens (2,048 blocks), the per-step table exactly
  that wide: the CSR page list is the table itself (no copy).
* ``varied-16k-32k``: lengths uniform in [16k, 32k]: the page list is a ragged gather
  (``kvblocks._core.gather_row_prefixes``, one copy per row prefix).
* ``persistent-rows``: the varied batch in a persistent [1,280, 2,048] table, rows shuffled.
* ``short-128``: 128-token sequences (8 blocks): per-sequence overhead dominates.

With long ragged rows a NumPy boolean mask moved one element at a time and lost to the loop
(1.4-2.1x slower); the Rust gather copies each row prefix at once. The figures are in the
README's page-table section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvblocks.page_tables import flash_attention_page_table, flashinfer_page_table

SEQS, BLOCK_SIZE = 1024, 16
Arrays = tuple[np.ndarray[Any, Any], ...]


def _case(
    name: str,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    rng = np.random.default_rng(0)
    if name == "uniform-32k":
        lens = np.full(SEQS, 32768, dtype=np.int32)
    elif name == "short-128":
        lens = np.full(SEQS, 128, dtype=np.int32)
    else:
        lens = rng.integers(16384, 32769, SEQS).astype(np.int32)
    width = int(-(-int(lens.max()) // BLOCK_SIZE))
    if name == "persistent-rows":
        table = rng.integers(1, 1 << 20, (SEQS + 256, 2048)).astype(np.int32)
        return table, lens, rng.permutation(SEQS + 256)[:SEQS].astype(np.int32)
    return rng.integers(1, 1 << 20, (SEQS, width)).astype(np.int32), lens, None


def _flashinfer_loop(table: Any, lens: Any, rows: Any) -> Arrays:
    """The baseline: one slice per sequence, then one concatenation."""
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    last = np.zeros(len(lens), dtype=np.int32)
    chunks = []
    total = 0
    row_ids = range(len(lens)) if rows is None else rows.tolist()
    for i, (row, length) in enumerate(zip(row_ids, lens.tolist(), strict=True)):
        pages = -(-length // BLOCK_SIZE)
        chunks.append(table[row, :pages])
        total += pages
        indptr[i + 1] = total
        last[i] = length - (pages - 1) * BLOCK_SIZE if pages else 0
    return indptr, np.concatenate(chunks), last


def _flashinfer_kvblocks(table: Any, lens: Any, rows: Any) -> Arrays:
    pt = flashinfer_page_table(table, lens, BLOCK_SIZE, rows=rows)
    return pt.kv_indptr, pt.kv_indices, pt.kv_last_page_len


def _flash_attention_loop(table: Any, lens: Any, rows: Any) -> Arrays:
    """The baseline: one row copy and one running sum per sequence."""
    width = -(-int(lens.max()) // BLOCK_SIZE)
    block_table = table if rows is None else np.empty((len(lens), width), dtype=np.int32)
    cu_k = np.zeros(len(lens) + 1, dtype=np.int32)
    total = 0
    row_ids = range(len(lens)) if rows is None else rows.tolist()
    for i, (row, length) in enumerate(zip(row_ids, lens.tolist(), strict=True)):
        if rows is not None:
            block_table[i] = table[row, :width]
        total += length
        cu_k[i + 1] = total
    return block_table, lens, cu_k


def _flash_attention_kvblocks(table: Any, lens: Any, rows: Any) -> Arrays:
    pt = flash_attention_page_table(table, lens, BLOCK_SIZE, rows=rows)
    return pt.block_table, pt.cache_seqlens, pt.cu_seqlens_k


BUILDERS: dict[str, dict[str, Callable[[Any, Any, Any], Arrays]]] = {
    "flashinfer": {"kvblocks": _flashinfer_kvblocks, "loop": _flashinfer_loop},
    "flash_attention": {"kvblocks": _flash_attention_kvblocks, "loop": _flash_attention_loop},
}


@pytest.mark.parametrize("impl", ["kvblocks", "loop"])
@pytest.mark.parametrize("case", ["uniform-32k", "varied-16k-32k", "persistent-rows", "short-128"])
@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_export(benchmark: Any, fmt: str, case: str, impl: str) -> None:
    table, lens, rows = _case(case)
    build = BUILDERS[fmt][impl]
    expected = BUILDERS[fmt]["loop"](table, lens, rows)
    for got, want in zip(build(table, lens, rows), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    benchmark.group = f"{fmt} {case}"
    benchmark.pedantic(build, args=(table, lens, rows), rounds=60, warmup_rounds=3, iterations=1)
