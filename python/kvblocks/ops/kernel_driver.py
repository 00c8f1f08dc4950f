"""The driver: chooses every kernel, plans, allocates outputs, and hands the launches to
a launcher.

The one module that decides which kernel serves a call (:func:`run_paged_attention`: the
planned tensor-core decode or the split-K kernel; :func:`run_prefill`: the tensor-core
prefill or the split-K kernel). It sits above the planners and
:class:`~kvblocks.ops.decode_attention.DecodeAttention` and below the CUDA backend, which
passes a CuPy launcher and the device's limits down; the tests pass the CPU emulation's
launcher on CPU tensors. Everything between the validated front-end call and the launch
(alignment fixes, workspace, split planning, argument packing) is therefore shared.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch

from kvblocks.ops.checks import check_cache_pair
from kvblocks.ops.decode_attention import DecodeAttention, decode_kernel_supported
from kvblocks.ops.launch_plan import (
    PARTITION_TOKENS,
    Launcher,
    copy_blocks_launch,
    plan_split_k,
    reshape_and_cache_launch,
    split_k_launches,
)
from kvblocks.ops.prefill_launch import plan_prefill, prefill_launch

__all__ = [
    "Launcher",
    "decode_attention_for",
    "run_copy_blocks",
    "run_decode",
    "run_paged_attention",
    "run_prefill",
    "run_reshape_and_cache",
    "run_split_k_attention",
]


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if its base address allows 16-byte vector access, else a copy."""
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def _sinks_f32(sinks: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The attention-sink logits as the kernels read them: contiguous fp32 on ``device``
    (the front-ends validated shape and values; None: no sinks, a null pointer)."""
    if sinks is None:
        return None
    return sinks.to(device=device, dtype=torch.float32).contiguous()


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _check_caches(*caches: torch.Tensor) -> None:
    """Refuse caches the kernels cannot address with 16-byte vectors (they are written
    in place, so a copy would not do); the front-ends check this too."""
    for cache in caches:
        check_cache_pair(cache, cache)


def run_reshape_and_cache(
    launch: Launcher,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter K/V rows into the cache (validated arguments)."""
    _check_caches(key_cache, value_cache)
    if key.shape[0] == 0:
        return
    fixed = []
    for tensor in (key, value):
        esize = tensor.element_size()
        if (
            tensor.data_ptr() % 16
            or (tensor.stride(0) * esize) % 16
            or (tensor.stride(1) * esize) % 16
        ):
            tensor = tensor.contiguous() if not tensor.is_contiguous() else tensor.clone()
        fixed.append(tensor)
    launch(reshape_and_cache_launch(fixed[0], fixed[1], key_cache, value_cache, slot_mapping))


def run_split_k_attention(
    launch: Launcher,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    *,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    max_query_len: int,
    max_seq_len: int | None,
    target_ctas: int,
    partition_tokens: int = PARTITION_TOKENS,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode (``query_start_loc is None``) or prefill attention through the split-K
    kernel (``split_k_attention_kernel`` of ``cuda/split_k_attention.cu``): fp32, and fp16/bf16
    decode where :func:`run_paged_attention` cannot plan the tensor-core kernel.

    ``max_query_len`` and ``max_seq_len`` only shape the launch (query tiles, split-K):
    values below the real ones cost parallelism, never correctness (the kernel loops
    over query tiles and its last split covers the rest of a sequence). ``sinks``
    (``[num_heads]``, None: none) join each row's softmax denominator.
    """
    _check_caches(key_cache, value_cache)
    sinks = _sinks_f32(sinks, query.device)
    num_tokens, num_heads, head_size = query.shape
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    query = _aligned(query)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    decode = query_start_loc is None
    if decode and max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    plan = plan_split_k(
        dtype=query.dtype,
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len or 0,
        decode=decode,
        target_ctas=target_ctas,
        partition_tokens=partition_tokens,
    )
    part_out = part_ml = None
    if plan.num_splits > 1:
        rows = num_tokens * num_heads * plan.num_splits
        part_out = torch.empty(rows * head_size, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(rows * 2, dtype=torch.float32, device=query.device)
    launches = split_k_launches(
        plan,
        out=out.data_ptr(),
        part_out=0 if part_out is None else part_out.data_ptr(),
        part_ml=0 if part_ml is None else part_ml.data_ptr(),
        query=query.data_ptr(),
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        block_tables=block_tables.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        query_start_loc=0 if query_start_loc is None else query_start_loc.data_ptr(),
        num_rows=num_tokens * num_heads,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        max_blocks=block_tables.shape[1],
        num_blocks=num_blocks,
        scale=1.0 / math.sqrt(head_size) if scale is None else scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=_address(sinks),
    )
    for item in launches:
        launch(item)
    return out


_DECODERS: OrderedDict[tuple[object, ...], DecodeAttention] = OrderedDict()
_MAX_DECODERS = 16  # (shape, window, batch capacity) combinations kept with their workspaces


def decode_attention_for(
    launch: Launcher,
    *,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_seqs: int,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    target_ctas: int | None,
    smem_limit: int | None = None,
) -> DecodeAttention:
    """The cached :class:`DecodeAttention` serving the functional decode path.

    One per shape, window and launcher, with room for the batch rounded up to a power
    of two (at least 64), so the layers of a step share it and its plan.
    """
    capacity = max(64, 1 << max(0, num_seqs - 1).bit_length())
    key = (launch, device, dtype, num_heads, num_kv_heads, head_size, block_size, capacity,
           scale, sliding_window, soft_cap, target_ctas, smem_limit)  # fmt: skip
    decoder = _DECODERS.get(key)
    if decoder is None:
        decoder = DecodeAttention(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            block_size=block_size, dtype=dtype, device=device, max_seqs=capacity,
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            target_ctas=target_ctas, smem_limit=smem_limit, launcher=launch,
        )  # fmt: skip
        _DECODERS[key] = decoder
        if len(_DECODERS) > _MAX_DECODERS:
            _DECODERS.popitem(last=False)
    return decoder


def run_decode(
    launch: Launcher,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_host: np.ndarray,
    *,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    target_ctas: int | None,
    smem_limit: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp16/bf16 decode through ``decode_attention_kernel`` and the length-aware plan
    (validated front-end arguments; ``seq_lens_host`` = the device ``seq_lens``;
    ``target_ctas`` and ``smem_limit`` None: from the device, see
    :class:`DecodeAttention`; ``sinks`` as in :meth:`DecodeAttention.run`, any float
    dtype)."""
    _, num_kv_heads, block_size, head_size = key_cache.shape
    decoder = decode_attention_for(
        launch, device=key_cache.device, dtype=query.dtype, num_heads=query.shape[1],
        num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
        num_seqs=query.shape[0], scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, target_ctas=target_ctas, smem_limit=smem_limit,
    )  # fmt: skip
    decoder.plan(seq_lens_host, block_tables)
    return decoder.run(query, key_cache, value_cache, sinks=_sinks_f32(sinks, query.device))


def run_paged_attention(
    launch: Launcher,
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
    seq_lens_host: np.ndarray | None,
    split_k_ctas: int,
    smem_limit: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (validated arguments), the kernel chosen here: fp16/bf16 run
    ``decode_attention_kernel`` through the length-aware planner when a variant fits
    ``smem_limit`` and the lengths are known on the host (``seq_lens_host``, or read from
    the device when no ``max_seq_len`` hint says to avoid that sync); otherwise the
    split-K kernel on ``split_k_ctas`` CTAs (:func:`run_split_k_attention`)."""
    _, _, block_size, head_size = key_cache.shape
    if decode_kernel_supported(query.dtype, head_size, block_size, smem_limit) and (
        seq_lens_host is not None or max_seq_len is None
    ):
        if seq_lens_host is None:
            seq_lens_host = seq_lens.cpu().numpy()
        return run_decode(
            launch, query, key_cache, value_cache, block_tables, seq_lens_host, scale=scale,
            sliding_window=sliding_window, soft_cap=soft_cap, target_ctas=None,
            smem_limit=smem_limit, sinks=sinks,
        )  # fmt: skip
    return run_split_k_attention(
        launch, query, key_cache, value_cache, block_tables, seq_lens, None, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, max_query_len=1,
        max_seq_len=max_seq_len, target_ctas=split_k_ctas, sinks=sinks,
    )  # fmt: skip


def run_prefill(
    launch: Launcher,
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
    target_ctas: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill/extend attention (validated arguments), the kernel chosen here: the
    tensor-core kernel for fp16/bf16 (:mod:`kvblocks.ops.prefill_launch`), the split-K
    kernel for fp32 (:func:`run_split_k_attention`; ``target_ctas`` is its). ``sinks``
    (``[num_heads]``, None: none) join each row's softmax denominator."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        return run_split_k_attention(
            launch, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            max_query_len=max_query_len, max_seq_len=None, target_ctas=target_ctas,
            sinks=sinks,
        )  # fmt: skip
    _check_caches(key_cache, value_cache)
    num_tokens, num_heads, head_size = query.shape
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    query = _aligned(query)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    sinks = _sinks_f32(sinks, query.device)
    plan = plan_prefill(
        dtype=query.dtype,
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        sinks=sinks is not None,
    )
    launch(
        prefill_launch(
            plan,
            out=out.data_ptr(),
            query=query.data_ptr(),
            key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(),
            block_tables=block_tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            query_start_loc=query_start_loc.data_ptr(),
            num_tokens=num_tokens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            max_blocks=block_tables.shape[1],
            num_blocks=num_blocks,
            scale=1.0 / math.sqrt(head_size) if scale is None else scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            sinks=_address(sinks),
        )
    )
    return out


def run_copy_blocks(
    launch: Launcher,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    mapping: torch.Tensor,
) -> None:
    """Copy blocks in every cache; one launch when the caches are evenly spaced."""
    caches = [cache for pair in kv_caches for cache in pair]
    _check_caches(*caches)
    device_mapping = mapping.to(caches[0].device).contiguous()
    num_blocks = caches[0].shape[0]
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    base = caches[0].data_ptr()
    stride = caches[1].data_ptr() - base
    if all(c.data_ptr() == base + i * stride for i, c in enumerate(caches)):
        groups = [(base, len(caches))]
    else:  # caches not from allocate_kv_cache: one launch per cache, still correct
        groups = [(c.data_ptr(), 1) for c in caches]
    for start, count in groups:
        launch(
            copy_blocks_launch(
                start, device_mapping.data_ptr(), mapping.shape[0], count, stride,
                block_bytes, num_blocks,
            )
        )  # fmt: skip
