"""The tensor-core prefill kernel on the emulator under AddressSanitizer + UBSan (bad block
ids and offsets, every shared/global access in bounds and aligned) and ThreadSanitizer (a
missing barrier or __syncwarp between shared-memory writes and reads is a data race),
in a subprocess like test_ops_emu_sanitizers.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from emu_runtime import build_library
from test_ops_emu_sanitizers import SANITIZERS, _runtime

HERE = Path(__file__).resolve().parent

SELECTION = {
    "asan": "out_of_range or query_start_loc or ((mixed and (64-16-1 or 256-32-8) "
    "or short_chunks and 6 or window and 64-5 or rescale) and dtype1)",
    "tsan": "(mixed and 64-16-1 and dtype1) or (short_chunks and 8 and dtype1) "
    "or (rescale and dtype1) or (window and 256 and dtype1)",
}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SELECTION))
def test_prefill_kernel_is_clean_under_sanitizers(flavor):
    runtime, options, _ = SANITIZERS[flavor]
    build_library(flavor)
    env = dict(os.environ, KVB_EMU_FLAVOR=flavor, LD_PRELOAD=_runtime(runtime), **options)
    # torch's OpenMP pool (uninstrumented libgomp) shows as races inside torch under TSan
    # once the reference works on larger tensors; one thread keeps the report to the kernel.
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
         str(HERE / "test_prefill_kernel_emulation.py"), "-k", SELECTION[flavor]],
        env=env, capture_output=True, text=True, timeout=3600, cwd=HERE.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout and " deselected" in proc.stdout
