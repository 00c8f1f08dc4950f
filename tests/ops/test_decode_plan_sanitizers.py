"""The planned decode path (DecodeAttention -> kernel -> merge) under AddressSanitizer + UBSan.

The plan buffer, the partial workspace and the packed pointers are the host side's own:
ASan proves that what ``DecodeAttention`` sizes and passes (items of a fixed grid in graph
mode, partial slots, merge ranges) keeps every kernel access inside its buffers. Runs a
subset of test_decode_plan_emulator.py in a subprocess that preloads the runtime, as
test_ops_emu_sanitizers.py does.
"""

from __future__ import annotations

import pytest
from sanitized_pytest import run_sanitized

SELECTION = "graph_replay or (group_sizes and 16) or (mixed_lengths and dtype1)"


@pytest.mark.slow
def test_planned_decode_is_clean_under_asan():
    run_sanitized("asan", "test_decode_plan_emulator.py", SELECTION)
