"""Host-side launch planning: grids, split-K, shared memory and packed kernel arguments.

Pure Python on CPU-side sizes (nothing reads device memory), so a plan is cheap and
CUDA-graph friendly. The same plans drive CuPy on a GPU and the CPU emulation in the
tests, so the planner is exercised without a GPU too. The shared-memory formula
mirrors ``kvb::SplitKShape`` in ``cuda/split_k_attention.cu`` (a test compares them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.cuda_sources import (
    DECODE_ROWS,
    PREFILL_ROWS,
    merge_kernel_name,
    split_k_kernel_name,
)

__all__ = [
    "THREADS",
    "KernelLaunch",
    "Launcher",
    "SplitKPlan",
    "copy_blocks_launch",
    "plan_split_k",
    "reshape_and_cache_launch",
    "split_k_launches",
    "split_k_smem_bytes",
]

THREADS = 128
"""Threads per CTA of every kernel (``kvb::kThreads``)."""
PARTITION_TOKENS = 256
"""Split-K chunk granularity: a multiple of every block size, long enough to amortize."""
CTAS_PER_SM = 4
"""Resident attention CTAs per SM the split planner aims for (registers allow ~4)."""


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: name expression, geometry and packed arguments.

    ``args`` are NumPy scalars with the kernel parameters' exact widths; pointers are
    ``np.uint64`` device (or host, for the emulation) addresses.
    """

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    args: tuple[np.generic, ...]


Launcher = Callable[[KernelLaunch], None]
"""Runs one :class:`KernelLaunch` (on the current stream, for CuPy; at once, for the CPU
emulation in the tests). Passed down from the CUDA backend through the driver."""


@dataclass(frozen=True)
class SplitKPlan:
    """How one attention call maps onto CTAs."""

    kernel: str
    merge_kernel: str
    rows: int
    heads_per_cta: int
    queries_per_cta: int
    head_chunks: int
    q_tiles: int
    num_splits: int
    split_tokens: int
    smem_bytes: int
    grid: tuple[int, int, int]


def split_k_smem_bytes(dtype: torch.dtype, head_size: int, rows: int) -> int:
    """Dynamic shared memory of ``split_k_attention_kernel<dtype, head_size, rows>``."""
    esize = torch.empty((), dtype=dtype).element_size()
    vec = 16 // esize
    vecs_per_row = head_size // vec
    row_bytes = head_size * esize
    per_tile = 8192 // row_bytes
    tile = 32 if per_tile >= 32 else (16 if per_tile >= 16 else 8)
    tile_bytes = 2 * tile * (row_bytes + 16)
    reduce_bytes = max(rows * vecs_per_row, THREADS) * vec * 4
    return max(tile_bytes, reduce_bytes) + rows * (head_size + 4) * 4 + rows * tile * 4 + 12 * rows


