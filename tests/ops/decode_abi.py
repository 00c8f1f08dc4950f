"""The decode plan ABI executed in torch, on the memory the launch arguments point at.

A test launcher for :class:`kvblocks.ops.DecodeAttention` on CPU tensors: it reads every
buffer through the raw addresses of a :class:`~kvblocks.ops.launch_plan.KernelLaunch`
exactly as ``decode_attention_kernel`` / ``merge_partials_kernel`` would (items and the
item count from the plan buffer, only CTAs below ``*num_items``, partials in log2
units, fields clamped), so the host path is checked end to end without the CUDA
kernel. The emulator runs the real kernel where the harness has it
(``test_decode_plan_emulator.py``).
"""

from __future__ import annotations

import ctypes
import math
import re

import torch

from kvblocks.ops.launch_plan import KernelLaunch

LOG2E = math.log2(math.e)
_TYPES = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16, "float": torch.float32}


def view(address: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable tensor over host memory at ``address`` (CPU tensors' data)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = count * torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * size).from_address(int(address))
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _template(name: str) -> list[str]:
    match = re.match(r"^\w+<(.*)>$", name)
    assert match, name
    return [part.strip() for part in match.group(1).split(",")]


def partial_state(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, soft_cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(acc [H, D], max [H] in log2 units, sum [H])`` of queries ``[H, D]`` over keys
    ``[n, H, D]`` (already expanded to the query heads)."""
    scores = torch.einsum("hd,nhd->hn", query.float(), keys.float()) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores * LOG2E
    if scores.shape[1] == 0:
        heads, dim = query.shape
        return torch.zeros(heads, dim), torch.full((heads,), -math.inf), torch.zeros(heads)
    m = scores.max(dim=1).values
    p = torch.exp2(scores - m[:, None])
    return torch.einsum("hn,nhd->hd", p, values.float()), m, p.sum(dim=1)


def normalize(
    acc: torch.Tensor, m: torch.Tensor, total: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """``acc [H, D]`` with max ``m`` (log2 units) and sum ``total`` normalized, the sink
    logits (natural units, or None) in the denominator; rows without a key give zeros."""
    seen = torch.isfinite(m) & (total > 0)
    m0 = torch.where(seen, m, 0.0)
    denom = total
    weight = torch.ones_like(total)
    if sinks is not None:
        top = torch.maximum(m0, sinks * LOG2E)
        weight = torch.exp2(m0 - top)
        denom = total * weight + torch.exp2(sinks * LOG2E - top)
    return torch.where(seen[:, None], acc * (weight / denom.clamp_min(1e-30))[:, None], 0.0)


def _sinks(address: int, num_heads: int) -> torch.Tensor | None:
    return None if int(address) == 0 else view(address, torch.float32, (num_heads,)).clone()


def run_split_k_attention(launch: KernelLaunch) -> None:
    """``decode_attention_kernel<T, D, BLOCK, GROUP>`` per the ABI."""
    dtype_name, dim_s, block_s, _group = _template(launch.name)
    dtype, dim, block = _TYPES[dtype_name], int(dim_s), int(block_s)
    (
        out, part_out, part_ml, query, key_cache, value_cache, tables, items_ptr, count_ptr,
        num_seqs, num_heads, num_kv_heads, max_blocks, num_blocks, scale, soft_cap, sinks_ptr,
    ) = launch.args  # fmt: skip
    num_seqs, num_heads, num_kv_heads = int(num_seqs), int(num_heads), int(num_kv_heads)
    sinks = _sinks(sinks_ptr, num_heads)
    max_blocks, num_blocks = int(max_blocks), int(num_blocks)
    grid_x = launch.grid[0]
    count = max(0, min(int(view(count_ptr, torch.int32, (1,))[0]), grid_x))
    items = view(items_ptr, torch.int32, (grid_x, 4))[:count].tolist()
    q = view(query, dtype, (num_seqs, num_heads, dim))
    kc = view(key_cache, dtype, (num_blocks, num_kv_heads, block, dim))
    vc = view(value_cache, dtype, (num_blocks, num_kv_heads, block, dim))
    bt = view(tables, torch.int32, (num_seqs, max_blocks)).long()
    o = view(out, dtype, (num_seqs, num_heads, dim))
    group = num_heads // num_kv_heads
    for seq, begin, end, slot in items:
        seq = min(max(seq, 0), num_seqs - 1)
        limit = max_blocks * block
        begin, end = min(max(begin, 0), limit), min(max(end, 0), limit)
        pos = torch.arange(begin, max(begin, end))
        blocks = bt[seq, pos // block]
        blocks = torch.where((blocks >= 0) & (blocks < num_blocks), blocks, 0)
        keys = kc[blocks, :, pos % block].repeat_interleave(group, dim=1)
        vals = vc[blocks, :, pos % block].repeat_interleave(group, dim=1)
        acc, m, s = partial_state(q[seq], keys, vals, float(scale), float(soft_cap))
        if slot < 0:
            o[seq] = normalize(acc, m, s, sinks).to(dtype)
        else:
            view(part_out + slot * num_heads * dim * 4, torch.float32, (num_heads, dim))[:] = acc
            ml = view(part_ml + slot * num_heads * 2 * 4, torch.float32, (num_heads, 2))
            ml[:, 0], ml[:, 1] = m, s


def run_merge(launch: KernelLaunch) -> None:
    """``merge_partials_kernel<T, D>`` per the ABI."""
    dtype_name, dim_s = _template(launch.name)
    dtype, dim = _TYPES[dtype_name], int(dim_s)
    out, part_out, part_ml, indptr_ptr, num_seqs, num_heads, sinks_ptr = launch.args
    num_seqs, num_heads = int(num_seqs), int(num_heads)
    sinks = _sinks(sinks_ptr, num_heads)
    indptr = view(indptr_ptr, torch.int32, (num_seqs + 1,)).tolist()
    o = view(out, dtype, (num_seqs, num_heads, dim))
    for seq in range(num_seqs):
        lo, hi = indptr[seq], indptr[seq + 1]
        if hi <= lo:
            continue
        acc = view(part_out + lo * num_heads * dim * 4, torch.float32, (hi - lo, num_heads, dim))
        ml = view(part_ml + lo * num_heads * 2 * 4, torch.float32, (hi - lo, num_heads, 2))
        top = ml[:, :, 0].max(dim=0).values
        weight = torch.exp2(ml[:, :, 0] - torch.where(torch.isinf(top), 0, top))
        total = (weight * ml[:, :, 1]).sum(dim=0)
        merged = (weight[:, :, None] * acc).sum(dim=0)
        o[seq] = normalize(merged, top, total, sinks).to(dtype)


class AbiLauncher:
    """Records every launch and executes it in torch per the ABI."""

    def __init__(self) -> None:
        self.launches: list[KernelLaunch] = []

    def __call__(self, launch: KernelLaunch) -> None:
        self.launches.append(launch)
        if launch.name.startswith("decode_attention_kernel<"):
            run_split_k_attention(launch)
        elif launch.name.startswith("merge_partials_kernel<"):
            run_merge(launch)
        else:
            raise AssertionError(f"unexpected kernel {launch.name}")
