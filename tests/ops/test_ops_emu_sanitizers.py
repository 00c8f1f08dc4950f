"""The emulated kernels under AddressSanitizer + UBSan, and under ThreadSanitizer.

A representative subset of the emulation tests runs in a subprocess whose Python
preloads the sanitizer runtime and loads the matching build of the harness
(``KVB_EMU_FLAVOR``). ASan/UBSan catch out-of-bounds accesses (global or shared
memory), misaligned vectors and UB; TSan sees each CUDA thread as an OS thread and
``__syncthreads`` as a mutex/condition-variable barrier, so a shared-memory write and
read by different threads without a barrier between them is reported as a data race:
a missing ``__syncthreads`` fails this test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from emu_runtime import build_library

HERE = Path(__file__).resolve().parent

SANITIZERS = {
    "asan": (
        "libasan.so",
        {
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        },
        "test_decode_matches_reference and (64-16-1 or 128-16-8 or 256-32-2) "
        "or test_decode_split_k_window_soft_cap or test_prefill_matches_reference "
        "or test_reshape_and_cache or test_copy_blocks or clamped",
    ),
    "tsan": (
        "libtsan.so",
        {"TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0"},
        "test_decode_matches_reference and (80-8-4 or 128-16-8) and dtype1 "
        "or test_decode_split_k_window_soft_cap and 40-2.0 "
        "or test_prefill_matches_reference and 64-16-1 and dtype0 "
        "or test_reshape_and_cache and 80 and dtype2 or test_copy_blocks_one and dtype0",
    ),
}


def _runtime(name: str) -> str:
    out = subprocess.run(
        [os.environ.get("CXX", "g++"), f"-print-file-name={name}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not os.path.isabs(out):
        pytest.skip(f"g++ has no {name}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SANITIZERS))
def test_emulated_kernels_are_clean_under_sanitizers(flavor):
    runtime, options, selection = SANITIZERS[flavor]
    build_library(flavor)
    env = dict(os.environ, KVB_EMU_FLAVOR=flavor, LD_PRELOAD=_runtime(runtime), **options)
    proc = subprocess.run(
        # -s: the sanitizer report goes to stderr, which capture would swallow on abort.
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
         str(HERE / "test_ops_emulation.py"), "-k", selection],
        env=env, capture_output=True, text=True, timeout=3600, cwd=HERE.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout
