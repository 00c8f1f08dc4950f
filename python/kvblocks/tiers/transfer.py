"""Moving blocks between a paged KV cache and tier payloads (torch index copies).

A cache is :mod:`kvblocks.ops`' per-layer list ``[(key_cache, value_cache), ...]``, each
``[num_blocks, num_kv_heads, block_size, head_size]``. A payload is the block's tiles in
the order ``layer 0 K, layer 0 V, layer 1 K, ...`` (:class:`~kvblocks.tiers.layout.KVLayout`),
as ``payload_nbytes`` uint8 values. Gathers and scatters take many blocks at once: one
index copy per layer and K/V, never a per-block or per-token Python loop.

:func:`offload_blocks` / :func:`load_blocks` apply the core's slot-addressed host-tier ops
(``"offload"`` rows ``(gpu block, tier slot)``, ``"load"`` rows ``(tier slot, gpu block)``
from ``KVCacheManager.take_memory_ops``) to a pool from :func:`allocate_host_pool`, where the
core, not a :class:`~kvblocks.tiers.host.HostTier`, owns the slot map.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers.layout import KVLayout
from kvblocks.validation import check_bool, check_int, check_int_array

__all__ = [
    "allocate_host_pool",
    "gather_blocks",
    "load_blocks",
    "offload_blocks",
    "scatter_blocks",
]

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _check_layout(layout: object) -> None:
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")


def _check_caches(layout: KVLayout, kv_caches: KVCaches) -> torch.device:
    _check_layout(layout)
    if not isinstance(kv_caches, Sequence) or len(kv_caches) != layout.num_layers:
        got = len(kv_caches) if isinstance(kv_caches, Sequence) else type(kv_caches).__name__
        raise InvalidArgumentError(
            f"kv_caches must be a list of {layout.num_layers} (key_cache, value_cache) "
            f"pairs (the layout's layers), got {got}"
        )
    device: torch.device | None = None
    for pair in kv_caches:
        try:
            key, value = pair
        except (TypeError, ValueError):
            raise InvalidTypeError(
                f"kv_caches must hold (key, value) pairs, got {type(pair).__name__}"
            ) from None
        for cache in (key, value):
            if not isinstance(cache, torch.Tensor):
                raise InvalidTypeError(
                    f"a cache must be a torch.Tensor, got {type(cache).__name__}"
                )
            if tuple(cache.shape[1:]) != layout.tile_shape or cache.dtype != layout.dtype:
                raise InvalidArgumentError(
                    f"a cache of shape {tuple(cache.shape)} {cache.dtype} does not match the "
                    f"layout's [*, {', '.join(map(str, layout.tile_shape))}] {layout.dtype}"
                )
            if device is None:
                device = cache.device
            elif cache.device != device:
                raise InvalidArgumentError("every cache must be on one device")
    assert device is not None  # the layout has at least one layer
    return device


def _block_index(
    block_ids: Sequence[int] | torch.Tensor,
    num_blocks: int,
    device: torch.device,
    *,
    distinct: bool = False,
) -> torch.Tensor:
    ids = _as_ints(block_ids, "block ids").reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidArgumentError(f"block ids must lie in [0, {num_blocks})")
    if distinct:
        _check_distinct(ids.cpu(), "destination block")
    return ids.to(device, non_blocking=True)


def _check_distinct(ids: torch.Tensor, what: str) -> None:
    """Raise unless the CPU ``ids`` are distinct: one index copy writes every row at once
    and on CUDA two rows with one destination race (either may win), the rule
    :func:`kvblocks.ops.copy_blocks` enforces."""
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        values, counts = torch.unique(ids, return_counts=True)
        twice = values[counts > 1].tolist()
        raise InvalidArgumentError(
            f"a {what} is named twice ({twice[:8]}): the rows are written at once, so which "
            "one would win is undefined on CUDA; split them into runs"
        )


def _as_ints(values: object, name: str) -> torch.Tensor:
    """``values`` (a tensor, an array or nested lists of ints) as a CPU int64 tensor.

    ``torch.as_tensor(values, dtype=torch.long)`` would truncate floats and take bools as
    0 and 1, silently; a NumPy view with negative strides would be refused.
    """
    if isinstance(values, torch.Tensor):
        if values.numel() and (
            values.is_floating_point() or values.is_complex() or values.dtype == torch.bool
        ):
            raise InvalidArgumentError(f"{name} must be integers, got dtype {values.dtype}")
        return values.long()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be an integer array: {exc}") from exc
    check_int_array(array, name, minimum=-(2**63), maximum=2**63 - 1)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))


def gather_blocks(
    layout: KVLayout,
    kv_caches: KVCaches,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The payloads of ``block_ids`` as a uint8 ``[len(block_ids), payload_nbytes]`` tensor.

    With ``out`` (e.g. rows of a pinned host pool, or a pinned staging buffer) the payloads
    are copied there, asynchronously when the caches are on CUDA and ``out`` is pinned: the
    caller synchronizes before reading ``out`` or overwriting the source blocks.
    Otherwise the result lives on the caches' device.
    """
    device = _check_caches(layout, kv_caches)
    ids = _block_index(block_ids, kv_caches[0][0].shape[0], device)
    n = ids.numel()
    tiles = []
    for key, value in kv_caches:
        for cache in (key, value):
            # An explicit width: reshape(0, -1) cannot infer it for an empty selection.
            tile = cache.index_select(0, ids).reshape(n, cache[0].numel())
            tiles.append(tile.view(torch.uint8))
    payloads = torch.cat(tiles, dim=1) if tiles else torch.empty((n, 0), dtype=torch.uint8)
    if out is None:
        return payloads
    if tuple(out.shape) != (n, layout.payload_nbytes) or out.dtype != torch.uint8:
        raise InvalidArgumentError(
            f"out must be uint8 [{n}, {layout.payload_nbytes}], got {out.dtype} {tuple(out.shape)}"
        )
    out.copy_(payloads, non_blocking=out.is_pinned())
    return out


