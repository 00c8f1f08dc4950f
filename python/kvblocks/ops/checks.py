"""Argument validation shared by the CUDA path and the torch reference.

Every public op checks shapes, dtypes, devices and contiguity here *before* touching
memory, so a bad call raises :class:`~kvblocks.errors.InvalidArgumentError` with a
message naming what was expected, and no kernel is ever launched on a bad layout.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import INT32_MAX as INT32_MAX  # re-exported: the ops read it here
from kvblocks.validation import check_int

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "as_block_mapping",
    "check_block_ids",
    "check_block_size",
    "check_cache_pair",
    "check_copy_pairs_disjoint",
    "check_dtype",
    "check_head_size",
    "check_index_tensor",
    "check_ints",
    "check_optional_positive",
    "check_scale",
    "check_sinks",
    "check_sliding_window",
    "check_tokens_like_cache",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""Element types of queries and caches (accumulation is always fp32)."""
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 112, 128, 256)
"""Head sizes the kernels are instantiated for."""
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
"""Tokens per KV block."""

MappingLike = torch.Tensor | np.ndarray | Sequence[Sequence[int]]


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise unless ``dtype`` is one of :data:`SUPPORTED_DTYPES` (a torch.dtype: an
    array cannot be compared)."""
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise InvalidArgumentError(f"{what} has dtype {dtype}; supported dtypes are {names}")


def check_head_size(head_size: int) -> None:
    """Raise unless ``head_size`` is one of :data:`SUPPORTED_HEAD_SIZES` (an int: 64.0
    compares equal to 64 but is no size, and an array cannot be compared)."""
    if (
        isinstance(head_size, bool)
        or not isinstance(head_size, numbers.Integral)
        or (head_size not in SUPPORTED_HEAD_SIZES)
    ):
        raise InvalidArgumentError(
            f"head_size {head_size} is not supported; supported head sizes are "
            f"{list(SUPPORTED_HEAD_SIZES)}"
        )


def check_block_size(block_size: int) -> None:
    """Raise unless ``block_size`` is one of :data:`SUPPORTED_BLOCK_SIZES` (an int, as
    :func:`check_head_size`)."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, numbers.Integral)
        or (block_size not in SUPPORTED_BLOCK_SIZES)
    ):
        raise InvalidArgumentError(
            f"block_size {block_size} is not supported; supported block sizes are "
            f"{list(SUPPORTED_BLOCK_SIZES)}"
        )


def _is_finite_positive(value: object) -> bool:
    # A bool is not a number here, and a str or None must not reach the comparison.
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value) > 0
    )


def check_ints(*, minimum: int, **values: object) -> None:
    """Raise unless each value is an int in ``[minimum, 2^31)``: the kernels and plans
    hold sizes and lengths as int32 (a bool is not an int here)."""
    for name, value in values.items():
        check_int(
            value, name, minimum=minimum, maximum=INT32_MAX, expected=f"an int in [{minimum}, 2^31)"
        )


def check_optional_positive(value: float | int | None, what: str) -> None:
    """Raise if ``value`` is given and not a finite, strictly positive number."""
    if value is not None and not _is_finite_positive(value):
        raise InvalidArgumentError(f"{what} must be a finite number > 0 or None, got {value!r}")


def check_scale(scale: float | None) -> None:
    """Raise unless ``scale`` is None or a finite positive number (a bool is not one)."""
    if scale is not None and not _is_finite_positive(scale):
        raise InvalidArgumentError(f"scale must be a finite positive float, got {scale!r}")


