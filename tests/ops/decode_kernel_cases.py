"""Launch ``decode_attention_kernel`` / ``merge_partials_kernel`` in the CPU emulator with
hand-built item plans (no planner), and the torch answers to compare them with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from emu_runtime import emu_launch, library
from ops_cases import PagedCase

from kvblocks.ops.cuda_sources import CTYPE_NAMES, decode_kernel_name, merge_partials_name
from kvblocks.ops.launch_plan import KernelLaunch

THREADS = 128
LOG2E = math.log2(math.e)
NAN = float("nan")


def ptr(t: torch.Tensor) -> np.uint64:
    """Host address of a CPU tensor's data (the emulated kernels read it directly)."""
    return np.uint64(t.data_ptr())


@dataclass
class DecodeRun:
    """What one launch wrote: outputs (NaN where not written) and the partial workspace."""

    out: torch.Tensor
    part_out: torch.Tensor
    part_ml: torch.Tensor


def run_decode(
    case: PagedCase,
    items: list[tuple[int, int, int, int]],
    *,
    group_t: int,
    scale: float,
    soft_cap: float = 0.0,
    num_slots: int = 0,
    spare_ctas: int = 1,
    garbage_items: bool = True,
    stages: int = 2,
    sinks: torch.Tensor | None = None,
) -> DecodeRun:
    """One ``decode_attention_kernel`` launch over ``items`` (seq, kv_begin, kv_end, slot).

    ``stages`` picks the K/V buffering variant (``STAGES``); ``sinks`` (fp32
    ``[num_heads]``) are passed by address, None as a null pointer. The grid has ``spare_ctas``
    more CTAs than items; their item slots hold garbage (an
    out-of-range sequence and range) that the kernel must never look at.
    """
    num_seqs, num_heads, dim = case.query.shape
    _, num_kv_heads, block, _ = case.key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.full_like(case.query, NAN)
    part_out = torch.full((max(num_slots, 1), num_heads, dim), NAN)
    part_ml = torch.full((max(num_slots, 1), num_heads, 2), NAN)
    grid_x = len(items) + spare_ctas
    buf = torch.zeros((max(grid_x, 1), 4), dtype=torch.int32)
    if items:
        buf[: len(items)] = torch.tensor(items, dtype=torch.int32)
    if garbage_items:
        buf[len(items) :] = torch.tensor([1 << 30, -(1 << 30), 1 << 30, 1 << 30])
    count = torch.tensor([len(items)], dtype=torch.int32)
    name = decode_kernel_name(case.query.dtype, dim, block, group_t, stages)
    smem = library().kvb_emu_smem_bytes(name.encode())
    assert smem > 0, name
    args = (
        ptr(out), ptr(part_out), ptr(part_ml), ptr(case.query), ptr(case.key_cache),
        ptr(case.value_cache), ptr(case.block_tables), ptr(buf), ptr(count),
        np.int32(num_seqs), np.int32(num_heads), np.int32(num_kv_heads),
        np.int32(case.block_tables.shape[1]), np.int32(case.key_cache.shape[0]),
        np.float32(scale), np.float32(soft_cap), sinks_ptr(sinks),
    )  # fmt: skip
    grid = (max(grid_x, 1), num_kv_heads * math.ceil(group / group_t), 1)
    emu_launch(KernelLaunch(name, grid, (THREADS, 1, 1), smem, args))
    return DecodeRun(out, part_out, part_ml)


def sinks_ptr(sinks: torch.Tensor | None) -> np.uint64:
    """The kernel argument for ``sinks``: its address, or a null pointer."""
    if sinks is None:
        return np.uint64(0)
    assert sinks.dtype == torch.float32 and sinks.is_contiguous()
    return ptr(sinks)


def run_merge(
    case: PagedCase, run: DecodeRun, indptr: list[int], sinks: torch.Tensor | None = None
) -> None:
    """``merge_partials_kernel`` over ``run``'s partials into ``run.out``."""
    num_seqs, num_heads, dim = case.query.shape
    ind = torch.tensor(indptr, dtype=torch.int32)
    args = (
        ptr(run.out), ptr(run.part_out), ptr(run.part_ml), ptr(ind), np.int32(num_seqs),
        np.int32(num_heads), sinks_ptr(sinks),
    )  # fmt: skip
    name = merge_partials_name(case.query.dtype, dim)
    emu_launch(KernelLaunch(name, (num_seqs, num_heads, 1), (THREADS, 1, 1), 0, args))


def expected_partial(
    case: PagedCase, seq: int, begin: int, end: int, scale: float, soft_cap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(acc [H, D], max [H] in log2 units, sum [H])`` over keys ``begin <= j < end`` of
    ``seq`` (fp32 math on the cache's values)."""
    num_heads = case.query.shape[1]
    group = num_heads // case.key_cache.shape[1]
    keys = case.dense_keys[seq][:, begin:end].repeat_interleave(group, dim=0)  # [H, n, D]
    vals = case.dense_values[seq][:, begin:end].repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hnd->hn", case.query[seq].float(), keys) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores * LOG2E
    if scores.shape[1] == 0:
        dim = case.query.shape[2]
        return (
            torch.zeros(num_heads, dim),
            torch.full((num_heads,), -math.inf),
            torch.zeros(num_heads),
        )
    m = scores.max(dim=1).values
    p = torch.exp2(scores - m[:, None])
    return torch.einsum("hn,hnd->hd", p, vals), m, p.sum(dim=1)


def expected_out(
    case: PagedCase, seq: int, begin: int, end: int, scale: float, soft_cap: float = 0.0
) -> torch.Tensor:
    """The normalized attention output ``[H, D]`` of ``seq`` over keys ``[begin, end)``."""
    acc, _, total = expected_partial(case, seq, begin, end, scale, soft_cap)
    return torch.where(total[:, None] > 0, acc / total.clamp_min(1e-30)[:, None], 0.0)


def ctype(dtype: torch.dtype) -> str:
    """The CUDA type name of ``dtype``."""
    return CTYPE_NAMES[dtype]
