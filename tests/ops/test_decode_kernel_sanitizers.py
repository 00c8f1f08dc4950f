"""The tensor-core decode kernel under AddressSanitizer + UBSan and ThreadSanitizer.

As in test_ops_emu_sanitizers.py: a subset of test_decode_kernel_emu.py runs in a
subprocess that preloads the sanitizer runtime and loads the matching harness build. ASan
proves the clamped plan fields, bad block ids and zero-filled edge tiles never reach
outside the buffers; TSan (each CUDA thread an OS thread, barriers as condition
variables) reports a shared-memory access that no barrier or cp.async wait orders.
"""

from __future__ import annotations

import pytest
from sanitized_pytest import run_sanitized

SELECTION = {
    "asan": "pipeline or out_of_range or empty_items or (single_item and 128-16-8-8) "
    "or (window and 8-37) or (splits and 64-1 and dtype1)",
    "tsan": "(single_item and 80-16-2-2 and dtype0) or (splits and 64-1 and dtype0) "
    "or (window and 16-1-2.0 and dtype1)",
}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SELECTION))
def test_decode_kernel_is_clean_under_sanitizers(flavor):
    run_sanitized(flavor, "test_decode_kernel_emu.py", SELECTION[flavor])
