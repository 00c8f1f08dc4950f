"""The emulated warp-level PTX (cuda/emu/ptx_emu.h: ldmatrix, mma.sync m16n8k16) lane by
lane against the PTX ISA's fragment layouts, restated here independently, and against a
plain matrix product; the same self-test kernels compile with NVRTC."""

from __future__ import annotations

import numpy as np
import pytest
from emu_runtime import emu_launch
from test_ops_emu_wmma import aligned, from_bits, ptr, to_bits

from kvblocks.ops.launch_plan import KernelLaunch

CTYPES = ["__half", "__nv_bfloat16"]


def run(name: str, *args) -> None:
    emu_launch(KernelLaunch(name, (1, 1, 1), (32, 1, 1), 0, tuple(ptr(a) for a in args)))


def halves(regs: np.ndarray) -> np.ndarray:
    """The two 16-bit elements of each .b32 register, low half first."""
    return np.stack([regs & 0xFFFF, regs >> 16], axis=-1).astype(np.uint16)


# The PTX ISA's layouts, lane = 4 g + t (see cuda/warp_mma.cuh).
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)


def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return 2 * t + i % 2 + 8 * (i // 2), g


def c_index(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return g + 8 * (i // 2), 2 * t + i % 2


@pytest.mark.parametrize("ctype", CTYPES)
def test_mma_on_raw_lane_registers_is_the_isa_matrix_product(ctype):
    rng = np.random.default_rng(1)
    a_bits = to_bits(rng.standard_normal(32 * 8).astype(np.float32), ctype)
    b_bits = to_bits(rng.standard_normal(32 * 4).astype(np.float32), ctype)
    a_regs = a_bits.view(np.uint32).copy()  # lane l: registers 4l..4l+3 (little endian)
    b_regs = b_bits.view(np.uint32).copy()
    c = rng.standard_normal(32 * 4).astype(np.float32)
    d = np.full(32 * 4, np.nan, dtype=np.float32)
    run(f"emu_mma_raw_kernel<{ctype}>", a_regs, b_regs, c, d)
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    cm = np.zeros((16, 8))
    a_vals = from_bits(halves(a_regs).reshape(-1), ctype).reshape(32, 8)
    b_vals = from_bits(halves(b_regs).reshape(-1), ctype).reshape(32, 4)
    for lane in range(32):
        for i in range(8):
            a[a_index(lane, i)] = a_vals[lane, i]
        for i in range(4):
            b[b_index(lane, i)] = b_vals[lane, i]
            cm[c_index(lane, i)] = c[4 * lane + i]
    want = a @ b + cm
    got = np.zeros((16, 8))
    for lane in range(32):
        for i in range(4):
            got[c_index(lane, i)] = d[4 * lane + i]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Every output element comes from exactly one lane register.
    assert len({c_index(lane, i) for lane in range(32) for i in range(4)}) == 128


@pytest.mark.parametrize(("n", "trans"), [(4, False), (4, True), (2, False), (2, True)])
def test_ldmatrix_gives_each_lane_its_isa_elements(n, trans):
    tile = np.arange(8 * n * 8, dtype=np.uint16) * 3 + 1  # 8n x 8, row-major, distinct
    out = np.zeros(32 * n, dtype=np.uint32)
    run(f"emu_ldmatrix_kernel<{n}, {'true' if trans else 'false'}>", tile, out)
    got = halves(out).reshape(32, n, 2)
    mats = tile.reshape(n, 8, 8)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for m in range(n):
            want = (mats[m, 2 * t, g], mats[m, 2 * t + 1, g]) if trans else (
                mats[m, g, 2 * t], mats[m, g, 2 * t + 1])  # fmt: skip
            assert tuple(got[lane, m]) == want, (lane, m)


@pytest.mark.parametrize("ctype", CTYPES)
def test_ldmatrix_fed_mma_is_a_matrix_product(ctype):
    """A by ldmatrix.x4 from row-major rows, B from rows of B^T (as K rows) by ldmatrix.x2
    and from rows of B (as V rows) by ldmatrix.x2.trans: both products equal A B + C."""
    rng = np.random.default_rng(7)
    a_bits = to_bits(rng.standard_normal(256).astype(np.float32), ctype)
    bk_bits = to_bits(rng.standard_normal(128).astype(np.float32), ctype)  # B, 16 x 8
    b = from_bits(bk_bits, ctype).reshape(16, 8)
    bt_bits = np.ascontiguousarray(bk_bits.reshape(16, 8).T).reshape(-1)  # B^T, 8 x 16
    c = rng.standard_normal(128).astype(np.float32)
    d1 = aligned(np.full(128, np.nan, dtype=np.float32))
    d2 = aligned(np.full(128, np.nan, dtype=np.float32))
    run(f"emu_mma_tile_kernel<{ctype}>", a_bits, bt_bits, bk_bits, c, d1, d2)
    want = from_bits(a_bits, ctype).reshape(16, 16).astype(np.float64) @ b + c.reshape(16, 8)
    np.testing.assert_allclose(d1.reshape(16, 8), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d2.reshape(16, 8), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_self_test_kernels_compile_to_ptx_mma_and_ldmatrix(arch):
    nvrtc = pytest.importorskip("kvblocks.ops.nvrtc_build")
    pytest.importorskip("cuda.bindings.nvrtc")
    from kvblocks.ops.cuda_sources import nvrtc_options

    names = [f"emu_mma_raw_kernel<{c}>" for c in CTYPES]
    names += [f"emu_mma_tile_kernel<{c}>" for c in CTYPES]
    names += [f"emu_ldmatrix_kernel<{n}, {t}>" for n in (2, 4) for t in ("false", "true")]
    program = nvrtc.compile_program(
        "mma_selftest.cu", names, nvrtc_options(arch), code='#include "emu/mma_selftest.cuh"\n'
    )
    assert len(program.binary) > 0 and set(program.lowered) == set(names)
