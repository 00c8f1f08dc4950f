"""Torch reference implementations of the kvblocks ops (any device, fp32 accumulation).

These are the semantics the CUDA kernels are tested against: written for clarity, with
whole-tensor operations per sequence and no per-token Python loops. The front-ends in
:mod:`kvblocks.ops` validate shapes and dtypes before calling in; the functions here
additionally reject block ids and slots outside the cache, which the kernels can only
clamp (see ``cuda/README.md``).
"""

from __future__ import annotations

import math

import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.block_runs import merge_block_runs

__all__ = [
    "copy_blocks",
    "paged_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "swap_blocks",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots (slot -1 = skip), in place."""
    num_blocks, _, block_size, _ = key_cache.shape
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_blocks * block_size):
        raise InvalidArgumentError(
            f"slot_mapping entries must be -1 (skip) or in [0, {num_blocks * block_size}) "
            f"(num_blocks * block_size), got range [{int(slots.min())}, {int(slots.max())}]"
        )
    valid = slots >= 0
    chosen = slots[valid]
    blocks = torch.div(chosen, block_size, rounding_mode="floor")
    offsets = chosen % block_size
    # The permuted view is [block, offset, head, dim]: one (block, offset) pair per token.
    key_cache.permute(0, 2, 1, 3)[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache.permute(0, 2, 1, 3)[blocks, offsets] = value[valid].to(value_cache.dtype)


def _check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    if block_tables.numel() and (
        int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks
    ):
        raise InvalidArgumentError(
            f"block_tables entries must be block ids in [0, {num_blocks}), got range "
            f"[{int(block_tables.min())}, {int(block_tables.max())}]"
        )
    capacity = block_tables.shape[1] * block_size
    if seq_lens.numel() and int(seq_lens.max()) > capacity:
        raise InvalidArgumentError(
            f"seq_lens up to {int(seq_lens.max())} exceed the block table capacity "
            f"{capacity} (max_blocks {block_tables.shape[1]} * block_size {block_size})"
        )


def _gather(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Return the first ``seq_len`` tokens of one sequence as fp32 ``[num_kv_heads, L, D]``."""
    _, num_kv_heads, block_size, head_size = cache.shape
    used = -(-seq_len // block_size)
    tiles = cache[table_row[:used].to(torch.int64)]  # [used, H, bs, D]
    flat = tiles.permute(1, 0, 2, 3).reshape(num_kv_heads, used * block_size, head_size)
    return flat[:, :seq_len].float()


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_pos: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Causal attention of ``query [q, H, D]`` at positions ``first_pos..`` over ``[Hkv, L, D]``."""
    q_len, num_heads, head_size = query.shape
    num_kv_heads, ctx, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().reshape(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    scores = torch.einsum("kgqd,kld->kgql", q, keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = first_pos + torch.arange(q_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(ctx, device=query.device).unsqueeze(0)
    visible = key_pos <= pos
    if sliding_window is not None:
        visible &= key_pos > pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    # A query with no visible key (only possible with seq_len 0) yields zeros, not NaN.
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("kgql,kld->kgqd", weights, values) / denom.clamp_min(1e-30)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Varlen causal attention of concatenated query chunks over the paged cache."""
    num_blocks, _, block_size, head_size = key_cache.shape
    _check_tables(block_tables, seq_lens, num_blocks, block_size)
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        if starts[s + 1] - starts[s] > seq_len:
            raise InvalidArgumentError(
                f"sequence {s} has {starts[s + 1] - starts[s]} query tokens but seq_lens "
                f"{seq_len}; seq_lens must include the chunk (>= query length)"
            )
    out = torch.zeros_like(query)
    tables = block_tables.to(key_cache.device)
    for s, seq_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        keys = _gather(key_cache, tables[s], seq_len)
        values = _gather(value_cache, tables[s], seq_len)
        out[lo:hi] = _attend(
            query[lo:hi], keys, values, seq_len - (hi - lo), scale, sliding_window, soft_cap
        ).to(query.dtype)
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence at position ``seq_len - 1``.

    A sequence with ``seq_len == 0`` (batch padding) gets a zero output row.
    """
    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    # A padded decode row (seq_len 0) has no query token to place: give it q_len 0.
    query_start_loc[1:] = torch.cumsum((seq_lens.cpu() > 0).to(torch.int32), 0)
    has_query = seq_lens.cpu() > 0
    out = torch.zeros_like(query)
    if bool(has_query.any()):
        rows = has_query.nonzero().squeeze(1).to(query.device)
        out[rows] = paged_prefill_attention(
            query[rows],
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    return out


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: torch.Tensor
) -> None:
    """Copy block ``src`` to ``dst`` in every layer's K and V cache (``[n, 2]`` int64)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0]
    dst = block_mapping[:, 1]
    for key_cache, value_cache in kv_caches:
        for cache in (key_cache, value_cache):
            cache[dst.to(cache.device)] = cache[src.to(cache.device)]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks of ``src`` into ``dst`` (any devices), one copy per contiguous run."""
    non_blocking = src.device != dst.device and (src.is_pinned() or dst.is_pinned())
    for src_start, dst_start, length in merge_block_runs(block_mapping.numpy()):
        dst[dst_start : dst_start + length].copy_(
            src[src_start : src_start + length], non_blocking=non_blocking
        )
