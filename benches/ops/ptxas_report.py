"""Print ptxas' resource report (registers, spills, shared memory) for every kernel.

Compiles the kernel sources with NVRTC (no GPU needed) for each architecture given:

    python benches/ops/ptxas_report.py [sm_80 sm_90 ...]
"""

from __future__ import annotations

import sys

from kvblocks.ops.cuda_sources import CACHE_OPS_SOURCE, SPLIT_K_SOURCE, kernel_names
from kvblocks.ops.launch_plan import split_k_smem_bytes
from kvblocks.ops.nvrtc_build import compile_source

_DTYPES = {"float": "float32", "__half": "float16", "__nv_bfloat16": "bfloat16"}


def _dynamic_smem(name: str) -> int:
    """Dynamic shared memory the planner launches an attention kernel with."""
    if not name.startswith("split_k_attention_kernel<"):
        return 0
    import torch

    ctype, head, rows = name[name.index("<") + 1 : -1].split(", ")
    return split_k_smem_bytes(getattr(torch, _DTYPES[ctype]), int(head), int(rows))


def main(archs: list[str]) -> int:
    """Compile for each arch and print one table row per kernel; 1 if anything spills."""
    spilled = False
    for arch in archs:
        print(f"== {arch}")
        print(f"{'kernel':<48} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} "
              f"{'smem':>6} {'dyn smem':>9}")  # fmt: skip
        for source in (CACHE_OPS_SOURCE, SPLIT_K_SOURCE):
            result = compile_source(source, arch, kernel_names(source))
            for name in kernel_names(source):
                k = result.kernels[name]
                spilled |= bool(k.spill_stores or k.spill_loads)
                print(f"{name:<48} {k.registers:>5} {k.spill_stores:>9} {k.spill_loads:>9} "
                      f"{k.stack_bytes:>6} {k.static_smem_bytes:>6} "
                      f"{_dynamic_smem(name):>9}")  # fmt: skip
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["sm_80", "sm_90"]))
