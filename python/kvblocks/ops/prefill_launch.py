"""Plan and launch the tensor-core prefill kernel (``cuda/prefill_attention.cu``).

fp16/bf16 prefill/extend goes to ``prefill_attention_kernel<T, HEAD>`` (the choice is
:func:`kvblocks.ops.kernel_driver.run_prefill`'s; fp32 keeps the split-K kernel).
Everything here works on host-side sizes and raw addresses, so the CUDA backend (CuPy
launcher) and the CPU emulation in the tests run the same plan. The shared-memory formula mirrors
``kvb::PrefillShape`` (a test compares them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.checks import (
    check_block_size,
    check_head_size,
    check_ints,
    check_optional_positive,
    check_sliding_window,
)
from kvblocks.ops.cuda_sources import prefill_kernel_name
from kvblocks.ops.launch_plan import THREADS, KernelLaunch
from kvblocks.validation import check_int, check_number

__all__ = [
    "MAX_GRID_YZ",
    "PrefillPlan",
    "plan_prefill",
    "prefill_launch",
    "prefill_rows",
    "prefill_smem_bytes",
    "prefill_threads",
    "prefill_tile",
]

MAX_GRID_YZ = 65535
"""CUDA's limit on grid.y and grid.z."""


def prefill_threads(head_size: int) -> int:
    """Threads per CTA of ``prefill_attention_kernel<T, head_size>`` (4 warps)."""
    del head_size
    return THREADS


def prefill_rows(head_size: int) -> int:
    """Query rows per CTA (``kvb::PrefillShape::kRows``): 4 warps x 2 row blocks of 16,
    one row block per warp at head 256 and 112."""
    return 64 if head_size > 128 or head_size == 112 else 128


def prefill_tile(head_size: int) -> int:
    """K/V tokens per tile (``kTile``): 64 at head 64, 32 above."""
    return 32 if head_size > 64 else 64


def prefill_smem_bytes(head_size: int) -> int:
    """Dynamic shared memory of ``prefill_attention_kernel<T, head_size>`` (T 2 bytes): the
    Q tile (later the output tile), 2 K and 2 V tiles (1 each at head 256, where 2 would
    not leave an A100 room for 2 CTAs) and the block ids of the tiles in flight; rows
    padded by 16 bytes. 44-68 KiB: the launch opts in above 48 KiB, and every size fits the
    99 KiB a CTA may use on sm_86/sm_89."""
    rows, tile = prefill_rows(head_size), prefill_tile(head_size)
    q_bytes, tile_bytes = rows * (head_size + 8) * 2, tile * (head_size + 8) * 2
    stages = 2 if q_bytes + 4 * tile_bytes + 3 * tile * 4 <= 80 * 1024 else 1
    return q_bytes + 2 * stages * tile_bytes + (stages + 1) * tile * 4


@dataclass(frozen=True)
class PrefillPlan:
    """How one prefill call maps onto CTAs (grid: KV head x head chunk, sequence, tile)."""

    kernel: str
    rows: int
    heads_per_cta: int
    queries_per_cta: int
    head_chunks: int
    q_tiles: int
    smem_bytes: int
    grid: tuple[int, int, int]
    threads: int = THREADS
    """Threads per CTA (the block)."""
    sinks: bool = False
    """The kernel adds attention sinks (its ``SINKS`` instantiation: the launch must pass
    their address)."""


