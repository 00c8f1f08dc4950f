"""The CUDA emulator itself: warp shuffles, shared memory, atomics, conversions, and
that kernel bugs (divergent barriers, deadlocks, misaligned vectors) abort loudly."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from emu_runtime import emu_launch, library

from kvblocks.ops.launch_plan import KernelLaunch

HERE = Path(__file__).resolve().parent


def launch(name, grid, block, *args):
    emu_launch(KernelLaunch(name, (grid, 1, 1), (block, 1, 1), 0, args))


def ptr(array):
    return np.uint64(array.ctypes.data)


def test_warp_shuffles():
    out = np.zeros((64, 6), dtype=np.int32)
    launch("emu_shuffle_kernel", 1, 64, ptr(out))
    lane = np.arange(64) % 32
    assert (out[:, 0] == 496).all()
    assert (out[:, 1] == 30).all()
    assert (out[:, 2] == np.where(lane < 31, lane + 1, lane)).all()
    assert (out[:, 3] == np.where(lane >= 2, lane - 2, lane)).all()
    assert (out[:, 4] == lane ^ 4).all()
    assert (out[:, 5] == 31 - lane).all()


def test_shared_memory_barriers_and_atomics():
    counter = np.zeros(1, dtype=np.int32)
    fsum = np.zeros(1, dtype=np.float32)
    maxv = np.zeros(1, dtype=np.int32)
    out = np.zeros(3 * 128, dtype=np.int32)
    launch("emu_block_kernel", 3, 128, ptr(counter), ptr(fsum), ptr(maxv), ptr(out))
    assert counter[0] == 384 and fsum[0] == 192.0 and maxv[0] == 2127
    want = (np.arange(3)[:, None] * 1000 + 127 - np.arange(128)[None, :]).ravel()
    assert (out == want).all()


def test_half_and_bfloat16_conversions_are_bit_exact():
    lib = library()
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 20000),
        np.array([0.0, -0.0, 65504.0, 65520.0, 65519.0, 1e-8, 5.96e-8, 2.98e-8, 6.1e-5,
                  np.inf, -np.inf, 1 + 2.0**-11, 1 + 3 * 2.0**-11], dtype=np.float32),
    ]).astype(np.float32)  # fmt: skip
    got = np.zeros(values.size, dtype=np.uint16)
    fp = ctypes.POINTER(ctypes.c_float)
    up = ctypes.POINTER(ctypes.c_uint16)
    lib.kvb_emu_to_half(values.ctypes.data_as(fp), got.ctypes.data_as(up),
                        ctypes.c_longlong(values.size))  # fmt: skip
    with np.errstate(over="ignore"):  # numpy warns on the values that overflow to inf
        want_half = values.astype(np.float16).view(np.uint16)
    assert (got == want_half).all()
    back = np.zeros(values.size, dtype=np.float32)
    lib.kvb_emu_from_half(got.ctypes.data_as(up), back.ctypes.data_as(fp),
                          ctypes.c_longlong(values.size))  # fmt: skip
    assert (back == got.view(np.float16).astype(np.float32)).all()
    import torch

    lib.kvb_emu_to_bf16(values.ctypes.data_as(fp), got.ctypes.data_as(up),
                        ctypes.c_longlong(values.size))  # fmt: skip
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (got == want).all()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0, "divergent barrier in the block"),
        (1, "deadlock: warp shuffle (write) in a warp"),
        (2, "misaligned 16-byte access"),
    ],
)
def test_kernel_bugs_abort_with_a_message(mode, message):
    script = (
        f"import sys, numpy as np; sys.path.insert(0, {str(HERE)!r})\n"
        "from emu_runtime import emu_launch\n"
        "from kvblocks.ops.launch_plan import KernelLaunch\n"
        "buf = np.zeros(64, dtype=np.uint8)\n"
        "emu_launch(KernelLaunch('emu_bug_kernel', (1, 1, 1), (64, 1, 1), 0,\n"
        f"    (np.int32({mode}), np.uint64(buf.ctypes.data))))\n"
    )
    # No KVB_EMU_TIMEOUT_MS: the fiber scheduler finds the deadlock when no thread can run,
    # not after a wall-clock wait, so a loaded machine cannot change the report. The
    # subprocess timeout is only a backstop against a hang.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def test_a_slow_thread_is_not_reported_as_a_deadlock():
    # On a loaded machine a thread can take longer than any timeout to reach a barrier. The
    # emulator must only report a barrier that can never complete, so even a 1 ms
    # KVB_EMU_TIMEOUT_MS and a thread sleeping 300 ms before __syncthreads pass.
    script = (
        f"import sys, numpy as np; sys.path.insert(0, {str(HERE)!r})\n"
        "from emu_runtime import emu_launch\n"
        "from kvblocks.ops.launch_plan import KernelLaunch\n"
        "out = np.zeros(2 * 128, dtype=np.int32)\n"
        "emu_launch(KernelLaunch('emu_slow_thread_kernel', (2, 1, 1), (128, 1, 1), 0,\n"
        "    (np.int32(300), np.uint64(out.ctypes.data))))\n"
        "assert (out == 1).all()\n"
    )
    env = dict(os.environ, KVB_EMU_TIMEOUT_MS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
