"""Where the CUDA sources live and which kernel instantiations the ops launch.

The ``.cu`` files are read at run time and compiled by NVRTC (through CuPy, or
directly in the compile tests). From a repository checkout they are in ``cuda/`` at
the root. ``kvblocks/ops/_cuda/`` holds one file symlink per source into ``cuda/``;
maturin copies symlinked *files* (not directories) into wheels as regular files, so
an installed wheel finds the sources there.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from kvblocks.errors import InvalidArgumentError, KVBlocksError
from kvblocks.ops.checks import SUPPORTED_HEAD_SIZES


class CudaSourcesNotFoundError(KVBlocksError, FileNotFoundError):
    """The ``.cu`` sources are in neither the checkout nor the installed wheel (a broken
    install)."""


__all__ = [
    "CACHE_OPS_SOURCE",
    "CTYPE_NAMES",
    "DECODE_BLOCK_SIZES",
    "DECODE_GROUPS",
    "DECODE_ROWS",
    "DECODE_SOURCE",
    "DECODE_STAGES",
    "DECODE_THREADS",
    "MIN_SMEM_OPTIN",
    "PREFILL_ROWS",
    "PREFILL_SOURCE",
    "SPLIT_K_SOURCE",
    "CudaSourcesNotFoundError",
    "cuda_dir",
    "cuda_include_dirs",
    "decode_instantiated",
    "decode_kernel_name",
    "decode_smem_bytes",
    "decode_stages_instantiated",
    "kernel_names",
    "merge_kernel_name",
    "merge_partials_name",
    "nvrtc_options",
    "prefill_kernel_name",
    "read_source",
    "split_k_kernel_name",
]

SPLIT_K_SOURCE = "split_k_attention.cu"
"""The split-K kernel (CUDA cores, every dtype): fp32 attention, and fp16/bf16 decode where
the tensor-core decode cannot be planned (lengths not on the host)."""
CACHE_OPS_SOURCE = "cache_ops.cu"
PREFILL_SOURCE = "prefill_attention.cu"
"""The tensor-core prefill/extend kernel (fp16/bf16; fp32 prefill uses SPLIT_K_SOURCE)."""
DECODE_SOURCE = "decode_attention.cu"
"""The tensor-core decode kernel and its partial merge (fp16/bf16; fp32 uses SPLIT_K_SOURCE)."""
DECODE_THREADS = 128
"""Threads per CTA of ``decode_attention_kernel`` and ``merge_partials_kernel``
(``kvb::kDecodeThreads``)."""
DECODE_GROUPS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""``GROUP`` values of ``decode_attention_kernel`` (query heads per CTA); 16 is not
instantiated at head size 256 (see :func:`decode_instantiated`)."""
DECODE_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
"""``BLOCK`` values of ``decode_attention_kernel`` (cache block sizes)."""
DECODE_STAGES: tuple[int, ...] = (2, 1)
"""``STAGES`` values of ``decode_attention_kernel`` in order of preference: 2 K/V buffers
per warp (keys and values in flight together), 1 (one shared buffer, for GPUs whose per-CTA
shared-memory limit is below the 2-buffer need)."""
MIN_SMEM_OPTIN = 101376
"""The smallest per-CTA dynamic shared-memory opt-in limit (``sharedMemPerBlockOptin``) of
the architectures the kernels target: 99 KiB on sm_86/sm_89 (A10, L4, L40S, RTX 3090/4090);
sm_80 allows 163 KiB, sm_90 227 KiB."""
DECODE_ROWS = 8
"""Query rows per CTA of the decode instantiation (heads of one KV group)."""
PREFILL_ROWS = 16
"""Query rows per CTA of the prefill instantiation (queries x heads)."""

CTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
}
"""The CUDA C type of each supported torch dtype."""