def plan_split_k(
    *,
    dtype: torch.dtype,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    decode: bool,
    target_ctas: int,
    partition_tokens: int = PARTITION_TOKENS,
) -> SplitKPlan:
    """Plan a decode (``decode=True``: one query per sequence) or prefill launch.

    Decode CTAs serve up to 8 query heads of one KV group; when batch x KV heads gives
    fewer than ``target_ctas`` CTAs (about ``CTAS_PER_SM`` x the SM count), each
    sequence is split into chunks of whole ``partition_tokens`` multiples whose partials
    a merge kernel combines.
    """
    group = num_heads // num_kv_heads
    rows_max = DECODE_ROWS if decode else PREFILL_ROWS
    heads_per_cta = min(group, rows_max)
    queries_per_cta = 1 if decode else max(1, rows_max // heads_per_cta)
    head_chunks = math.ceil(group / heads_per_cta)
    q_tiles = 1 if decode else max(1, math.ceil(max_query_len / queries_per_cta))
    num_splits, split_tokens = 1, 0
    ctas = num_kv_heads * head_chunks * num_seqs
    if decode and max_seq_len > partition_tokens and ctas < target_ctas:
        want = min(math.ceil(target_ctas / ctas), math.ceil(max_seq_len / partition_tokens))
        chunk = math.ceil(math.ceil(max_seq_len / want) / partition_tokens) * partition_tokens
        num_splits = math.ceil(max_seq_len / chunk)
        split_tokens = chunk if num_splits > 1 else 0
    if num_seqs > 65535 or num_kv_heads * head_chunks > 65535:
        raise InvalidArgumentError(
            f"a batch of {num_seqs} sequences with {num_kv_heads} KV heads exceeds the CUDA "
            "grid limit of 65535 per launch; split the batch"
        )
    return SplitKPlan(
        kernel=split_k_kernel_name(dtype, head_size, rows_max),
        merge_kernel=merge_kernel_name(dtype, head_size),
        rows=rows_max,
        heads_per_cta=heads_per_cta,
        queries_per_cta=queries_per_cta,
        head_chunks=head_chunks,
        q_tiles=q_tiles,
        num_splits=num_splits,
        split_tokens=split_tokens,
        smem_bytes=split_k_smem_bytes(dtype, head_size, rows_max),
        # x grows with the prompt (limit 2^31 - 1); y and z stay small (limit 65535).
        grid=(q_tiles * num_splits, num_seqs, num_kv_heads * head_chunks),
    )


def _ptr(address: int) -> np.uint64:
    ptr: np.uint64 = np.uint64(address)
    return ptr


def split_k_launches(
    plan: SplitKPlan,
    *,
    out: int,
    part_out: int,
    part_ml: int,
    query: int,
    key_cache: int,
    value_cache: int,
    block_tables: int,
    seq_lens: int,
    query_start_loc: int,
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    max_blocks: int,
    num_blocks: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    sinks: int = 0,
) -> list[KernelLaunch]:
    """The attention launch (plus the merge launch when split); addresses as ints.

    ``query_start_loc`` is 0 for decode; ``num_rows`` is num_tokens x num_heads;
    ``sinks`` is the address of fp32 ``[num_heads]`` attention-sink logits, 0 for none
    (the kernel that normalizes a row adds its sink: the merge when split).
    """
    args = (
        _ptr(out), _ptr(part_out), _ptr(part_ml), _ptr(query), _ptr(key_cache),
        _ptr(value_cache), _ptr(block_tables), _ptr(seq_lens), _ptr(query_start_loc),
        np.int32(num_rows // num_heads), np.int32(num_heads), np.int32(num_kv_heads),
        np.int32(block_size), np.int32(max_blocks), np.int32(num_blocks),
        np.int32(plan.heads_per_cta),
        np.int32(plan.queries_per_cta), np.int32(plan.num_splits),
        np.int32(plan.split_tokens), np.float32(scale), np.float32(soft_cap or 0.0),
        np.int32(sliding_window or 0), _ptr(sinks),
    )  # fmt: skip
    launches = [KernelLaunch(plan.kernel, plan.grid, (THREADS, 1, 1), plan.smem_bytes, args)]
    if plan.num_splits > 1 and num_rows > 0:
        launches.append(
            KernelLaunch(
                plan.merge_kernel, (num_rows, 1, 1), (THREADS, 1, 1), 0,
                (_ptr(out), _ptr(part_out), _ptr(part_ml), np.int32(plan.num_splits),
                 np.int32(num_heads), _ptr(sinks)),
            )
        )  # fmt: skip
    return launches


def reshape_and_cache_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> KernelLaunch:
    """One warp per (token, KV head); strides in bytes."""
    num_tokens, num_kv_heads, head_size = key.shape
    num_blocks, _, block_size, _ = key_cache.shape
    esize = key.element_size()
    warps = num_tokens * num_kv_heads
    args = (
        _ptr(key.data_ptr()), _ptr(value.data_ptr()), _ptr(key_cache.data_ptr()),
        _ptr(value_cache.data_ptr()), _ptr(slot_mapping.data_ptr()), np.int32(num_tokens),
        np.int32(num_kv_heads), np.int32(block_size), np.int32(head_size * esize),
        np.int64(num_blocks * block_size), np.int64(key.stride(0) * esize),
        np.int64(key.stride(1) * esize), np.int64(value.stride(0) * esize),
        np.int64(value.stride(1) * esize),
    )  # fmt: skip
    grid = (max(1, math.ceil(warps * 32 / THREADS)), 1, 1)
    return KernelLaunch("reshape_and_cache_kernel", grid, (THREADS, 1, 1), 0, args)


def copy_blocks_launch(
    base: int, mapping: int, num_pairs: int, num_caches: int, cache_stride: int,
    block_bytes: int, num_blocks: int,
) -> KernelLaunch:  # fmt: skip
    """One CTA per (pair, cache); all layers' K and V from one base address."""
    args = (
        _ptr(base), _ptr(mapping), np.int64(cache_stride), np.int64(block_bytes),
        np.int64(num_blocks),
    )  # fmt: skip
    return KernelLaunch("copy_blocks_kernel", (num_pairs, num_caches, 1), (THREADS, 1, 1), 0, args)