def _heads_per_cta(group: int, rows: int, max_query_len: int) -> int:
    """Query heads of one KV group packed into a CTA: all rows go to one head's queries
    for long chunks; short chunks (decode-like rows) share the CTA's K/V tiles across
    heads. The largest divisor of ``group`` that fits, so no head chunk is half empty."""
    fit = max(1, rows // max(1, max_query_len))
    return max(d for d in range(1, min(group, fit) + 1) if group % d == 0)


def plan_prefill(
    *,
    dtype: torch.dtype,
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_seqs: int,
    max_query_len: int,
    sinks: bool = False,
) -> PrefillPlan:
    """Plan a tensor-core prefill launch. ``max_query_len`` is a hint: below the real
    longest chunk it costs parallelism (the kernel loops over query tiles), never rows.
    ``sinks``: the layer has attention sinks (the kernel's ``SINKS`` instantiation)."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise InvalidArgumentError(f"the tensor-core prefill kernel takes fp16/bf16, not {dtype}")
    check_head_size(head_size)
    check_ints(num_heads=num_heads, num_kv_heads=num_kv_heads, minimum=1)
    check_ints(num_seqs=num_seqs, minimum=0)
    # A hint: any size is valid (the grid is clamped below), a negative one is not.
    check_int(max_query_len, "max_query_len", minimum=0)
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_heads // num_kv_heads
    rows = prefill_rows(head_size)
    heads_per_cta = _heads_per_cta(group, rows, max_query_len)
    queries_per_cta = rows // heads_per_cta
    head_chunks = math.ceil(group / heads_per_cta)
    q_tiles = min(MAX_GRID_YZ, max(1, math.ceil(max_query_len / queries_per_cta)))
    if num_seqs > MAX_GRID_YZ:
        raise InvalidArgumentError(
            f"a batch of {num_seqs} sequences exceeds the CUDA grid limit of {MAX_GRID_YZ} "
            "per launch; split the batch"
        )
    return PrefillPlan(
        kernel=prefill_kernel_name(dtype, head_size, sinks=bool(sinks)),
        rows=rows,
        heads_per_cta=heads_per_cta,
        queries_per_cta=queries_per_cta,
        head_chunks=head_chunks,
        q_tiles=q_tiles,
        smem_bytes=prefill_smem_bytes(head_size),
        # z (query tiles, issued slowest and reversed in the kernel: longest first).
        grid=(num_kv_heads * head_chunks, num_seqs, q_tiles),
        threads=prefill_threads(head_size),
        sinks=bool(sinks),
    )


def prefill_launch(
    plan: PrefillPlan,
    *,
    out: int,
    query: int,
    key_cache: int,
    value_cache: int,
    block_tables: int,
    seq_lens: int,
    query_start_loc: int,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    max_blocks: int,
    num_blocks: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    sinks: int = 0,
) -> KernelLaunch:
    """The kernel launch for ``plan``; addresses as ints (``sinks``: fp32 ``[num_heads]``
    attention-sink logits, nonzero exactly when the plan's kernel adds them).

    Raises :class:`~kvblocks.errors.InvalidArgumentError` for a value the kernel's
    argument types cannot hold (a negative address, a size past int32) or that it cannot
    use (a non-finite scale, a bad window or block size).
    """
    if not isinstance(plan, PrefillPlan):
        raise InvalidArgumentError(f"plan must be a PrefillPlan, got {type(plan).__name__}")
    for name, address in (
        ("out", out), ("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
        ("block_tables", block_tables), ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc), ("sinks", sinks),
    ):  # fmt: skip
        check_int(address, name, minimum=0, maximum=2**64 - 1, expected="a device address (an int)")
    if (sinks != 0) != plan.sinks:
        raise InvalidArgumentError(
            "sinks must be given exactly when the plan was made with sinks=True (the "
            f"kernel {plan.kernel} {'reads' if plan.sinks else 'ignores'} them)"
        )
    check_ints(num_tokens=num_tokens, max_blocks=max_blocks, minimum=0)
    check_ints(num_heads=num_heads, num_kv_heads=num_kv_heads, num_blocks=num_blocks, minimum=1)
    check_block_size(block_size)
    # Any finite scale: the kernel computes non-positive ones too (the front-ends refuse
    # them), but a NaN or inf would reach every score.
    check_number(scale, "scale", expected="a finite float", numpy=True)
    check_optional_positive(soft_cap, "soft_cap")
    check_sliding_window(sliding_window)
    args = (
        np.uint64(out), np.uint64(query), np.uint64(key_cache), np.uint64(value_cache),
        np.uint64(block_tables), np.uint64(seq_lens), np.uint64(query_start_loc),
        np.int32(num_tokens), np.int32(num_heads), np.int32(num_kv_heads),
        np.int32(block_size), np.int32(max_blocks), np.int32(num_blocks),
        np.int32(plan.heads_per_cta), np.float32(scale), np.float32(soft_cap or 0.0),
        np.int32(sliding_window or 0), np.uint64(sinks),
    )  # fmt: skip
    return KernelLaunch(plan.kernel, plan.grid, (plan.threads, 1, 1), plan.smem_bytes, args)
