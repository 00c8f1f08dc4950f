"""Torch reference implementations of the kvblocks ops (any device, fp32 accumulation).

These are the semantics the CUDA kernels are tested against: written for clarity, with
whole-tensor operations over the batch (no per-sequence or per-token Python loops;
attention pads each group of similar chunks to one length and masks). The front-ends in
:mod:`kvblocks.ops` validate shapes and dtypes before calling in; the functions here
additionally reject block ids and slots outside the cache, which the kernels can only
clamp (see ``cuda/README.md``).

Attention semantics (decode and prefill alike). For query ``i`` of head ``h`` at position
``p`` and the keys ``j`` it may see (``j <= p``, and ``j > p - sliding_window`` when a window
is given)::

    s_j   = scale * <q, k_j>                        # fp32
    s_j   = soft_cap * tanh(s_j / soft_cap)         # only when soft_cap is given
    m     = max(max_j s_j, sinks[h])                # sinks[h] only when sinks are given
    out   = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m))

``sinks`` (gpt-oss's attention sinks) is a learned fp32 logit per *query* head
(``[num_heads]``, not per KV head) that joins the softmax denominator only: it has no
value vector, so it takes probability mass away from the keys without adding anything
to the output (a head may thus attend to "nothing"). The sink logit is used as stored:
it is not multiplied by ``scale``, not soft-capped and not masked by the window (it is
present at every position, including a sequence's first token). Without ``sinks`` the
``exp(sinks[h] - m)`` term is absent and this is the ordinary softmax. This matches
transformers' ``gpt_oss`` eager attention (``softmax(cat([scores, sink]))`` with the sink
column dropped). A query that sees no key at all (only batch padding) yields zeros.
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


def _query_length_groups(q_lens: torch.Tensor) -> list[torch.Tensor]:
    """Indices of the sequences with a query, grouped by ``ceil(log2(q_len))``.

    Each group is attended as one padded batch; within a group the longest chunk is
    less than twice the shortest, so padding less than doubles the query rows (contexts
    are padded to the group's longest), and a batch of decodes is a single group.
    """
    has_query = q_lens > 0
    # frexp's exponent of q_len - 1 is its bit length: 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3.
    group_of = torch.frexp((q_lens - 1).clamp_min(0).double()).exponent
    return [
        (has_query & (group_of == g)).nonzero().squeeze(1)
        for g in torch.unique(group_of[has_query]).tolist()
    ]


def _gather_context(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ``ctx`` cached tokens of each table row as fp32 ``[n, Hkv, ctx, D]``.

    Slots past a sequence's own length hold whatever their block last held, possibly
    non-finite: callers mask their scores and zero such values (see
    :func:`_zero_past_length`). The result is a fresh tensor, never a view of the cache.
    """
    n = tables.shape[0]
    _, num_kv_heads, block_size, head_size = cache.shape
    used = -(-ctx // block_size)
    tiles = cache[tables[:, :used].to(torch.int64)]  # [n, used, Hkv, bs, D], a copy
    flat = tiles.permute(0, 2, 1, 3, 4).reshape(n, num_kv_heads, used * block_size, head_size)
    return flat[:, :, :ctx].float()


def _zero_past_length(values: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Zero (in place) the gathered tokens at or past each sequence's length.

    Their attention weights are exactly 0, but ``0 * inf`` or ``0 * nan`` in the weighted
    sum would still poison the row; keys need no such care since masking replaces their
    scores outright.
    """
    beyond = torch.arange(values.shape[2], device=values.device) >= seq_lens.unsqueeze(1)
    return values.masked_fill_(beyond[:, None, :, None], 0.0)


def _attend_group(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention of padded queries ``[n, q, H, D]`` over ``[n, Hkv, L, D]``.

    Query ``i`` of sequence ``s`` sits at position ``first_pos[s] + i``; returns fp32
    ``[n, q, H, D]`` (rows past a sequence's chunk are garbage for the caller to drop).
    ``sinks`` (fp32 ``[H]``) joins each head's softmax denominator (see the module doc).
    """
    n, q_len, num_heads, head_size = query.shape
    num_kv_heads, ctx = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().reshape(n, q_len, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    scores = torch.einsum("nkgqd,nkld->nkgql", q, keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = first_pos.unsqueeze(1) + torch.arange(q_len, device=query.device)  # [n, q]
    key_pos = torch.arange(ctx, device=query.device)
    visible = key_pos <= pos.unsqueeze(2)  # [n, q, L]
    if sliding_window is not None:
        visible &= key_pos > pos.unsqueeze(2) - sliding_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    # A row with no visible key yields zeros, not NaN (a real query always sees itself).
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    if sinks is not None:
        # Query head h = kv_head * group + g, so the [H] sinks reshape to [Hkv, group].
        sink = sinks.reshape(1, num_kv_heads, group, 1, 1)
        row_max = torch.maximum(row_max, sink)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.einsum("nkgql,nkld->nkgqd", weights, values) / denom.clamp_min(1e-30)
    return out.permute(0, 3, 1, 2, 4).reshape(n, q_len, num_heads, head_size)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of concatenated query chunks over the paged cache.

    Sequences are batched, not looped over: their K/V are gathered through the block
    tables into one zero-padded tensor per group of similar chunk lengths (see
    :func:`_query_length_groups`), and masks drop the padding. ``sinks`` is a per-head
    logit in the softmax denominator (see the module docstring for the exact formula).
    """
    num_blocks, _, block_size, head_size = key_cache.shape
    _check_tables(block_tables, seq_lens, num_blocks, block_size)
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    device = key_cache.device
    starts = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    q_lens = starts[1:] - starts[:-1]
    too_long = (q_lens > lens).nonzero()
    if too_long.numel():
        s = int(too_long[0, 0])
        raise InvalidArgumentError(
            f"sequence {s} has {int(q_lens[s])} query tokens but seq_lens "
            f"{int(lens[s])}; seq_lens must include the chunk (>= query length)"
        )
    out = torch.zeros_like(query)
    tables = block_tables.to(device)
    sinks_f32 = None if sinks is None else sinks.to(device=device, dtype=torch.float32)
    for seqs in _query_length_groups(q_lens):
        g_lens, g_q = lens[seqs], q_lens[seqs]
        q_max, ctx = int(g_q.max()), int(g_lens.max())
        # Token index of each padded query slot; slots past a chunk repeat its first token.
        offsets = torch.arange(q_max)
        in_chunk = offsets < g_q.unsqueeze(1)  # [n, q_max]
        tokens = starts[seqs].unsqueeze(1) + offsets * in_chunk
        g_tables = tables[seqs.to(device)]
        values = _gather_context(value_cache, g_tables, ctx)
        attended = _attend_group(
            query[tokens.to(query.device)],
            _gather_context(key_cache, g_tables, ctx),
            _zero_past_length(values, g_lens.to(device)),
            (g_lens - g_q).to(device),
            scale,
            sliding_window,
            soft_cap,
            sinks_f32,
        )
        out[tokens[in_chunk].to(query.device)] = attended[in_chunk.to(device)].to(query.dtype)
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence at position ``seq_len - 1``.

    A sequence with ``seq_len == 0`` (batch padding) gets a zero output row.
    """
    # A padded decode row (seq_len 0) has no query token to place: give it q_len 0.
    has_query = seq_lens.cpu() > 0
    query_start_loc = torch.zeros(query.shape[0] + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(has_query.to(torch.int32), 0)
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
            sinks=sinks,
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
