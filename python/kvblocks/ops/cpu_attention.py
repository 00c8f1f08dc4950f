"""The fast CPU attention path: a per-step plan of gathers, then fused torch ops per layer.

The torch reference (:mod:`kvblocks.ops.reference`) states the semantics plainly and is
what every kernel test compares against; this module computes the same thing, faster,
and is what :func:`kvblocks.ops.paged_attention` and
:func:`kvblocks.ops.paged_prefill_attention` run for CPU tensors. An engine builds one
:class:`CpuAttentionPlan` per step and runs it for every layer, since all layers share
the step's block tables and lengths:

* **Gathers by tile.** With the cache viewed as ``[num_blocks * num_kv_heads,
  block_size * head_size]`` every (block, head) tile is one row, so one ``index_select``
  with row ids computed once per step copies a sequence's context into ``[n, Hkv, L, D]``
  (the reference gathers whole blocks and then permutes: a second copy).
* **Decodes batched by length.** Sequences with one query token are grouped into
  buckets of similar context length (:func:`length_buckets` weighs the padding a bucket
  adds against the fixed cost of one more bucket) and attended with two batched matrix
  products per bucket, every query head of a KV head as one row of the product (no K/V
  expansion for GQA). Slots past a sequence's length are masked in the scores and zeroed
  in the value copy (they may hold anything, even NaN: see the reference).
* **Decodes natively when the cache is fp32.** With fp32 caches (the CPU engine's
  default) the decodes skip the gathers: :func:`kvblocks._core.paged_decode_attention`
  (the Rust core's kernel, GIL released, up to ``torch.get_num_threads()`` threads as
  the work warrants: :data:`NATIVE_WORK_PER_THREAD`) reads each key and value row in
  place through the block table, with no padding between lengths. Plans built with
  ``native_decode=False``, and fp16/bf16 caches, take the buckets.
* **Prefill chunks by fused SDPA.** Chunks of two or more tokens are grouped by exact
  ``(chunk length, context length)``, so nothing is padded, and run through
  :func:`torch.nn.functional.scaled_dot_product_attention` (causal, or with the
  bottom-right causal / sliding-window mask, GQA without expanding K/V). Soft-capping
  and attention sinks are outside what SDPA computes: those layers take the same
  matrix-product path as decodes, with the chunk's causal mask.

Results agree with the reference to fp32 rounding (the tests hold them to 1e-5).
One documented difference: a key that is *inside* a sequence's length but outside its
window and holds a non-finite value (only a model that produced NaN writes one) reaches
SDPA's additive mask as ``NaN + -inf``; both paths then return NaN for that row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvblocks._core import paged_decode_attention
from kvblocks.errors import InvalidArgumentError

__all__ = ["BUCKET_COST_SLOTS", "NATIVE_WORK_PER_THREAD", "CpuAttentionPlan", "length_buckets"]

BUCKET_COST_SLOTS = 256
"""What one more decode bucket costs, in padded key slots.

A bucket is about ten torch calls per layer (~60-80 us on the development machine); one
padded key slot costs a gathered K and V row and its share of two matrix products
(~0.25-0.3 us at head 64, GQA 4). :func:`length_buckets` splits a batch where the padding
saved exceeds this.
"""


NATIVE_WORK_PER_THREAD = 1 << 21
"""Multiply-adds (keys x query heads x head size, scores and values) per native thread.

