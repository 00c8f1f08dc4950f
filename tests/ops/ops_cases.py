"""Random paged-attention problems shared by the ops tests (reference, emulation, GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kvblocks.ops as ops
from kvblocks.ops import reference


@dataclass
class PagedCase:
    """One batch: queries, a filled paged cache and the dense K/V it encodes."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    dense_keys: list[torch.Tensor]
    dense_values: list[torch.Tensor]


def make_case(
    seed: int,
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    dense: bool = True,
) -> PagedCase:
    """Build a batch whose sequences own random, distinct, shuffled blocks.

    Block 0 is the null block; padding entries of the tables point to it, and it is
    filled with large values so that reading it by mistake shows in the output.
    ``dense=False`` leaves ``dense_keys``/``dense_values`` empty (same cache, tables and
    queries): for the cases that check against the reference ops only, where the fp32
    copies were most of the set-up (12 of 14 CPU-s for 256 sequences of up to 4k keys).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max([*blocks_per_seq, 1]) + 1
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    ((key_cache, value_cache),) = ops.allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu"
    )
    key_cache.normal_(generator=gen)
    value_cache.normal_(generator=gen)
    key_cache[0] = 50.0
    value_cache[0] = 1e3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[s])]
        tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if not dense:
            continue
        idx = torch.tensor(ids, dtype=torch.int64)
        k = key_cache[idx].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_size)[:, :n]
        v = value_cache[idx].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_size)[:, :n]
        dense_k.append(k.float())
        dense_v.append(v.float())
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    query = torch.randn((int(qsl[-1]), num_kv_heads * group, head_size), generator=gen).to(dtype)
    return PagedCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        dense_keys=dense_k,
        dense_values=dense_v,
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances: 1e-5 relative for fp32, 2e-2 for fp16/bf16."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 2e-2, "atol": 2e-2}


def ref_decode(case: PagedCase, **kw) -> torch.Tensor:
    """The reference decode attention of ``case`` (``kw``: scale, window, soft cap)."""
    return reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, **kw
    )


def ref_prefill(case: PagedCase, **kw) -> torch.Tensor:
    """The reference prefill/extend attention of ``case`` (``kw`` as :func:`ref_decode`)."""
    return reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, **kw,
    )  # fmt: skip
