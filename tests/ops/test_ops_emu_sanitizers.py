"""The emulated kernels under AddressSanitizer + UndefinedBehaviorSanitizer.

A representative subset of the emulation tests runs in a subprocess whose Python
preloads libasan and loads the sanitized build of the harness (``KVB_EMU_FLAVOR=asan``):
any out-of-bounds access (global or shared memory), misaligned vector access or UB in
the kernels aborts that run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from emu_runtime import build_library

HERE = Path(__file__).resolve().parent


def _libasan() -> str:
    out = subprocess.run(
        [os.environ.get("CXX", "g++"), "-print-file-name=libasan.so"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not os.path.isabs(out):
        pytest.skip("g++ has no libasan")
    return out


@pytest.mark.slow
def test_emulated_kernels_are_clean_under_asan_and_ubsan():
    build_library("asan")
    env = dict(os.environ)
    env.update(
        KVB_EMU_FLAVOR="asan",
        LD_PRELOAD=_libasan(),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    selection = (
        "test_decode_matches_reference and (64-16-1 or 128-16-8 or 256-32-2) "
        "or test_decode_split_k_window_soft_cap or test_prefill_matches_reference "
        "or test_reshape_and_cache or test_copy_blocks or clamped"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(HERE / "test_ops_emulation.py"), "-k", selection],
        env=env, capture_output=True, text=True, timeout=540, cwd=HERE.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout
