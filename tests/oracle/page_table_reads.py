"""The content oracle read through the attention libraries' page tables.

An engine hands FlashInfer or FlashAttention the step's page tables, one per KV cache
group (``SchedulerOutput.flashinfer_page_table(block_size, group)`` and
``flash_attention_page_table``, or every group's at once from one gather); the kernel
reads a sequence's position ``p`` from the page that export names.
:func:`check_step_exports` reads, through every export of every group (the per-group
calls and the stacked ones take different paths: a persistent table's rows against the
stacked tables), the positions the step's queries of that group may attend to (the oracle's
:class:`~oracle.kv_memory.Attention` rule: from ``first_visible`` of the step's first
query to the last query) and compares them with the KV ids the sequence wrote, as the
kernel would read them. A FlashInfer table built with ``skip_released`` must also start
exactly at the first block those queries see (it exports no page nobody reads).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from oracle.kv_memory import Attention, ContentError, KVMemory


def check_pages(
    mem: KVMemory,
    name: object,
    pages: np.ndarray,
    start: int,
    expected: Sequence[int],
    seq_len: int,
    first_needed: int,
) -> None:
    """Reading through ``pages`` (the first holding position ``start``), positions
    ``[first_needed, seq_len)`` must hold ``expected``."""
    bs = mem.block_size
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    if start % bs or start > first_needed:
        raise ContentError(f"{name}: pages start at position {start}, a query sees {first_needed}")
    if start + pages.size * bs < seq_len:
        raise ContentError(f"{name}: {pages.size} pages from {start} miss position {seq_len - 1}")
    pos = np.arange(first_needed, seq_len)
    got = mem.gpu[pages[(pos - start) // bs], pos % bs]
    want = np.asarray(expected[first_needed:seq_len], dtype=np.int64)
    bad = np.flatnonzero(got != want)
    if bad.size:
        p = int(pos[bad[0]])
        raise ContentError(
            f"{name}: position {p} reads {int(got[bad[0]])} through the export, expected "
            f"{int(want[bad[0]])}"
        )


def check_step_exports(
    mem: KVMemory,
    out: Any,
    contexts: Sequence[tuple[object, int, int, Sequence[int], Attention]],
    seen: Counter[str],
) -> None:
    """Every group's FlashInfer (pages in place and with ``skip_released``) and
    FlashAttention exports of ``out``, from the stacked calls and (with several groups)
    the per-group ones, read what its queries may attend to.

    ``contexts``: ``(name, group, batch index, KV ids, rule)`` of every scheduled
    sequence and group. ``seen`` counts the exports that skipped released pages.
    """
    bs = mem.block_size
    groups = out.num_groups
    in_place = out.group_flashinfer_page_tables(bs)
    fa = out.group_flash_attention_page_tables(bs)
    assert len(in_place) == len(fa) == groups
    # Attention groups only (a recurrent-state group's table holds states, not KV).
    attention = {c[1] for c in contexts}
    skipped = {g: out.flashinfer_page_table(bs, g, skip_released=True) for g in attention}
    # One group's own calls: its persistent table's rows, not the stacked gather (with a
    # single group the stacked calls are these).
    single_fi = {g: out.flashinfer_page_table(bs, g) for g in attention if groups > 1}
    single_fa = {g: out.flash_attention_page_table(bs, g) for g in attention if groups > 1}
    seq_lens = out.seq_lens
    num_new = out.num_scheduled_tokens
    for name, g, i, ids, rule in contexts:
        seq_len, n = int(seq_lens[i]), int(num_new[i])
        first = rule.first_visible(seq_len - n)
        fi = [("flashinfer", in_place[g]), ("flashinfer skip", skipped[g])]
        if g in single_fi:
            fi.append(("flashinfer of the group", single_fi[g]))
        for kind, pt in fi:
            lo, hi = int(pt.kv_indptr[i]), int(pt.kv_indptr[i + 1])
            start = 0 if pt.kv_start is None else int(pt.kv_start[i])
            kv_len = 0 if hi == lo else (hi - lo - 1) * bs + int(pt.kv_last_page_len[i])
            if start + kv_len != seq_len:
                raise ContentError(f"{name} ({kind}): {kv_len} tokens from {start}, not {seq_len}")
            check_pages(mem, (name, kind), pt.kv_indices[lo:hi], start, ids, seq_len, first)
        start = int(skipped[g].kv_start[i])
        if start != first // bs * bs:
            raise ContentError(
                f"{name}: FlashInfer's pages without released ones start at {start}, the "
                f"first block the step's queries see starts at {first // bs * bs}"
            )
        if start > 0:
            seen["skipped"] += 1
        fas = [("flash_attention", fa[g])]
        if g in single_fa:
            fas.append(("flash_attention of the group", single_fa[g]))
        for kind, table in fas:
            if int(table.cache_seqlens[i]) != seq_len:
                raise ContentError(f"{name} ({kind}): cache_seqlens is not {seq_len}")
            check_pages(mem, (name, kind), table.block_table[i], 0, ids, seq_len, first)