def check_sliding_window(sliding_window: int | None) -> None:
    """Raise unless ``sliding_window`` is None or an int in ``[1, 2^31)`` (a bool is not one).

    The kernels take the window as an int32.
    """
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or not 1 <= sliding_window <= INT32_MAX
    ):
        raise InvalidArgumentError(
            f"sliding_window must be a positive int below 2^31 or None, got {sliding_window!r}"
        )


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """Validate one layer's caches and return ``(num_blocks, num_kv_heads, block_size, head)``.

    Both must be 4-D ``[num_blocks, num_kv_heads, block_size, head_size]``, same shape,
    dtype and device, contiguous (each (block, head) tile is one range) and 16-byte
    aligned (the kernels move 16-byte vectors; every device is checked alike).
    """
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() != 4:
            raise InvalidArgumentError(
                f"{name} must be 4-D [num_blocks, num_kv_heads, block_size, head_size], "
                f"got shape {tuple(cache.shape)}"
            )
        if not cache.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous (HND block layout)")
        # Every kernel access is a 16-byte vector; a misaligned one is a sticky CUDA error
        # that kills the context. Caches are written in place, so they cannot be copied.
        if cache.data_ptr() % 16:
            raise InvalidArgumentError(
                f"{name} must start at a 16-byte aligned address (got an offset of "
                f"{cache.data_ptr() % 16} bytes): allocate it with allocate_kv_cache or "
                "torch.empty, not as a view at an odd element offset"
            )
    if key_cache.shape != value_cache.shape:
        raise InvalidArgumentError(
            f"key_cache {tuple(key_cache.shape)} and value_cache "
            f"{tuple(value_cache.shape)} must have the same shape"
        )
    if key_cache.dtype != value_cache.dtype:
        raise InvalidArgumentError(
            f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) "
            "must have the same dtype"
        )
    if key_cache.device != value_cache.device:
        raise InvalidArgumentError("key_cache and value_cache must be on the same device")
    check_dtype(key_cache.dtype, "key_cache")
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    check_block_size(block_size)
    check_head_size(head_size)
    if num_blocks < 1 or num_kv_heads < 1:
        raise InvalidArgumentError(
            f"caches need at least one block and one KV head, got shape {tuple(key_cache.shape)}"
        )
    return tuple(key_cache.shape)


def check_tokens_like_cache(tensor: torch.Tensor, name: str, cache: torch.Tensor) -> None:
    """Raise unless ``tensor`` is a 3-D token tensor with the cache's dtype and device.

    The per-op head and contiguity requirements are checked by the caller.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
        raise InvalidArgumentError(f"{name} must be a 3-D tensor [num_tokens, heads, head_size]")
    if tensor.dtype != cache.dtype:
        raise InvalidArgumentError(
            f"{name} dtype {tensor.dtype} differs from the cache dtype {cache.dtype}"
        )
    if tensor.device != cache.device:
        raise InvalidArgumentError(f"{name} is on {tensor.device}, the cache on {cache.device}")


def check_index_tensor(
    tensor: torch.Tensor,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device,
) -> None:
    """Check an integer index tensor's dtype, rank/shape (``None`` = any) and device."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InvalidArgumentError(f"{name} must have dtype {allowed}, got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidArgumentError(f"{name} must have shape {want_s}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise InvalidArgumentError(f"{name} is on {tensor.device}, expected {device}")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous")


def as_block_mapping(block_mapping: MappingLike, name: str = "block_mapping") -> torch.Tensor:
    """Return ``block_mapping`` as a CPU int64 tensor of shape ``[n, 2]``.

    Accepts a torch tensor (any device; a CUDA tensor is copied to the host because
    block ids are validated there), a NumPy array or nested sequences.
    """
    if isinstance(block_mapping, torch.Tensor):
        if block_mapping.device.type == "meta":
            raise InvalidArgumentError(f"{name} must hold data, got a meta tensor")
        mapping = block_mapping.detach().to("cpu")
    else:
        try:
            mapping = torch.from_numpy(np.ascontiguousarray(np.asarray(block_mapping)))
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{name} must be an integer array [n, 2]: {exc}") from exc
    if mapping.numel() == 0:
        return torch.empty((0, 2), dtype=torch.int64)
    if mapping.dtype.is_floating_point or mapping.dtype.is_complex or mapping.dtype == torch.bool:
        raise InvalidArgumentError(f"{name} must hold integers, got dtype {mapping.dtype}")
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise InvalidArgumentError(
            f"{name} must have shape [n, 2] (src, dst), got {list(mapping.shape)}"
        )
    return mapping.to(torch.int64).contiguous()