def scatter_blocks(
    layout: KVLayout,
    payloads: torch.Tensor | Sequence[torch.Tensor],
    kv_caches: KVCaches,
    block_ids: Sequence[int] | torch.Tensor,
) -> None:
    """Write ``payloads`` (one row per block) into ``block_ids`` of every layer's K and V.

    ``payloads`` is a uint8 ``[n, payload_nbytes]`` tensor or a list of ``n`` flat ones
    (what :meth:`~kvblocks.tiers.store.TierStore.get_many` returns). A CPU source is copied
    to the caches' device with ``non_blocking`` (asynchronous when it is pinned), so the
    caller keeps the source alive and unmodified until the stream has consumed it.
    """
    device = _check_caches(layout, kv_caches)
    if not isinstance(payloads, torch.Tensor):
        rows = list(payloads)
        if any(not isinstance(r, torch.Tensor) for r in rows):
            raise InvalidTypeError("payloads must be tensors (a None from get_many is a miss)")
        payloads = (
            torch.stack([r.reshape(-1) for r in rows])
            if rows
            else torch.empty((0, layout.payload_nbytes), dtype=torch.uint8)
        )
    ids = _block_index(block_ids, kv_caches[0][0].shape[0], device, distinct=True)
    n = ids.numel()
    if tuple(payloads.shape) != (n, layout.payload_nbytes) or payloads.dtype != torch.uint8:
        raise InvalidArgumentError(
            f"payloads must be uint8 [{n}, {layout.payload_nbytes}], got {payloads.dtype} "
            f"{tuple(payloads.shape)}"
        )
    if n == 0:
        return
    source = payloads.to(device, non_blocking=True)
    tile = layout.tile_nbytes
    shape = (n, *layout.tile_shape)
    column = 0
    for key, value in kv_caches:
        for cache in (key, value):
            piece = source[:, column : column + tile].contiguous().view(layout.dtype)
            cache.index_copy_(0, ids, piece.view(shape))
            column += tile


