"""KV-cache ops: paged attention and cache maintenance on the paged KV cache.

Each op validates its arguments, then runs the CUDA kernel (``cuda/*.cu`` compiled at
run time through CuPy/NVRTC) when the tensors live on a CUDA device, or the fast CPU
path otherwise (:mod:`kvblocks.ops.cpu_attention`, :mod:`kvblocks.ops.cpu_cache`: fused
torch ops over a per-step plan, tested against the plain torch reference
:mod:`kvblocks.ops.reference`); :func:`swap_blocks` is torch copies on every device.
Importing this module needs torch (``pip install 'kvblocks[torch]'``; without it the
import raises one ImportError saying so) but neither CuPy nor a GPU: CuPy is imported
on the first CUDA call.

Cache layout (per layer, for K and V): ``[num_blocks, num_kv_heads, block_size,
head_size]``, so every (block, head) tile is one contiguous range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvblocks._extras import raise_missing_extra

try:
    import torch
except ModuleNotFoundError as _exc:
    raise_missing_extra(_exc, "kvblocks.ops", "torch", ["torch"])

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import reference
from kvblocks.ops.checks import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    MappingLike,
    as_block_mapping,
    check_block_ids,
    check_block_size,
    check_cache_pair,
    check_copy_pairs_disjoint,
    check_dtype,
    check_head_size,
    check_index_tensor,
    check_optional_positive,
    check_scale,
    check_sinks,
    check_sliding_window,
    check_tokens_like_cache,
)
from kvblocks.ops.cpu_attention import CpuAttentionPlan
from kvblocks.ops.cpu_cache import CpuCacheSlots
from kvblocks.ops.decode_attention import DecodeAttention
from kvblocks.validation import check_bool, check_int, check_optional_int

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "DecodeAttention",
    "allocate_kv_cache",
    "copy_blocks",
    "paged_attention",
    "paged_prefill_attention",
    "precompile",
    "reshape_and_cache",
    "swap_blocks",
]


def precompile(
    archs: Sequence[str] | None = None,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    head_sizes: Sequence[int] | None = None,
) -> int:
    """Compile every CUDA kernel instantiation into the on-disk kernel cache.

    Later processes load the cubins instead of compiling (about 0.25 s per instantiation
    otherwise, on first use). ``archs`` like ``["sm_80", "sm_90"]`` needs no GPU (CI, image
    builds); by default the visible devices' architectures. ``dtypes`` / ``head_sizes``
    restrict the attention kernels. Returns how many kernels were compiled (cached ones
    are skipped). Needs ``cuda-bindings`` and NVRTC; the directory is
    ``$KVBLOCKS_KERNEL_CACHE`` (default ``~/.cache/kvblocks/kernels``).
    """
    from kvblocks.ops import kernel_cache

    return kernel_cache.precompile(archs, dtypes=dtypes, head_sizes=head_sizes)


def _cuda_backend() -> ModuleType:
    # Imported lazily so that CPU-only installs never import CuPy.
    from kvblocks.ops import cuda_backend

    return cuda_backend


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    pin_memory: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate a zeroed paged KV cache for ``num_layers`` layers.

    All layers live in one contiguous tensor ``[num_layers, 2, num_blocks, num_kv_heads,
    block_size, head_size]``; the result is a list of per-layer ``(key_cache,
    value_cache)`` views of it, so :func:`copy_blocks` can reach every layer from one base
    pointer in a single launch. ``pin_memory`` (CPU caches only, needs CUDA) page-locks
    the storage so that :func:`swap_blocks` to and from a GPU is asynchronous DMA.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("num_kv_heads", num_kv_heads),
    ):
        check_int(value, name, minimum=1, expected="a positive int")
    check_block_size(block_size)
    check_head_size(head_size)
    check_dtype(dtype, "the KV cache")
    check_bool(pin_memory, "pin_memory")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"device {device!r} is not a torch device: {exc}") from exc
    if pin_memory and device.type != "cpu":
        raise InvalidArgumentError(f"pin_memory applies to CPU caches, not to {device}")
    shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_size)
    try:
        storage = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    except (RuntimeError, TypeError) as exc:  # out of memory, no CUDA, beyond int64
        raise InvalidArgumentError(
            f"a KV cache of shape {list(shape)} {dtype} cannot be allocated on {device}: {exc}"
        ) from exc
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot, in place.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_size]`` (last dim contiguous);
    ``slot_mapping``: int64 ``[num_tokens]`` with ``slot = block * block_size + offset``,
    ``-1`` skipping the token (padding).
    """
    _, num_kv_heads, _, head_size = check_cache_pair(key_cache, value_cache)
    for name, tensor in (("key", key), ("value", value)):
        check_tokens_like_cache(tensor, name, key_cache)
        if tuple(tensor.shape[1:]) != (num_kv_heads, head_size):
            raise InvalidArgumentError(
                f"{name} has shape {list(tensor.shape)}, expected [num_tokens, "
                f"{num_kv_heads}, {head_size}] to match the cache"
            )
        if tensor.stride(-1) != 1:
            raise InvalidArgumentError(f"{name} must be contiguous in its last dimension")
    if key.shape[0] != value.shape[0]:
        raise InvalidArgumentError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    check_index_tensor(
        slot_mapping, "slot_mapping", (torch.int64,), (key.shape[0],), key_cache.device
    )
    if key_cache.is_cuda:
        _cuda_backend().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        num_blocks, _, block_size, _ = key_cache.shape
        slots = CpuCacheSlots.build(
            slot_mapping, num_blocks=num_blocks, num_kv_heads=num_kv_heads, block_size=block_size
        )
        slots.write(key, value, key_cache, value_cache)


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    _, num_kv_heads, _, head_size = check_cache_pair(key_cache, value_cache)
    check_tokens_like_cache(query, "query", key_cache)
    if query.shape[2] != head_size:
        raise InvalidArgumentError(
            f"query head size {query.shape[2]} differs from the cache head size {head_size}"
        )
    if query.shape[1] < 1 or query.shape[1] % num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads {query.shape[1]} must be a positive multiple of num_kv_heads "
            f"{num_kv_heads} (GQA/MQA)"
        )
    if not query.is_contiguous():
        raise InvalidArgumentError("query must be contiguous")
    check_index_tensor(
        block_tables, "block_tables", (torch.int32,), (num_seqs, None), key_cache.device
    )
    check_index_tensor(seq_lens, "seq_lens", (torch.int32,), (num_seqs,), key_cache.device)
    check_scale(scale)
    check_sliding_window(sliding_window)
    check_optional_positive(soft_cap, "soft_cap")
    check_sinks(sinks, query.shape[1], key_cache.device)