def check_block_ids(mapping: torch.Tensor, num_src: int, num_dst: int, name: str) -> None:
    """Raise unless every src id is in ``[0, num_src)`` and every dst id in ``[0, num_dst)``."""
    if mapping.numel() == 0:
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    if int(src.min()) < 0 or int(src.max()) >= num_src:
        raise InvalidArgumentError(
            f"{name} source block ids must be in [0, {num_src}), got range "
            f"[{int(src.min())}, {int(src.max())}]"
        )
    if int(dst.min()) < 0 or int(dst.max()) >= num_dst:
        raise InvalidArgumentError(
            f"{name} destination block ids must be in [0, {num_dst}), got range "
            f"[{int(dst.min())}, {int(dst.max())}]"
        )


def check_copy_pairs_disjoint(
    reads: np.ndarray, writes: np.ndarray, width: int, name: str, first_pair: int = 0
) -> None:
    """Raise unless the copies ``reads[i] -> writes[i]`` (start positions of ``width``-wide
    ranges in one memory) may run in parallel: no pair writes a range another pair reads
    or writes, and none overlaps its own source but exactly (a block copied onto itself).

    ``copy_blocks``' rule, also :func:`kvblocks.ops.swap_blocks`' when ``src`` and
    ``dst`` share memory (there its merged runs are single copies torch refuses to make
    overlap, and pairwise order would silently decide the result).
    """
    if len(writes) == 0 or width <= 0:
        return
    order = np.argsort(reads, kind="stable")
    sorted_reads = reads[order]
    # Reads r with |r - w| < width overlap the write at w; the pair's own exact read not.
    lo = np.searchsorted(sorted_reads, writes - width, side="right")
    hi = np.searchsorted(sorted_reads, writes + width, side="left")
    hits = (hi - lo) - (reads == writes)
    unique_writes, counts = np.unique(writes, return_counts=True)
    bad = np.flatnonzero((hits > 0) | np.isin(writes, unique_writes[counts > 1]))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"{name} pair {first_pair + i} writes a block that another pair reads or writes "
            "(or that overlaps its own source): the pairs run in parallel, so as in "
            "copy_blocks a block that is the destination of one pair must not be the source "
            "or the destination of another; split the mapping into calls"
        )


_FINITE_SINKS: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
"""Device sink tensors already checked finite: id -> (the tensor, its version then)."""


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Raise unless ``sinks`` is None or a finite float tensor ``[num_heads]`` on ``device``.

    One attention-sink logit per query head (see :mod:`kvblocks.ops.reference`). Reading
    the values of a GPU tensor waits for the device, so a tensor found finite is
    remembered until torch writes to it (its version counter moves) or it dies: a layer's
    sink weights are checked once, not on every call.
    """
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise InvalidArgumentError(
            f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point() or sinks.dtype not in (*SUPPORTED_DTYPES, torch.float64):
        raise InvalidArgumentError(f"sinks must be a float tensor, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (num_heads,):
        raise InvalidArgumentError(
            f"sinks has shape {list(sinks.shape)}, expected [{num_heads}] (one logit per "
            "query head)"
        )
    if sinks.device != device:
        raise InvalidArgumentError(f"sinks is on {sinks.device}, expected {device}")
    version = _version(sinks)
    known = _FINITE_SINKS.get(id(sinks))
    if known is not None and known[0]() is sinks and version is not None and known[1] == version:
        return
    # Every kernel and the reference add the sinks in float32: a float64 sink past its
    # range would become inf there and turn the output into NaN.
    if not bool(torch.isfinite(sinks.to(torch.float32)).all()):
        raise InvalidArgumentError("sinks must be finite (in float32, what the kernels compute in)")
    if sinks.device.type != "cpu" and version is not None:
        if len(_FINITE_SINKS) >= 4096:  # callers cycling through fresh tensors
            _FINITE_SINKS.clear()
        _FINITE_SINKS[id(sinks)] = (weakref.ref(sinks), version)


def _version(tensor: torch.Tensor) -> int | None:
    """torch's write counter of ``tensor``; None for an inference-mode tensor (untracked:
    such sinks are checked on every call)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None
