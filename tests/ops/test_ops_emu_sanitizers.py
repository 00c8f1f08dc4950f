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

import pytest
from sanitized_pytest import run_sanitized

# flavor -> the test_ops_emulation.py selection run under it
SELECTION = {
    "asan": "test_decode_matches_reference and (64-16-1 or 128-16-8 or 256-32-2) "
    "or test_decode_split_k_window_soft_cap or test_prefill_matches_reference "
    "or test_reshape_and_cache or test_copy_blocks or clamped",
    "tsan": "test_decode_matches_reference and (80-8-4 or 128-16-8) and dtype1 "
    "or test_decode_split_k_window_soft_cap and 40-2.0 "
    "or test_prefill_matches_reference and 64-16-1 and dtype0 "
    "or test_reshape_and_cache and 80 and dtype2 or test_copy_blocks_one and dtype0",
}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SELECTION))
def test_emulated_kernels_are_clean_under_sanitizers(flavor):
    run_sanitized(flavor, "test_ops_emulation.py", SELECTION[flavor])
