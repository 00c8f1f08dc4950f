"""The emulated kernels under AddressSanitizer + UBSan, and under ThreadSanitizer.

A representative subset of the emulation tests runs in one pytest subprocess per flavor
that preloads the sanitizer runtime and loads the matching build of the harness
(``KVB_EMU_FLAVOR``, sanitized_pytest.py); one subprocess for all the files, since the
start-up of each (Python, torch, collection under the runtime) costs 8-13 CPU-s.

ASan/UBSan catch out-of-bounds accesses (global or shared memory), misaligned vectors and
UB; TSan sees each CUDA thread as an OS thread and ``__syncthreads`` as a
mutex/condition-variable barrier, so a shared-memory write and read by different threads
without a barrier (or ``__syncwarp``, or cp.async wait) between them is reported as a data
race: a missing barrier fails this test. Per file:

- test_ops_emulation.py: the split-K attention, the merges and the cache ops.
- test_decode_kernel_emu.py: the tensor-core decode kernel; ASan proves the clamped plan
  fields, bad block ids and zero-filled edge tiles never reach outside the buffers.
- test_decode_plan_emulator.py (ASan): the planned decode path (DecodeAttention -> kernel
  -> merge); the plan buffer, the partial workspace and the packed pointers are the host
  side's own, and ASan proves what ``DecodeAttention`` sizes and passes (items of a fixed
  grid in graph mode, partial slots, merge ranges) keeps every access inside its buffers.
- test_prefill_kernel_emulation.py: the tensor-core prefill kernel (bad block ids and
  offsets; ``__syncwarp`` between shared-memory writes and reads).
"""

from __future__ import annotations

import pytest
from sanitized_pytest import run_sanitized

#: flavor -> emulation test file -> the -k selection of it that runs under the flavor
SELECTIONS = {
    "asan": {
        "test_ops_emulation.py": "test_decode_matches_reference and (64-16-1 or 128-16-8 "
        "or 256-32-2) or test_decode_split_k_window_soft_cap "
        "or test_prefill_matches_reference or test_reshape_and_cache or test_copy_blocks "
        "or clamped",
        "test_decode_kernel_emu.py": "pipeline or out_of_range or empty_items "
        "or (single_item and 128-16-8-8) or (window and 8-37) or (splits and 64-1 and dtype1)",
        "test_decode_plan_emulator.py": "graph_replay or (group_sizes and 16) "
        "or (mixed_lengths and dtype1)",
        "test_prefill_kernel_emulation.py": "out_of_range or query_start_loc "
        "or ((mixed and (64-16-1 or 256-32-8) or short_chunks and 6 or window and 64-5 "
        "or rescale) and dtype1)",
    },
    "tsan": {
        "test_ops_emulation.py": "test_decode_matches_reference and (80-8-4 or 128-16-8) "
        "and dtype1 or test_decode_split_k_window_soft_cap and 40-2.0 "
        "or test_prefill_matches_reference and 64-16-1 and dtype0 "
        "or test_reshape_and_cache and 80 and dtype2 or test_copy_blocks_one and dtype0",
        "test_decode_kernel_emu.py": "(single_item and 80-16-2-2 and dtype0) "
        "or (splits and 64-1 and dtype0) or (window and 16-1-2.0 and dtype1)",
        "test_prefill_kernel_emulation.py": "(mixed and 64-16-1 and dtype1) "
        "or (short_chunks and 8 and dtype1) or (rescale and dtype1) "
        "or (window and 256 and dtype1)",
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(SELECTIONS))
def test_emulated_kernels_are_clean_under_sanitizers(flavor):
    # torch's OpenMP pool (uninstrumented libgomp) shows as races inside torch under TSan
    # once the prefill reference works on larger tensors; one thread keeps the report to
    # the kernels (the emulator runs them on its own threads, or fibers, either way).
    run_sanitized(flavor, SELECTIONS[flavor], extra_env={"OMP_NUM_THREADS": "1"})