@functools.cache
def cuda_dir() -> Path:
    """The directory holding the ``.cu`` sources (checkout first, then the wheel copy)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[2] / "cuda", here / "_cuda"):
        if (candidate / SPLIT_K_SOURCE).is_file():
            return candidate
    raise CudaSourcesNotFoundError(
        f"kvblocks CUDA sources not found in {here.parents[2] / 'cuda'} or "
        f"{here / '_cuda'}; reinstall kvblocks"
    )


def read_source(name: str) -> str:
    """The text of one ``.cu`` file from :func:`cuda_dir`."""
    return (cuda_dir() / name).read_text()


def cuda_include_dirs() -> list[Path]:
    """Include dirs with ``cuda_fp16.h`` or ``crt/mma.h`` from installed NVIDIA wheels.

    Found through the installed packages (``nvidia.cu13``, ``nvidia.cuda_runtime``,
    ``nvidia.cuda_nvrtc``; ``crt/mma.h``, which ``<mma.h>`` includes, comes from
    ``nvidia-cuda-crt`` on CUDA 13, into ``nvidia/cu13/include``, and from
    ``nvidia-cuda-nvcc-cu12`` on CUDA 12), never hard-coded paths. The sources' own dir
    comes first; the list may hold only it.
    """
    dirs = [cuda_dir()]
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        for sub in ("cu13/include", "cuda_runtime/include", "cuda_nvrtc/include", "cu12/include"):
            # A dir counts when it holds either header: nvidia-cuda-crt installed into another
            # site dir than the runtime wheel (pip --target, a venv over a system install)
            # gives a cu13/include with crt/ alone, which <mma.h> still needs.
            if any((root / sub / header).is_file() for header in _HEADERS):
                dirs.append(root / sub)
        if (root / "cuda_nvcc/include/crt/mma.h").is_file():
            dirs.append(root / "cuda_nvcc/include")
    return dirs


#: The headers an include dir is searched for: the fp16/bf16 types and the WMMA internals.
_HEADERS = ("cuda_fp16.h", "crt/mma.h")


def nvrtc_options(arch: str | None = None, cuda_major: int | None = None) -> list[str]:
    """NVRTC options shared by the CUDA backend and the compile tests.

    ``arch`` like ``sm_90`` (cubin) or ``compute_90`` (PTX). With ``cuda_major``, only
    the wheel headers of that CUDA major version are used (they must match NVRTC's).
    """
    dirs = cuda_include_dirs()
    if cuda_major is not None:
        dirs = [
            d for d in dirs if d == cuda_dir() or d.parent.name == f"cu{cuda_major}"
            or (cuda_major == 12 and d.parent.name in ("cuda_runtime", "cuda_nvrtc"))
        ]  # fmt: skip
    # No --use_fast_math: approximate tanhf would cost soft-capped fp32 its 1e-5 accuracy,
    # and the kernels are bound by memory, not by the exp/tanh throughput.
    opts = ["-std=c++17", *[f"-I{d}" for d in dirs]]
    if arch is not None:
        opts.append(f"-arch={arch}")
    return opts


def split_k_kernel_name(dtype: torch.dtype, head_size: int, rows: int) -> str:
    """Name expression of the split-K attention kernel instantiation (``rows``:
    :data:`DECODE_ROWS` or :data:`PREFILL_ROWS`)."""
    return f"split_k_attention_kernel<{CTYPE_NAMES[dtype]}, {head_size}, {rows}>"


def merge_kernel_name(dtype: torch.dtype, head_size: int) -> str:
    """Name expression of the split-merge kernel instantiation."""
    return f"merge_splits_kernel<{CTYPE_NAMES[dtype]}, {head_size}>"


def prefill_kernel_name(dtype: torch.dtype, head_size: int, *, sinks: bool = False) -> str:
    """Name expression of the tensor-core prefill instantiation (fp16/bf16 only; ``sinks``:
    the one that adds attention sinks)."""
    tail = ", true" if sinks else ""
    return f"prefill_attention_kernel<{CTYPE_NAMES[dtype]}, {head_size}{tail}>"


def decode_kernel_name(
    dtype: torch.dtype, head_size: int, block_size: int, group_t: int, stages: int = 2
) -> str:
    """Name expression of ``decode_attention_kernel<T, D, BLOCK, GROUP[, STAGES]>``
    (``group_t`` is the template's GROUP, one of :data:`DECODE_GROUPS`; ``stages`` one of
    :data:`DECODE_STAGES`, written only when it is not the default 2)."""
    tail = "" if stages == 2 else f", {stages}"
    return (
        f"decode_attention_kernel<{CTYPE_NAMES[dtype]}, {head_size}, {block_size}, {group_t}{tail}>"
    )


def merge_partials_name(dtype: torch.dtype, head_size: int) -> str:
    """Name expression of ``merge_partials_kernel<T, D>``."""
    return f"merge_partials_kernel<{CTYPE_NAMES[dtype]}, {head_size}>"


def decode_instantiated(head_size: int, group_t: int) -> bool:
    """Whether ``decode_attention_kernel`` exists for this head size and GROUP: GROUP 16 at
    head 256 would need 128 accumulator registers per thread (use GROUP 8 and two CTAs)."""
    return group_t in DECODE_GROUPS and not (head_size > 128 and group_t > 8)


def decode_smem_bytes(
    dtype: torch.dtype, head_size: int, block_size: int, group_t: int, stages: int = 2
) -> int:
    """Dynamic shared memory of a ``decode_attention_kernel`` launch (mirrors
    ``kvb::DecodeShape::kSmemBytes``; above 48 KiB the launch must opt in)."""
    del dtype, block_size  # 2-byte elements only; the block size only sets the chunk length
    warps, tokens, table_slots = DECODE_THREADS // 32, 32, 256
    heads = 8 * ((group_t + 7) // 8)
    ld = (head_size + 31) // 32 * 32 + 8
    warp_bytes = stages * tokens * ld * 2 + heads * (tokens + 4) * 4 + heads * (tokens + 8) * 2
    return warps * warp_bytes + heads * ld * 2 + table_slots * 4 + warps * heads * 2 * 4


def decode_stages_instantiated(head_size: int, group_t: int) -> tuple[int, ...]:
    """The ``STAGES`` variants compiled for this head size and GROUP, in order of
    preference: 2 always, 1 where 2 exceeds :data:`MIN_SMEM_OPTIN` (head 256)."""
    if not decode_instantiated(head_size, group_t):
        return ()
    two = decode_smem_bytes(torch.float16, head_size, 16, group_t, 2)
    return DECODE_STAGES if two > MIN_SMEM_OPTIN else DECODE_STAGES[:1]


def kernel_names(source: str) -> list[str]:
    """Every kernel (name expression) the front-ends can launch from ``source``."""
    if source == CACHE_OPS_SOURCE:
        return ["reshape_and_cache_kernel", "copy_blocks_kernel"]
    if source == SPLIT_K_SOURCE:
        # The split-K kernel: fp32 decode and prefill, and fp16/bf16 decode where the
        # tensor-core decode cannot be planned; fp16/bf16 prefill always runs PREFILL_SOURCE.
        names = []
        for dtype in CTYPE_NAMES:
            for head_size in SUPPORTED_HEAD_SIZES:
                names.append(split_k_kernel_name(dtype, head_size, DECODE_ROWS))
                if dtype == torch.float32:
                    names.append(split_k_kernel_name(dtype, head_size, PREFILL_ROWS))
                names.append(merge_kernel_name(dtype, head_size))
        return names
    if source == PREFILL_SOURCE:
        return [
            prefill_kernel_name(dtype, head_size, sinks=sinks)
            for dtype in (torch.float16, torch.bfloat16)
            for head_size in SUPPORTED_HEAD_SIZES
            for sinks in (False, True)
        ]
    if source == DECODE_SOURCE:
        names = []
        for dtype in (torch.float16, torch.bfloat16):
            for head_size in SUPPORTED_HEAD_SIZES:
                names += [
                    decode_kernel_name(dtype, head_size, block, group_t, stages)
                    for block in DECODE_BLOCK_SIZES
                    for group_t in DECODE_GROUPS
                    for stages in decode_stages_instantiated(head_size, group_t)
                ]
                names.append(merge_partials_name(dtype, head_size))
        return names
    raise InvalidArgumentError(f"unknown CUDA source {source!r}")
