"""The attention-kernel instantiations each sanitizer build of the emulation harness holds.

An ASan or TSan build of every instantiation (~300 of them) cost minutes of CPU for the
few dozen its tests launch, so a sanitizer build compiles only those listed here: what
the one run of that flavor (test_sanitizers.py, over every file it selects from) looks
up; the ``opt`` build keeps them all. The lists are checked both ways: a kernel a run
needs that is missing aborts it with the kernel's name (harness.cpp), and one listed that
its run no longer uses fails run_sanitized, which prints the list to paste in either case.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: flavor -> the attention kernels its sanitized run (test_sanitizers.py) looks up, over
#: all the files it selects from.
KERNELS: dict[str, tuple[str, ...]] = {
    "asan": (
        "decode_attention_kernel<__half, 128, 16, 8>",
        "decode_attention_kernel<__half, 128, 8, 8>",
        "decode_attention_kernel<__half, 64, 16, 16>",
        "decode_attention_kernel<__half, 64, 16, 2>",
        "decode_attention_kernel<__half, 64, 16, 4>",
        "decode_attention_kernel<__nv_bfloat16, 128, 16, 8>",
        "decode_attention_kernel<__nv_bfloat16, 128, 8, 8>",
        "decode_attention_kernel<__nv_bfloat16, 64, 16, 1>",
        "decode_attention_kernel<__nv_bfloat16, 64, 16, 2>",
        "decode_attention_kernel<__nv_bfloat16, 64, 16, 4>",
        "decode_attention_kernel<__nv_bfloat16, 64, 16, 8>",
        "merge_partials_kernel<__half, 128>",
        "merge_partials_kernel<__half, 64>",
        "merge_partials_kernel<__nv_bfloat16, 64>",
        "merge_splits_kernel<__nv_bfloat16, 64>",
        "merge_splits_kernel<float, 64>",
        "prefill_attention_kernel<__half, 64>",
        "prefill_attention_kernel<__nv_bfloat16, 128>",
        "prefill_attention_kernel<__nv_bfloat16, 256>",
        "prefill_attention_kernel<__nv_bfloat16, 64>",
        "split_k_attention_kernel<__half, 128, 16>",
        "split_k_attention_kernel<__half, 128, 8>",
        "split_k_attention_kernel<__half, 256, 16>",
        "split_k_attention_kernel<__half, 256, 8>",
        "split_k_attention_kernel<__half, 64, 16>",
        "split_k_attention_kernel<__half, 64, 8>",
        "split_k_attention_kernel<__half, 80, 16>",
        "split_k_attention_kernel<__nv_bfloat16, 128, 16>",
        "split_k_attention_kernel<__nv_bfloat16, 128, 8>",
        "split_k_attention_kernel<__nv_bfloat16, 256, 16>",
        "split_k_attention_kernel<__nv_bfloat16, 256, 8>",
        "split_k_attention_kernel<__nv_bfloat16, 64, 16>",
        "split_k_attention_kernel<__nv_bfloat16, 64, 8>",
        "split_k_attention_kernel<__nv_bfloat16, 80, 16>",
        "split_k_attention_kernel<float, 128, 16>",
        "split_k_attention_kernel<float, 128, 8>",
        "split_k_attention_kernel<float, 256, 16>",
        "split_k_attention_kernel<float, 256, 8>",
        "split_k_attention_kernel<float, 64, 16>",
        "split_k_attention_kernel<float, 64, 8>",
        "split_k_attention_kernel<float, 80, 16>",
    ),
    "tsan": (
        "decode_attention_kernel<__half, 64, 16, 1>",
        "decode_attention_kernel<__half, 80, 16, 2>",
        "decode_attention_kernel<__nv_bfloat16, 128, 16, 8>",
        "merge_partials_kernel<__half, 64>",
        "merge_splits_kernel<__nv_bfloat16, 64>",
        "merge_splits_kernel<float, 64>",
        "prefill_attention_kernel<__nv_bfloat16, 128>",
        "prefill_attention_kernel<__nv_bfloat16, 256>",
        "prefill_attention_kernel<__nv_bfloat16, 64>",
        "split_k_attention_kernel<__half, 128, 8>",
        "split_k_attention_kernel<__half, 80, 8>",
        "split_k_attention_kernel<__nv_bfloat16, 64, 8>",
        "split_k_attention_kernel<float, 64, 16>",
        "split_k_attention_kernel<float, 64, 8>",
    ),
}

# The kernel families harness.cpp can instantiate by name (its KVB_SMEM_* macros).
_FAMILIES = (
    "decode_attention_kernel",
    "merge_partials_kernel",
    "split_k_attention_kernel",
    "merge_splits_kernel",
    "prefill_attention_kernel",
)
_NAME = re.compile(r"(\w+)<([^<>]+)>")


def squeeze(name: str) -> str:
    """A name expression without blanks, as harness.cpp compares (and logs) them."""
    return name.replace(" ", "")


def is_attention(name: str) -> bool:
    """Whether a (squeezed) name is one of the kernels a sanitizer build selects."""
    match = _NAME.fullmatch(name)
    return match is not None and match[1] in _FAMILIES


def instantiated(flavor: str) -> list[str] | None:
    """The attention kernels ``flavor``'s build holds (sorted), or None for all of them."""
    names = KERNELS.get(flavor)
    if names is None:
        return None
    return sorted({squeeze(name) for name in names})


def entries_header(flavor: str) -> str | None:
    """The KVB_KERNEL lines harness.cpp includes for ``flavor`` (None: every kernel)."""
    names = instantiated(flavor)
    return None if names is None else kernel_entries(names)


def kernel_entries(names: Iterable[str]) -> str:
    """harness.cpp's ``KVB_KERNEL(family, args...),`` line of each attention kernel name
    (blanks in the name do not matter); raises ValueError for any other name."""
    lines = []
    for name in names:
        match = _NAME.fullmatch(squeeze(name))
        if match is None or match[1] not in _FAMILIES:
            raise ValueError(f"{name!r} is not an attention kernel harness.cpp can instantiate")
        lines.append(f"KVB_KERNEL({match[1]}, {match[2].replace(',', ', ')}),\n")
    return "".join(lines)
