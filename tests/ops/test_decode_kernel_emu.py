"""``decode_attention_kernel`` / ``merge_partials_kernel`` (cuda/decode_attention.cu) in the
CPU emulator with hand-built item plans, against fp32 torch math on the cache's values
(and :func:`kvblocks.ops.reference.paged_attention` for whole sequences); plus the
emulated cp.async pipeline the kernel relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_kernel_cases import run_decode
from emu_runtime import emu_launch, library
from ops_cases import make_case, tolerance

from kvblocks.ops import reference
from kvblocks.ops.cuda_sources import (
    DECODE_SOURCE,
    decode_smem_bytes,
    kernel_names,
)
from kvblocks.ops.launch_plan import KernelLaunch

DTYPES = [torch.float16, torch.bfloat16]


def whole_items(lens: list[int]) -> list[tuple[int, int, int, int]]:
    return [(s, 0, n, -1) for s, n in enumerate(lens)]


def check_out(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


# ---- the emulated cp.async pipeline ------------------------------------------------------


def run_pipeline(mode: int) -> np.ndarray:
    src = np.arange(256, dtype=np.float32) + 1.0
    out = np.zeros(64, dtype=np.float32)
    args = (np.uint64(src.ctypes.data), np.uint64(out.ctypes.data), np.int32(mode))
    emu_launch(KernelLaunch("emu_pipeline_kernel", (1, 1, 1), (32, 1, 1), 0, args))
    return out


def test_pipeline_data_lands_only_at_the_wait():
    lanes = np.arange(32)
    first = 4 * ((lanes * 7 + 3) % 32) + 1.0
    good = run_pipeline(0)
    np.testing.assert_array_equal(good, np.concatenate([first, first + 128]))
    # No wait: the destination is still poisoned (0xFF bytes: NaN) however the lanes run.
    assert np.isnan(run_pipeline(1)).all()
    # wait_prior(1): the older group landed, the newer one did not.
    partial = run_pipeline(2)
    np.testing.assert_array_equal(partial[:32], first)
    assert np.isnan(partial[32:]).all()
    # Waits without __syncwarp: a lane reading another lane's copy before that lane waited
    # sees poison (the fibers run in turn, so some reads come first).
    assert np.isnan(run_pipeline(3)).any()
    zero_filled = run_pipeline(4)
    np.testing.assert_array_equal(zero_filled, np.concatenate([first, np.zeros(32)]))


# ---- decode kernel ------------------------------------------------------------------------


def test_every_decode_instantiation_is_in_the_harness_with_the_mirrored_smem():
    lib = library()
    for name in kernel_names(DECODE_SOURCE):
        smem = lib.kvb_emu_smem_bytes(name.encode())
        assert smem >= 0, name
        if name.startswith("decode_attention_kernel"):
            ctype, head, block, group_t = name[name.index("<") + 1 : -1].split(", ")
            dtype = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16}[ctype]
            assert decode_smem_bytes(dtype, int(head), int(block), int(group_t)) == smem, name
            assert smem <= 163 * 1024, f"{name} does not fit an A100 CTA"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group", "group_t"),
    [(128, 16, 8, 8), (64, 8, 1, 1), (256, 32, 4, 4), (80, 16, 2, 2), (112, 8, 3, 4),
     (96, 32, 16, 16)],
)  # fmt: skip
def test_single_item_per_sequence_matches_reference(dtype, head_size, block_size, group, group_t):
    # Lengths around tile (32) and block edges, one past a CTA tile (128), and a 0.
    lens = [1, 31, 32, 33, block_size + 1, 129, 300, 0]
    case = make_case(
        head_size + group, lens, [1] * len(lens), num_kv_heads=2, group=group,
        head_size=head_size, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    scale = head_size**-0.5
    run = run_decode(case, whole_items(lens), group_t=group_t, scale=scale)
    want = reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        scale=scale,
    )  # fmt: skip
    check_out(run.out, want, dtype)
