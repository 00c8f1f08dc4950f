"""Length-aware split planning for decode attention (the host side of ``decode_attention_kernel``).

A decode batch mixes sequences of very different lengths: one 32k context among
hundreds-of-tokens ones must be cut into many pieces for the GPU to stay busy, while
the short ones should run whole. :func:`plan_decode` turns host-side lengths into *work
items* ``(seq, kv_begin, kv_end, partial_slot)``, one CTA column each (times the KV
heads), the way FlashInfer's ``plan()`` does:

* the visible keys of sequence ``s`` are ``[max(0, len - window), len)``: a sliding
  window removes whole splits, never launches them;
* every sequence is cut into chunks of at most ``chunk_tokens`` keys, one chunk size for
  the batch, chosen as the smallest multiple of ``granularity`` (and at least
  ``min_chunk_tokens``) for which the item count stays within the budget
  ``min(max_items, target_items + num_seqs)``: about ``target_items`` chunks' worth of
  work (``target_items`` = the device's resident CTAs / CTAs per item) plus at most one
  shorter tail per sequence, so each CTA gets about ``total_keys / target_items`` keys
  and a long sequence gets proportionally many items while short ones get one; item
  boundaries fall on multiples of ``granularity`` counted from key 0 (the first item of
  a windowed sequence starts at the window), so kernel tiles are never cut mid-item;
* a sequence cut in ``n > 1`` items owns ``n`` consecutive partial slots
  ``merge_indptr[s] .. merge_indptr[s + 1]`` (fp32 partial outputs the merge kernel
  combines by log-sum-exp); a sequence in one item (``partial_slot = -1``) is written
  directly and has an empty merge range. A sequence of length 0 gets one empty item,
  which writes zeros.

Everything is vectorised NumPy over the batch (a bisection of about ten steps, each a
few array operations), so planning a batch of hundreds costs tens of microseconds and
is done once per step, not once per layer (see :class:`DecodeAttention
<kvblocks.ops.decode_attention.DecodeAttention>`, which caches plans).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.checks import check_ints, check_sliding_window
from kvblocks.validation import check_int, check_optional_int

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_MIN_CHUNK_TOKENS",
    "DecodeItems",
    "plan_decode",
    "visible_ranges",
]

DEFAULT_GRANULARITY = 128
"""Chunk sizes are multiples of this many keys, and item boundaries fall on multiples of it
(the first item of a windowed sequence starts at the window): one round of
``decode_attention_kernel``'s four warps over 32-key tiles, and a multiple of every block
size, so no item starts or ends inside a tile except at the window's edge."""
DEFAULT_MIN_CHUNK_TOKENS = 128
"""No chunk is shorter than this (except a sequence's tail): below it the partial
write and merge cost more than the parallelism gains."""


@dataclass(frozen=True)
class DecodeItems:
    """A decode plan in the layout of the kernel ABI (host NumPy arrays).

    ``items``: int32 ``[num_items, 4]`` rows ``(seq, kv_begin, kv_end, partial_slot)``;
    ``merge_indptr``: int32 ``[num_seqs + 1]``; ``num_slots``: partial slots used
    (``merge_indptr[-1]``); ``chunk_tokens``: the longest item's bound.
    """

    items: np.ndarray
    merge_indptr: np.ndarray
    num_slots: int
    chunk_tokens: int

    @property
    def num_items(self) -> int:
        """Number of work items (CTA columns the attention kernel must run)."""
        return int(self.items.shape[0])