The kernel starts its threads per call (per layer), which costs tens of microseconds
and more on a busy machine; ~2M multiply-adds is ~0.5 ms of one core's work, so a small
decode batch (16 sequences of 128 tokens at 8 heads of 64) runs on the calling thread
and a large one on up to ``torch.get_num_threads()``.
"""


def length_buckets(lengths: np.ndarray, cost_slots: int = BUCKET_COST_SLOTS) -> list[np.ndarray]:
    """Partition sequences into buckets padded to their longest member, at least total cost.

    ``lengths`` are padded key slots per sequence (multiples of the block size). A
    bucket costs ``cost_slots`` plus its size times its longest length; the optimum over
    contiguous runs of the sorted lengths is found by dynamic programming over the
    distinct lengths (a step's batch has few). Returns index arrays into ``lengths``,
    longest bucket first.
    """
    if lengths.size == 0:
        return []
    order = np.argsort(lengths, kind="stable")
    values, first = np.unique(lengths[order], return_index=True)
    # below[i]: sequences shorter than values[i]; a bucket of distinct values i..j holds
    # sequences below[i]..below[j+1] - 1 of `order`, padded to values[j].
    below = np.append(first, lengths.size).astype(np.float64)
    best = np.zeros(values.size + 1)
    start = np.zeros(values.size, dtype=np.int64)
    for j in range(values.size):
        costs = best[: j + 1] + cost_slots + (below[j + 1] - below[: j + 1]) * values[j]
        start[j] = int(np.argmin(costs))
        best[j + 1] = costs[start[j]]
    buckets = []
    j = values.size
    while j > 0:
        i = int(start[j - 1])
        buckets.append(order[int(below[i]) : int(below[j])])
        j = i
    return buckets


def _tile_rows(tables: np.ndarray, num_kv_heads: int) -> Tensor:
    """Rows of the ``[num_blocks * Hkv, block_size * D]`` cache view, ``[n * Hkv * T]``.

    Ordered (sequence, head, tile), so the gathered rows view as ``[n, Hkv, T * bs, D]``.
    """
    heads = np.arange(num_kv_heads, dtype=np.int64)
    rows = tables.astype(np.int64)[:, None, :] * num_kv_heads + heads[None, :, None]
    return torch.from_numpy(rows.reshape(-1))


def _gather(cache: Tensor, rows: Tensor, n: int, slots: int) -> Tensor:
    """The tiles ``rows`` of ``cache`` as fp32 ``[n, Hkv, slots, D]`` (a fresh copy)."""
    _, num_kv_heads, block_size, head_size = cache.shape
    tiles = cache.view(-1, block_size * head_size).index_select(0, rows)
    return tiles.view(n, num_kv_heads, slots, head_size).float()


@dataclass(frozen=True)
class _DecodeBucket:
    """Sequences with one query token, padded to ``slots`` key slots."""

    rows: Tensor | None  # int64 [n]: their query rows; None: every row, in order
    tiles: Tensor  # int64 [n * Hkv * T]: cache rows to gather (see _tile_rows)
    slots: int  # T * block_size
    beyond: Tensor | None  # bool [n, 1, 1, slots]: slots at or past each length
    pad_rows: Tensor | None  # int64: rows of the [n * Hkv * slots, D] value copy to zero
    last: Tensor  # int64 [n, 1, 1, 1]: the query position (length - 1)


@dataclass(frozen=True)
class _NativeDecode:
    """Every decode of the step, for the native kernel (fp32 caches)."""

    rows: Tensor | None  # int64 [n]: their query rows; None: every row, in order
    first_row: np.ndarray  # int64 [n]: the same rows, for the bucket fallback
    tables: np.ndarray  # int32 [n, T], C-contiguous
    lens: np.ndarray  # int32 [n]
    keys: int  # the keys all of them read (a window may read fewer)


@dataclass(frozen=True)
class _PrefillGroup:
    """Sequences whose chunks have the same length and the same context length."""

    tokens: Tensor | None  # int64 [n * q_len]: their query rows, sequence-major; None: all
    tiles: Tensor  # int64 [n * Hkv * T]
    num_seqs: int
    q_len: int
    ctx: int


@dataclass(frozen=True)
class CpuAttentionPlan:
    """What one step's attention reads, computed once and run for every layer.

    Build it with :meth:`for_prefill` (varlen chunks, decodes included) or
    :meth:`for_decode` (one query per sequence); both validate the tables against the
    cache shape and raise :class:`~kvblocks.errors.InvalidArgumentError` as the
    reference does. ``native_decode`` (default) plans the decodes for the native kernel
    (fp32 caches; other dtypes fall back to buckets built at run time): pass ``False``
    when the caches are fp16/bf16. :meth:`run` attends one layer.
    """

    num_tokens: int  # query rows
    num_kv_heads: int
    block_size: int
    decode: tuple[_DecodeBucket, ...]
    native: _NativeDecode | None  # the decodes, when planned for the native kernel
    prefill: tuple[_PrefillGroup, ...]
    covers_all: bool  # every query row belongs to a bucket or group

    @classmethod
    def for_prefill(
        cls,
        block_tables: Tensor,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        *,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        native_decode: bool = True,
    ) -> CpuAttentionPlan:
        """The plan of a varlen batch (``query_start_loc`` int32 ``[S + 1]``)."""
        starts = query_start_loc.to("cpu", torch.int64).numpy()
        lens = seq_lens.to("cpu", torch.int64).numpy()
        q_lens = starts[1:] - starts[:-1]
        tables = block_tables.to("cpu").numpy()
        _check(tables, lens, q_lens, num_blocks, block_size)
        return cls._build(
            tables,
            starts[:-1],
            q_lens,
            lens,
            int(q_lens.sum()),
            num_kv_heads,
            block_size,
            native_decode,
        )

    @classmethod
    def for_decode(
        cls,
        block_tables: Tensor,
        seq_lens: Tensor,
        *,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        native_decode: bool = True,
    ) -> CpuAttentionPlan:
        """The plan of a decode batch: query row ``s`` at position ``seq_lens[s] - 1``.

        A sequence with ``seq_len == 0`` (batch padding) has no query; its row is zero.
        """
        lens = seq_lens.to("cpu", torch.int64).numpy()
        q_lens = (lens > 0).astype(np.int64)
        tables = block_tables.to("cpu").numpy()
        _check(tables, lens, q_lens, num_blocks, block_size)
        rows = np.arange(lens.size, dtype=np.int64)
        return cls._build(
            tables, rows, q_lens, lens, lens.size, num_kv_heads, block_size, native_decode
        )

    @classmethod
    def _build(
        cls,
        tables: np.ndarray,
        first_row: np.ndarray,
        q_lens: np.ndarray,
        lens: np.ndarray,
        num_rows: int,
        num_kv_heads: int,
        block_size: int,
        native_decode: bool,
    ) -> CpuAttentionPlan:
        decodes = np.flatnonzero(q_lens == 1)
        native = None
        buckets: tuple[_DecodeBucket, ...] = ()
        if native_decode and decodes.size:
            used = int(-(-int(lens[decodes].max()) // block_size))
            whole = decodes.size == num_rows and bool(
                (first_row[decodes] == np.arange(num_rows)).all()
            )
            native = _NativeDecode(
                rows=None if whole else torch.from_numpy(first_row[decodes]),
                first_row=first_row[decodes],
                tables=np.ascontiguousarray(tables[decodes, :used], dtype=np.int32),
                lens=lens[decodes].astype(np.int32),
                keys=int(lens[decodes].sum()),
            )
        elif decodes.size:
            buckets = _decode_buckets(
                tables, decodes, first_row, lens, num_rows, num_kv_heads, block_size
            )
        groups = []
        chunked = np.flatnonzero(q_lens > 1)
        if chunked.size:
            keys = np.stack([q_lens[chunked], lens[chunked]], axis=1)
            shapes, which = np.unique(keys, axis=0, return_inverse=True)
            for g, (q_len, ctx) in enumerate(shapes.tolist()):
                seqs = chunked[which.reshape(-1) == g]
                tokens = (first_row[seqs][:, None] + np.arange(q_len)[None, :]).reshape(-1)
                whole = tokens.size == num_rows and bool((tokens == np.arange(num_rows)).all())
                used = -(-ctx // block_size)
                groups.append(
                    _PrefillGroup(
                        tokens=None if whole else torch.from_numpy(tokens),
                        num_seqs=seqs.size,
                        tiles=_tile_rows(tables[seqs, :used], num_kv_heads),
                        q_len=q_len,
                        ctx=ctx,
                    )
                )
        return cls(
            num_tokens=num_rows,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            decode=buckets,
            native=native,
            prefill=tuple(groups),
            covers_all=int(q_lens.sum()) == num_rows,
        )

    def run(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """One layer's attention, ``[num_tokens, H, D]`` in ``query``'s dtype.

        The caches must have the shape the plan was built for (the front-ends in
        :mod:`kvblocks.ops` check it); ``scale``, ``sliding_window``, ``soft_cap`` and
        ``sinks`` as in :func:`kvblocks.ops.paged_attention`.
        """
        head_size = key_cache.shape[3]
        scale = 1.0 / math.sqrt(head_size) if scale is None else scale
        sinks_f32 = None if sinks is None else sinks.to(torch.float32)
        args = (query, key_cache, value_cache, scale, sliding_window, soft_cap, sinks_f32)
        parts = [(b.rows, _run_decode(b, *args)) for b in self.decode]
        if self.native is not None:
            if _native_ready(query, key_cache, value_cache):
                parts.append((self.native.rows, _run_native(self.native, *args)))
            else:
                fallback = _decode_buckets(
                    self.native.tables,
                    np.arange(self.native.lens.size),
                    self.native.first_row,
                    self.native.lens.astype(np.int64),
                    self.num_tokens,
                    self.num_kv_heads,
                    self.block_size,
                )
                parts += [(b.rows, _run_decode(b, *args)) for b in fallback]
        parts += [(g.tokens, _run_prefill(g, *args)) for g in self.prefill]
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]  # one bucket or group held every row, in order
        out = torch.empty_like(query) if self.covers_all else torch.zeros_like(query)
        for rows, attended in parts:
            if rows is None:
                out.copy_(attended)
            else:
                out.index_copy_(0, rows, attended)
        return out


def _check(
    tables: np.ndarray, lens: np.ndarray, q_lens: np.ndarray, num_blocks: int, block_size: int
) -> None:
    """The reference's argument checks (same messages), on the host copies."""
    if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise InvalidArgumentError(
            f"block_tables entries must be block ids in [0, {num_blocks}), got range "
            f"[{int(tables.min())}, {int(tables.max())}]"
        )
    capacity = tables.shape[1] * block_size
    if lens.size and int(lens.max()) > capacity:
        raise InvalidArgumentError(
            f"seq_lens up to {int(lens.max())} exceed the block table capacity "
            f"{capacity} (max_blocks {tables.shape[1]} * block_size {block_size})"
        )
    too_long = np.flatnonzero(q_lens > lens)
    if too_long.size:
        s = int(too_long[0])
        raise InvalidArgumentError(
            f"sequence {s} has {int(q_lens[s])} query tokens but seq_lens "
            f"{int(lens[s])}; seq_lens must include the chunk (>= query length)"
        )


def _decode_buckets(
    tables: np.ndarray,
    decodes: np.ndarray,
    first_row: np.ndarray,
    lens: np.ndarray,
    num_rows: int,
    num_kv_heads: int,
    block_size: int,
) -> tuple[_DecodeBucket, ...]:
    """The decodes ``decodes`` (indices into the step's sequences) in length buckets."""
    buckets = []
    num_tiles = -(-lens[decodes] // block_size)
    for members in length_buckets(num_tiles * block_size):
        seqs = decodes[members]
        whole = seqs.size == num_rows and bool((first_row[seqs] == np.arange(num_rows)).all())
        buckets.append(
            _decode_bucket(tables, seqs, first_row, lens, num_kv_heads, block_size, whole)
        )
    return tuple(buckets)


def _native_ready(query: Tensor, key_cache: Tensor, value_cache: Tensor) -> bool:
    """Whether the native kernel can read these caches in place (fp32, contiguous, CPU)."""
    return (
        key_cache.dtype == torch.float32
        and value_cache.dtype == torch.float32
        and key_cache.device.type == "cpu"
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and query.device.type == "cpu"
    )


def _run_native(
    native: _NativeDecode,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The decodes by the Rust kernel, ``[n, H, D]`` in ``query``'s dtype."""
    if native.rows is not None:
        query = query.index_select(0, native.rows)
    q = query.detach().to(torch.float32).contiguous()
    out = torch.empty_like(q)
    work = 2 * native.keys * q.shape[1] * q.shape[2]
    threads = max(1, min(torch.get_num_threads(), work // NATIVE_WORK_PER_THREAD))
    paged_decode_attention(
        out.numpy(),
        q.numpy(),
        key_cache.detach().numpy(),
        value_cache.detach().numpy(),
        native.tables,
        native.lens,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.detach().contiguous().numpy(),
        threads=threads,
    )
    return out.to(query.dtype)


def _decode_bucket(
    tables: np.ndarray,
    seqs: np.ndarray,
    first_row: np.ndarray,
    lens: np.ndarray,
    num_kv_heads: int,
    block_size: int,
    whole: bool,
) -> _DecodeBucket:
    b_lens = lens[seqs]
    used = int(-(-int(b_lens.max()) // block_size))
    slots = used * block_size
    n = seqs.size
    beyond = np.arange(slots)[None, :] >= b_lens[:, None]  # [n, slots]
    pad_rows = None
    if beyond.any():
        seq, pos = np.nonzero(beyond)
        heads = np.arange(num_kv_heads, dtype=np.int64)[None, :]
        rows = (seq[:, None] * num_kv_heads + heads) * slots + pos[:, None]
        pad_rows = torch.from_numpy(rows.reshape(-1))
    return _DecodeBucket(
        rows=None if whole else torch.from_numpy(first_row[seqs]),
        tiles=_tile_rows(tables[seqs, :used], num_kv_heads),
        slots=slots,
        beyond=torch.from_numpy(beyond).view(n, 1, 1, slots) if pad_rows is not None else None,
        pad_rows=pad_rows,
        last=torch.from_numpy(b_lens - 1).view(n, 1, 1, 1),
    )


def _attend(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    hidden: Tensor | None,
    scale: float,
    soft_cap: float | None,
    sink: Tensor | None,
) -> Tensor:
    """``q`` ``[n, Hkv, R, D]`` over ``keys``/``values`` ``[n, Hkv, L, D]`` (fp32).

    ``hidden`` (bool, broadcast to the scores ``[n, Hkv, R, L]``) marks keys a row may
    not see; their scores are replaced, so whatever the slot holds is ignored. ``sink``
    (``[Hkv, R, 1]``) joins each row's denominator. Every row must see at least one key.
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)
    if soft_cap is not None:
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    if sink is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = scores.sub_(row_max).exp_()
    denom = weights.sum(dim=-1, keepdim=True).add_(torch.exp(sink - row_max))
    return torch.matmul(weights, values).div_(denom)


def _run_decode(
    bucket: _DecodeBucket,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The bucket's attention, ``[n, H, D]`` in ``query``'s dtype."""
    n = bucket.last.shape[0]
    _, num_kv_heads, _, head_size = key_cache.shape
    group = query.shape[1] // num_kv_heads
    if bucket.rows is not None:
        query = query.index_select(0, bucket.rows)
    q = query.float().view(n, num_kv_heads, group, head_size)
    keys = _gather(key_cache, bucket.tiles, n, bucket.slots)
    values = _gather(value_cache, bucket.tiles, n, bucket.slots)
    if bucket.pad_rows is not None:
        # 0 * inf in the weighted sum would poison the row: zero what lies past each length.
        values.view(-1, head_size).index_fill_(0, bucket.pad_rows, 0.0)
    hidden = bucket.beyond
    if sliding_window is not None:
        key_pos = torch.arange(bucket.slots)
        outside = key_pos <= bucket.last - sliding_window  # [n, 1, 1, slots]
        hidden = outside if hidden is None else hidden | outside
    sink = None if sinks is None else sinks.view(num_kv_heads, group, 1)
    attended = _attend(q, keys, values, hidden, scale, soft_cap, sink)
    return attended.view(n, -1, head_size).to(query.dtype)


def _run_prefill(
    group: _PrefillGroup,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The group's attention, ``[n * q_len, H, D]`` in ``query``'s dtype."""
    q_len, ctx, n = group.q_len, group.ctx, group.num_seqs
    _, num_kv_heads, block_size, head_size = key_cache.shape
    num_heads = query.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    slots = group.tiles.shape[0] // (n * num_kv_heads) * block_size
    keys = _gather(key_cache, group.tiles, n, slots)[:, :, :ctx]
    values = _gather(value_cache, group.tiles, n, slots)[:, :, :ctx]
    if group.tokens is not None:
        query = query.index_select(0, group.tokens)
    q = query.float().view(n, q_len, num_heads, head_size)
    visible = None
    if q_len != ctx or sliding_window is not None:
        pos = (ctx - q_len + torch.arange(q_len))[:, None]
        key_pos = torch.arange(ctx)[None, :]
        visible = key_pos <= pos
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
    if soft_cap is None and sinks is None:
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=visible,
            is_causal=visible is None,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [n, q_len, H, D]
    else:
        # Every query head of a KV head as rows of one product: row = g * q_len + i.
        rows = q.view(n, q_len, num_kv_heads, heads_per_kv, head_size).permute(0, 2, 3, 1, 4)
        rows = rows.reshape(n, num_kv_heads, heads_per_kv * q_len, head_size)
        if visible is None:
            visible = torch.ones(q_len, ctx, dtype=torch.bool).tril()
        hidden = (~visible).repeat(heads_per_kv, 1)
        sink = None
        if sinks is not None:
            sink = sinks.view(num_kv_heads, heads_per_kv, 1, 1).expand(-1, -1, q_len, 1)
            sink = sink.reshape(num_kv_heads, heads_per_kv * q_len, 1)
        flat = _attend(rows, keys, values, hidden, scale, soft_cap, sink)
        attended = flat.view(n, num_kv_heads, heads_per_kv, q_len, head_size).permute(0, 3, 1, 2, 4)
    return attended.reshape(n * q_len, num_heads, head_size).to(query.dtype)
