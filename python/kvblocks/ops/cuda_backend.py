"""The CUDA path of the ops: the front-ends' CUDA calls, handed to the driver with a CuPy
launcher and the device's limits.

Imported only when an op receives CUDA tensors, so CPU installs never import CuPy. The
top of the ops' layers: :mod:`kvblocks.ops.kernel_driver` chooses the kernels,
:mod:`kvblocks.ops.cuda_device` compiles and launches them (on torch's current stream,
zero-copy, cached on disk by :mod:`kvblocks.ops.kernel_cache`). Workspaces come from
torch's stream-ordered caching allocator, never from CuPy.
"""

from __future__ import annotations

import numpy as np
import torch

from kvblocks.ops import kernel_driver
from kvblocks.ops.cuda_device import (
    decode_launcher,
    decode_target_ctas,
    device_index,
    smem_optin,
    split_k_target_ctas,
    stream_launcher,
)

__all__ = [
    "copy_blocks",
    "decode_launcher",
    "decode_target_ctas",
    "paged_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "smem_optin",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See :func:`kvblocks.ops.reshape_and_cache` (validated arguments)."""
    kernel_driver.run_reshape_and_cache(
        stream_launcher(key_cache.device), key, value, key_cache, value_cache, slot_mapping
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    max_seq_len: int | None,
    seq_lens_host: np.ndarray | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`kvblocks.ops.paged_attention` (validated arguments): the kernel is
    :func:`kernel_driver.run_paged_attention`'s choice for this device's shared memory."""
    device = key_cache.device
    index = device_index(device)
    return kernel_driver.run_paged_attention(
        decode_launcher(index), query, key_cache, value_cache, block_tables, seq_lens,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, max_seq_len=max_seq_len,
        seq_lens_host=seq_lens_host, split_k_ctas=split_k_target_ctas(device.index or 0),
        smem_limit=smem_optin(index), sinks=sinks,
    )  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    max_query_len: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`kvblocks.ops.paged_prefill_attention` (validated arguments): the kernel
    is :func:`kernel_driver.run_prefill`'s choice (the tensor-core one for fp16/bf16, whose
    shared memory is above 48 KiB at head 64, 96, 128 and 256: the launcher opts in)."""
    device = key_cache.device
    return kernel_driver.run_prefill(
        decode_launcher(device_index(device)), query, key_cache, value_cache, block_tables,
        query_start_loc, seq_lens, scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, max_query_len=max_query_len,
        target_ctas=split_k_target_ctas(device.index or 0), sinks=sinks,
    )  # fmt: skip


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: torch.Tensor
) -> None:
    """See :func:`kvblocks.ops.copy_blocks` (validated, host-side int64 mapping)."""
    kernel_driver.run_copy_blocks(stream_launcher(kv_caches[0][0].device), kv_caches, block_mapping)