def allocate_host_pool(
    layout: KVLayout, num_slots: int, *, pin_memory: bool | None = None
) -> torch.Tensor:
    """A zeroed uint8 ``[num_slots, payload_nbytes]`` CPU pool for slot-addressed tier ops
    (page-locked by default when CUDA is available)."""
    _check_layout(layout)
    num_slots = check_int(num_slots, "num_slots", minimum=1, expected="a positive int")
    return allocate_pool(num_slots, layout.payload_nbytes, pin_memory, zeroed=True)


def allocate_pool(
    num_slots: int, row_nbytes: int, pin_memory: object, *, zeroed: bool
) -> torch.Tensor:
    """A uint8 ``[num_slots, row_nbytes]`` CPU pool (page-locked when ``pin_memory``, or
    by default when CUDA is available); a pool the machine cannot allocate is an
    :class:`InvalidArgumentError`, not torch's RuntimeError."""
    if pin_memory is not None:
        check_bool(pin_memory, "pin_memory")
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    make = torch.zeros if zeroed else torch.empty
    try:
        return make((num_slots, row_nbytes), dtype=torch.uint8, pin_memory=pin)
    except (RuntimeError, TypeError) as exc:  # out of memory; a size beyond int64
        raise InvalidArgumentError(
            f"a pool of {num_slots} slots of {row_nbytes} bytes cannot be allocated: {exc}"
        ) from exc


def _check_pool_rows(layout: KVLayout, pool: torch.Tensor, rows: object) -> torch.Tensor:
    _check_layout(layout)
    if not isinstance(pool, torch.Tensor):
        raise InvalidTypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() != 2 or pool.shape[1] != layout.payload_nbytes or pool.dtype != torch.uint8:
        raise InvalidArgumentError(
            f"a pool must be uint8 [slots, {layout.payload_nbytes}], got {pool.dtype} "
            f"{tuple(pool.shape)}"
        )
    if pool.device.type != "cpu":
        raise InvalidArgumentError(f"a host pool lives on the CPU, not on {pool.device}")
    pairs = _as_ints(rows, "rows")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise InvalidArgumentError(f"rows must be an int [n, 2] array, got {tuple(pairs.shape)}")
    return pairs


def _slot_index(slots: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= pool.shape[0]):
        raise InvalidArgumentError(f"tier slots must lie in [0, {pool.shape[0]})")
    return slots.contiguous()


def offload_blocks(layout: KVLayout, kv_caches: KVCaches, pool: torch.Tensor, rows: object) -> None:
    """Apply an ``"offload"`` run: copy GPU block ``rows[i, 0]`` into pool slot ``rows[i, 1]``.

    Returns once the pool holds the bytes (the device-to-host copy is synchronous), so the
    GPU blocks may be reused and the slots read right after.
    """
    pairs = _check_pool_rows(layout, pool, rows)
    slots = _slot_index(pairs[:, 1], pool)
    _check_distinct(slots, "destination tier slot")
    payloads = gather_blocks(layout, kv_caches, pairs[:, 0])
    pool.index_copy_(0, slots, payloads.cpu())


def load_blocks(layout: KVLayout, pool: torch.Tensor, kv_caches: KVCaches, rows: object) -> None:
    """Apply a ``"load"`` run: copy pool slot ``rows[i, 0]`` into GPU block ``rows[i, 1]``.

    The slots are gathered into a staging tensor first, so the pool slots may be reused
    (``confirm_memory_ops``) as soon as this returns; the copy into the GPU blocks is
    ordered on the current stream before any later kernel that reads them.
    """
    pairs = _check_pool_rows(layout, pool, rows)
    slots = _slot_index(pairs[:, 0], pool)
    scatter_blocks(layout, pool.index_select(0, slots), kv_caches, pairs[:, 1])