def _check_hint(value: int | None, name: str) -> None:
    check_optional_int(value, name, minimum=0, expected="a non-negative int or None")


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
    max_seq_len: int | None = None,
    seq_lens_host: np.ndarray | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; returns ``[num_seqs, num_heads, head_size]``.

    ``query``: ``[num_seqs, num_heads, head_size]``, one token per sequence at position
    ``seq_len - 1`` (its K/V already in the cache). ``block_tables``: int32
    ``[num_seqs, max_blocks]`` (padding = null block 0); ``seq_lens``: int32 ``[num_seqs]``.
    ``scale`` defaults to ``1/sqrt(head_size)``; key ``j`` is visible to position ``p``
    iff ``p - sliding_window < j <= p``; ``soft_cap`` applies ``cap * tanh(s / cap)``
    after scaling; ``sinks`` (``[num_heads]`` float, on the caches' device) adds
    one learned logit per query head to the softmax denominator, gpt-oss's attention
    sinks (the exact formula is in :mod:`kvblocks.ops.reference`). A sequence with
    ``seq_len == 0`` (batch padding) yields zeros.
    ``max_seq_len`` (optional, CUDA only) is ``max(seq_lens)`` known on the host; giving
    it saves a device sync when planning the split-K launch. It is a planning hint: a
    value below the real maximum (a CUDA graph captured for shorter contexts) is still
    correct, the last split covering the rest of each sequence, only less parallel.

    On CUDA, fp16/bf16 run the tensor-core ``decode_attention_kernel`` through the
    length-aware split planner (:mod:`kvblocks.ops.decode_plan`), which needs the lengths
    on the host: pass them as ``seq_lens_host`` (a NumPy copy of ``seq_lens``, which the
    scheduler has anyway; the plan is then cached across a step's layers and no device
    sync happens), or give neither hint and ``seq_lens`` is read back (a sync). With
    only ``max_seq_len`` the older split-K kernel runs, as for fp32. Engines that want
    CUDA graphs or the least host time per layer use :class:`DecodeAttention` directly.
    """
    _check_hint(max_seq_len, "max_seq_len")
    if seq_lens_host is not None and (
        not isinstance(seq_lens_host, np.ndarray)
        or seq_lens_host.dtype.kind not in "iu"
        or seq_lens_host.shape != (query.shape[0] if isinstance(query, torch.Tensor) else 0,)
    ):
        raise InvalidArgumentError(
            "seq_lens_host must be a 1-D NumPy integer array with one length per sequence"
        )
    _check_attention_args(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query.shape[0] if isinstance(query, torch.Tensor) else 0,
        scale,
        sliding_window,
        soft_cap,
        sinks,
    )
    if key_cache.is_cuda:
        out: torch.Tensor = _cuda_backend().paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            max_seq_len=max_seq_len,
            seq_lens_host=seq_lens_host,
            sinks=sinks,
        )
        return out
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    plan = CpuAttentionPlan.for_decode(
        block_tables,
        seq_lens,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        native_decode=key_cache.dtype == torch.float32,
    )
    return plan.run(
        query,
        key_cache,
        value_cache,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
    )


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
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Varlen causal prefill/extend attention; returns ``[num_tokens, num_heads, head_size]``.

    ``query`` concatenates every sequence's chunk; ``query_start_loc`` (int32
    ``[num_seqs+1]``) delimits them and ``seq_lens`` (int32) is each sequence's context
    length after the chunk. Query ``i`` of a chunk of length ``q_len`` sits at position
    ``seq_len - q_len + i`` and attends causally (and within ``sliding_window``);
    ``scale``, ``soft_cap`` and ``sinks`` as in :func:`paged_attention`.
    Chunks of length 1 (decode) and 0 (idle sequence) are allowed. ``max_query_len``
    (optional, CUDA only) saves a device sync when planning the launch; it is a planning
    hint (the kernel loops over query tiles, so a value below the longest chunk is still
    correct), and with it ``query_start_loc`` is not read on the host: offsets outside
    ``[0, num_tokens]`` are then clamped by the kernel instead of being rejected.
    """
    _check_hint(max_query_len, "max_query_len")
    if not isinstance(seq_lens, torch.Tensor):
        # The batch size is read from seq_lens: name it, not the first tensor it misfits.
        raise InvalidArgumentError(
            f"seq_lens must be a torch.Tensor, got {type(seq_lens).__name__}"
        )
    num_seqs = seq_lens.shape[0]
    _check_attention_args(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        num_seqs,
        scale,
        sliding_window,
        soft_cap,
        sinks,
    )
    check_index_tensor(
        query_start_loc, "query_start_loc", (torch.int32,), (num_seqs + 1,), key_cache.device
    )
    if not key_cache.is_cuda or max_query_len is None:
        starts = query_start_loc.cpu()
        if (
            int(starts[0]) != 0
            or int(starts[-1]) != query.shape[0]
            or bool((starts[1:] < starts[:-1]).any())
        ):
            raise InvalidArgumentError(
                "query_start_loc must be non-decreasing, start at 0 and end at num_tokens "
                f"{query.shape[0]}, got {starts.tolist()}"
            )
        max_query_len = int((starts[1:] - starts[:-1]).max()) if num_seqs else 0
    if key_cache.is_cuda:
        out: torch.Tensor = _cuda_backend().paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            max_query_len=max_query_len,
            sinks=sinks,
        )
        return out
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    plan = CpuAttentionPlan.for_prefill(
        block_tables,
        query_start_loc,
        seq_lens,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        native_decode=key_cache.dtype == torch.float32,
    )
    return plan.run(
        query,
        key_cache,
        value_cache,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
    )


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: MappingLike
) -> None:
    """Copy block ``src`` to block ``dst`` for every ``(src, dst)`` row, in every layer.

    ``kv_caches`` as returned by :func:`allocate_kv_cache`; ``block_mapping`` int64
    ``[n, 2]`` (torch tensor, NumPy array or nested lists). On CUDA this is one launch
    covering all layers, K and V. Block ids are validated on the host. The pairs run in
    parallel: a block that is the destination of one pair must not be the source or the
    destination of another in the same call (the CUDA result would depend on timing), and
    such a mapping raises :class:`~kvblocks.errors.InvalidArgumentError`; a pair may copy
    a block onto itself, and one source may feed several destinations.
    """
    if isinstance(kv_caches, (str, bytes)) or not isinstance(kv_caches, Sequence) or not kv_caches:
        raise InvalidArgumentError(
            "kv_caches must be a list of at least one (key, value) layer, got "
            f"{type(kv_caches).__name__}"
        )
    if not all(isinstance(layer, Sequence) and len(layer) == 2 for layer in kv_caches):
        raise InvalidArgumentError("kv_caches must hold (key_cache, value_cache) pairs")
    shape = check_cache_pair(*kv_caches[0])
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        if check_cache_pair(key_cache, value_cache) != shape or (
            key_cache.dtype != kv_caches[0][0].dtype or key_cache.device != kv_caches[0][0].device
        ):
            raise InvalidArgumentError(
                f"layer {layer} caches differ in shape, dtype or device from layer 0"
            )
    mapping = as_block_mapping(block_mapping)
    check_block_ids(mapping, shape[0], shape[0], "block_mapping")
    if mapping.shape[0] == 0:
        return
    pairs = mapping.numpy()
    check_copy_pairs_disjoint(pairs[:, 0], pairs[:, 1], 1, "block_mapping")
    if kv_caches[0][0].is_cuda:
        _cuda_backend().copy_blocks(kv_caches, mapping)
    else:
        reference.copy_blocks(kv_caches, mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: MappingLike) -> None:
    """Copy blocks ``src[s] -> dst[d]`` for each ``(s, d)`` row, between any two devices.

    ``src``/``dst``: caches ``[num_blocks, ...]`` with equal per-block shape and dtype
    (typically GPU <-> pinned CPU). Contiguous runs of the mapping are merged into single
    copies, asynchronous on the current stream when one side is pinned host memory.

    ``src`` and ``dst`` may be one tensor or views of one storage; then the pairs follow
    :func:`copy_blocks`' rule: a block (its bytes) that one pair writes must not be read
    or written by another pair, nor partly overlap its own source (a block copied onto
    itself is fine), else :class:`~kvblocks.errors.InvalidArgumentError` and nothing is
    copied.
    """
    for name, tensor in (("src", src), ("dst", dst)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise InvalidArgumentError(f"{name} must be a cache tensor [num_blocks, ...]")
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous")
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise InvalidArgumentError(
            f"src {list(src.shape)} {src.dtype} and dst {list(dst.shape)} {dst.dtype} must "
            "have the same per-block shape and dtype"
        )
    mapping = as_block_mapping(block_mapping)
    check_block_ids(mapping, src.shape[0], dst.shape[0], "block_mapping")
    _check_swap_within_storage(src, dst, mapping)
    reference.swap_blocks(src, dst, mapping)


def _check_swap_within_storage(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """Raise if ``src`` and ``dst`` share bytes and the pairs overlap (see :func:`swap_blocks`).

    Compares byte addresses, so views of one storage at any offset are caught; two
    tensors whose bytes are disjoint (the usual GPU <-> host swap) cost two comparisons.
    """
    if mapping.shape[0] == 0 or src.device != dst.device or src.device.type == "meta":
        return
    item = src.element_size()
    src_start, dst_start = src.data_ptr(), dst.data_ptr()
    if src_start + src.numel() * item <= dst_start or dst_start + dst.numel() * item <= src_start:
        return
    width = math.prod(src.shape[1:]) * item
    pairs = mapping.numpy()
    reads = src_start + pairs[:, 0] * width
    writes = dst_start + pairs[:, 1] * width
    check_copy_pairs_disjoint(reads, writes, width, "block_mapping")
