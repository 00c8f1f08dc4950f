"""The planned decode path (DecodeAttention -> kernel -> merge) under AddressSanitizer + UBSan.

The plan buffer, the partial workspace and the packed pointers are the host side's own:
ASan proves that what ``DecodeAttention`` sizes and passes (items of a fixed grid in graph
mode, partial slots, merge ranges) keeps every kernel access inside its buffers. Runs a
subset of test_decode_plan_emulator.py in a subprocess that preloads the runtime, as
test_ops_emu_sanitizers.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from emu_runtime import build_library
from test_ops_emu_sanitizers import SANITIZERS, _runtime

HERE = Path(__file__).resolve().parent
SELECTION = "graph_replay or (group_sizes and 16) or (mixed_lengths and dtype1)"


@pytest.mark.slow
def test_planned_decode_is_clean_under_asan():
    runtime, options, _ = SANITIZERS["asan"]
    build_library("asan")
    env = dict(os.environ, KVB_EMU_FLAVOR="asan", LD_PRELOAD=_runtime(runtime), **options)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
         str(HERE / "test_decode_plan_emulator.py"), "-k", SELECTION],
        env=env, capture_output=True, text=True, timeout=3600, cwd=HERE.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert " passed" in proc.stdout
