"""The tensor-core prefill kernel on the emulator under AddressSanitizer + UBSan (bad block
ids and offsets, every shared/global access in bounds and aligned) and ThreadSanitizer (a
missing barrier or __syncwarp between shared-memory writes and reads is a data race),
in a subprocess like test_ops_emu_sanitizers.py."""

from __future__ import annotations

import pytest
from sanitized_pytest import run_sanitized

SELECTION = {
    "asan": "out_of_range or query_start_loc or ((mixed and (64-16-1 or 256-32-8) "
    "or short_chunks and 6 or window and 64-5 or rescale) and dtype1)",
    "tsan": "(mixed and 64-16-1 and dtype1) or (short_chunks and 8 and dtype1) "
    "or (rescale and dtype1) or (window and 256 and dtype1)",
}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SELECTION))
def test_prefill_kernel_is_clean_under_sanitizers(flavor):
    # torch's OpenMP pool (uninstrumented libgomp) shows as races inside torch under TSan
    # once the reference works on larger tensors; one thread keeps the report to the kernel.
    proc = run_sanitized(
        flavor,
        "test_prefill_kernel_emulation.py",
        SELECTION[flavor],
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    assert " deselected" in proc.stdout
