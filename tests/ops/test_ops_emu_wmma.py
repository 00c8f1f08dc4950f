"""The emulated warp matrix functions (cuda/emu/include/mma.h) against a plain matrix product.

The same self-test kernels are compiled by NVRTC against CUDA's own ``<mma.h>``, so a kernel
that runs under the emulator uses the API as CUDA declares it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from emu_runtime import emu_launch, library

from kvblocks.ops.launch_plan import KernelLaunch

WMMA = "nvcuda::wmma::"
# (element type, M, N, K, layout of a, layout of b)
CASES = [
    ("__half", 16, 16, 16, "row_major", "col_major"),
    ("__half", 16, 16, 16, "col_major", "row_major"),
    ("__nv_bfloat16", 16, 16, 16, "row_major", "col_major"),
    ("__half", 32, 8, 16, "row_major", "row_major"),
    ("__nv_bfloat16", 8, 32, 16, "col_major", "col_major"),
]


def kernel_name(ctype, m, n, k, la, lb):
    return f"emu_wmma_kernel<{ctype}, {m}, {n}, {k}, {WMMA}{la}, {WMMA}{lb}>"


def aligned(values):
    """A copy of ``values`` at a 64-byte aligned address (fragment pointers need 32)."""
    raw = np.zeros(values.nbytes + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def ptr(array):
    return np.uint64(array.ctypes.data)


def to_bits(values, ctype):
    lib = library()
    out = np.zeros(values.size, dtype=np.uint16)
    convert = lib.kvb_emu_to_half if ctype == "__half" else lib.kvb_emu_to_bf16
    convert(
        values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)),
        ctypes.c_longlong(values.size),
    )
    return out


def from_bits(bits, ctype):
    if ctype == "__half":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d_col_major", [0, 1])
def test_mma_matches_a_matrix_product(case, d_col_major):
    ctype, m, n, k, la, lb = case
    rng = np.random.default_rng(m * 100 + n + d_col_major)
    a_bits = to_bits(rng.standard_normal(m * k).astype(np.float32), ctype)
    b_bits = to_bits(rng.standard_normal(k * n).astype(np.float32), ctype)
    a_logical = from_bits(a_bits, ctype).reshape((m, k) if la == "row_major" else (k, m))
    b_logical = from_bits(b_bits, ctype).reshape((k, n) if lb == "row_major" else (n, k))
    if la == "col_major":
        a_logical = a_logical.T
    if lb == "col_major":
        b_logical = b_logical.T
    lda = k if la == "row_major" else m
    ldb = n if lb == "row_major" else k
    c = rng.standard_normal((m, n)).astype(np.float32)
    d = aligned(np.full(m * n, np.nan, dtype=np.float32))
    emu_launch(
        KernelLaunch(
            kernel_name(ctype, m, n, k, la, lb),
            (1, 1, 1),
            (32, 1, 1),
            0,
            (ptr(a_bits), ptr(b_bits), ptr(c), ptr(d), np.int32(lda), np.int32(ldb),
             np.int32(d_col_major)),
        )
    )  # fmt: skip
    want = 0.5 * (a_logical.astype(np.float64) @ b_logical.astype(np.float64) + c)
    got = d.reshape(n, m).T if d_col_major else d.reshape(m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_store_read_back_without_syncwarp_is_caught():
    """Each lane stores only its share of the tile: reading it before a __syncwarp sees
    elements other lanes have not written yet (poison), as on the GPU."""
    counts = {}
    for sync in (0, 1):
        not_one = np.full(32, -1, dtype=np.int32)
        emu_launch(
            KernelLaunch("emu_wmma_sync_kernel", (1, 1, 1), (32, 1, 1), 0,
                         (np.int32(sync), ptr(not_one)))
        )  # fmt: skip
        counts[sync] = not_one
    assert (counts[1] == 0).all()
    assert counts[0].max() > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_self_test_kernels_compile_against_cuda_mma_h(arch):
    nvrtc = pytest.importorskip("kvblocks.ops.nvrtc_build")
    pytest.importorskip("cuda.bindings.nvrtc")
    from kvblocks.ops.cuda_sources import nvrtc_options

    names = [kernel_name(*case) for case in CASES] + ["emu_wmma_sync_kernel"]
    program = nvrtc.compile_program(
        "wmma_selftest.cu", names, nvrtc_options(arch), code='#include "emu/wmma_selftest.cuh"\n'
    )
    assert len(program.binary) > 0 and set(program.lowered) == set(names)