def visible_ranges(
    seq_lens: np.ndarray, sliding_window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(kv_begin, kv_end)`` int64 arrays of the keys the decode query at ``len - 1`` sees."""
    end = seq_lens.astype(np.int64)
    if sliding_window is None:
        return np.zeros_like(end), end
    return np.maximum(end - sliding_window, 0), end


def _as_lengths(seq_lens: np.ndarray) -> np.ndarray:
    if not isinstance(seq_lens, np.ndarray) or seq_lens.ndim != 1:
        raise InvalidArgumentError("seq_lens must be a 1-D NumPy integer array")
    if seq_lens.dtype.kind not in "iu":
        raise InvalidArgumentError(f"seq_lens must hold integers, got dtype {seq_lens.dtype}")
    if seq_lens.size and (int(seq_lens.min()) < 0 or int(seq_lens.max()) >= 2**31):
        raise InvalidArgumentError(
            f"seq_lens must be in [0, 2^31), got range [{int(seq_lens.min())}, "
            f"{int(seq_lens.max())}]"
        )
    return seq_lens


def plan_decode(
    seq_lens: np.ndarray,
    *,
    target_items: int,
    max_items: int | None = None,
    sliding_window: int | None = None,
    granularity: int = DEFAULT_GRANULARITY,
    min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
) -> DecodeItems:
    """Plan the work items of one decode batch from host-side ``seq_lens``.

    ``target_items``: items that fill the device once (resident CTAs / CTAs per item,
    e.g. ``SMs x 4 // (num_kv_heads x head_chunks)``); ``max_items``: the capacity of
    the item buffer (at least ``len(seq_lens)``; default unbounded). See the module
    docstring for the rules.
    """
    lens = _as_lengths(seq_lens)
    num_seqs = int(lens.shape[0])
    check_sliding_window(sliding_window)
    check_int(target_items, "target_items", minimum=1, expected="a positive int")
    # Item bounds are int32 (and int64 while planned): a chunk past every length is the
    # same plan as one of 2^31 - 1, a larger one would overflow NumPy.
    check_ints(granularity=granularity, min_chunk_tokens=min_chunk_tokens, minimum=1)
    check_optional_int(max_items, "max_items", expected="an int or None")
    if max_items is not None and max_items < num_seqs:
        raise InvalidArgumentError(
            f"max_items {max_items} is below the batch size {num_seqs}: every sequence "
            "needs at least one item"
        )
    begin, end = visible_ranges(lens, sliding_window)
    # Boundaries fall on multiples of the granularity counted from 0, the first item
    # clipped to the window: the span is measured from the aligned start below it.
    base = begin - begin % granularity
    span = np.where(end > begin, end - base, 0)
    budget = (
        target_items + num_seqs if max_items is None else min(max_items, target_items + num_seqs)
    )
    # The chunk in units of `granularity`: the smallest feasible one at or above the
    # minimum. ceil(span / C) only falls as C grows, so bisection finds it; C covering the
    # longest span gives one item per sequence, always within the budget.
    lo = -(-min_chunk_tokens // granularity)
    hi = max(lo, -(-int(span.max(initial=0)) // granularity))
    spans = span[span > 0]
    fixed = num_seqs - int(spans.shape[0])  # empty sequences: one item each
    while lo < hi:
        mid = (lo + hi) // 2
        chunk = mid * granularity
        if int(((spans + (chunk - 1)) // chunk).sum()) + fixed <= budget:
            hi = mid
        else:
            lo = mid + 1
    chunk = lo * granularity
    counts = np.maximum((span + (chunk - 1)) // chunk, 1)
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    seq = np.repeat(np.arange(num_seqs, dtype=np.int64), counts)
    k = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
    start = base[seq] + k * chunk
    item_begin = np.maximum(start, begin[seq])
    item_end = np.minimum(start + chunk, end[seq])
    split = np.where(counts > 1, counts, 0)
    merge_indptr = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(split, out=merge_indptr[1:])
    slot = np.where(counts[seq] > 1, merge_indptr[:-1][seq] + k, -1)
    items = np.stack([seq, item_begin, item_end, slot], axis=1).astype(np.int32)
    return DecodeItems(
        items=items,
        merge_indptr=merge_indptr,
        num_slots=int(merge_indptr[-1]),
        chunk_tokens=chunk,
    )
