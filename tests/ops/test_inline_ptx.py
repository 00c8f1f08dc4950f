"""Source checks of the kernels' inline PTX (no compiler needed)."""

from __future__ import annotations

import re

from kvblocks.ops.cuda_sources import cuda_dir

# PTX that writes or publishes memory behind the compiler's back: cp.async writes shared
# memory and its wait makes the data visible, a barrier orders other threads' accesses.
MEMORY_PTX = ("cp.async", "bar.sync", "barrier.sync", "bar.arrive")
_ASM = re.compile(r"\basm\s+(?:volatile\s*)?\((.*?)\);", re.S)


def _statements() -> list[tuple[str, str]]:
    out = []
    for path in sorted([*cuda_dir().glob("*.cu"), *cuda_dir().glob("*.cuh")]):
        text = path.read_text()
        out += [(path.name, m.group(1)) for m in _ASM.finditer(text)]
    return out


def test_memory_ptx_has_a_memory_clobber():
    """cp.async, its commit and wait, and barriers carry "memory" (NVIDIA's pipeline
    helpers do): without it the compiler may keep a shared value in a register across the
    wait, or move a plain shared-memory access across the copy."""
    checked = [(name, body) for name, body in _statements() if any(op in body for op in MEMORY_PTX)]
    names = {op for _, body in checked for op in ("cp.async.cg", "commit_group", "wait_group")
             if op in body}  # fmt: skip
    assert names == {"cp.async.cg", "commit_group", "wait_group"}, names
    missing = [f"{name}: {' '.join(body.split())[:90]}" for name, body in checked
               if '"memory"' not in body]  # fmt: skip
    assert not missing, missing
