"""``decode_attention_kernel`` / ``merge_partials_kernel`` (cuda/decode_attention.cu) in the
CPU emulator with hand-built item plans, against fp32 torch math on the cache's values
(and :func:`kvblocks.ops.reference.paged_attention` for whole sequences); plus the
emulated cp.async pipeline the kernel relies on."""

from __future__ import annotations

import ctypes

import emu_decode_shards
import numpy as np
import pytest
import torch
from decode_kernel_cases import expected_out, expected_partial, run_decode, run_merge
from emu_runtime import emu_launch, library
from ops_cases import make_case, ref_decode, tolerance

from kvblocks.ops.cuda_sources import (
    DECODE_SOURCE,
    MIN_SMEM_OPTIN,
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
            ctype, head, block, group_t, *stages = name[name.index("<") + 1 : -1].split(", ")
            dtype = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16}[ctype]
            args = (dtype, int(head), int(block), int(group_t), *map(int, stages))
            assert decode_smem_bytes(*args) == smem, name
            assert smem <= 163 * 1024, f"{name} does not fit an A100 CTA"
            if stages:
                assert smem <= MIN_SMEM_OPTIN, f"{name} does not fit an sm_86/sm_89 CTA"


# An instantiation the emulator's opt build compiles at -O0 (emu_decode_shards.py: no other
# test launches it): the unoptimized shard's kernels match the reference too.
COLD = (96, 8, 1, 1)


def test_the_decode_shards_split_every_decode_instantiation():
    """emu_decode_shards.py mirrors harness.cpp's decode shards: every instantiation of the
    decode source, once, the launched ones at -O2 and the rest (COLD's among them) at -O0."""
    every = emu_decode_shards.every_kernel()
    assert sorted(every) == sorted(kernel_names(DECODE_SOURCE)) and len(set(every)) == len(every)
    assert set(emu_decode_shards.HOT) < set(every)
    hot, cold = emu_decode_shards.shard_headers()
    assert hot.count("\n") + cold.count("\n") == len(every)
    for ctype in ("__half", "__nv_bfloat16"):
        head, block, _, group_t = COLD
        name = f"decode_attention_kernel<{ctype}, {head}, {block}, {group_t}>"
        assert name in every and name not in emu_decode_shards.HOT


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group", "group_t"),
    [(128, 16, 8, 8), (64, 8, 1, 1), (256, 32, 4, 4), (80, 16, 2, 2), (112, 8, 3, 4),
     (96, 32, 16, 16), COLD],
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
    want = ref_decode(case, scale=scale)
    check_out(run.out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "group"), [(64, 1), (128, 4), (256, 8)])
def test_splits_and_merge(dtype, head_size, group):
    """Several items per sequence with partial slots (uneven, unaligned cuts, one empty
    split), merged by merge_partials_kernel; a sequence with one item writes out itself."""
    lens = [700, 45, 300]
    block_size = 16
    case = make_case(
        7 + head_size, lens, [1] * len(lens), num_kv_heads=2, group=group,
        head_size=head_size, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    scale = 0.11
    items = [
        (0, 0, 129, 0), (0, 129, 130, 1), (0, 130, 517, 2), (0, 517, 517, 3), (0, 517, 700, 4),
        (1, 0, 45, -1),
        (2, 0, 160, 5), (2, 160, 300, 6),
    ]  # fmt: skip
    run = run_decode(case, items, group_t=decode_group(group), scale=scale, num_slots=7)
    for seq, begin, end, slot in items:
        if slot < 0:
            continue
        acc, m, total = expected_partial(case, seq, begin, end, scale)
        got_m, got_l = run.part_ml[slot, :, 0], run.part_ml[slot, :, 1]
        if end == begin:
            assert torch.isneginf(got_m).all() and (got_l == 0).all()
            assert (run.part_out[slot] == 0).all()
            continue
        # The kernel's partial is relative to its own max; compare at a common scale.
        torch.testing.assert_close(got_m, m, rtol=0, atol=0.05)
        scale_to_ref = torch.exp2(got_m - m)
        torch.testing.assert_close(got_l * scale_to_ref, total, rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(
            run.part_out[slot] * scale_to_ref[:, None], acc, rtol=2e-2, atol=2e-2
        )
    assert torch.isnan(run.out[[0, 2]]).all()  # not written before the merge
    run_merge(case, run, [0, 5, 5, 7])
    want = ref_decode(case, scale=scale)
    check_out(run.out, want, dtype)


def decode_group(group: int) -> int:
    return next(g for g in (1, 2, 4, 8, 16) if g >= group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "group", "window", "soft_cap"),
                         [(16, 8, None, 0.0), (8, 3, 45, 4.0), (32, 1, None, 0.0)])  # fmt: skip
def test_one_buffer_variant_matches_reference(dtype, block_size, group, window, soft_cap):
    """STAGES 1 (keys, then the same tile's values, through one buffer per warp: what fits
    a 99 KiB CTA at head 256) over whole sequences, windows and splits merged."""
    lens = [1, 33, 129, 300, 0, 700]
    case = make_case(
        block_size + group, lens, [1] * len(lens), num_kv_heads=2, group=group, head_size=256,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    scale = 0.07
    items = [(s, max(0, n - window) if window else 0, n, -1) for s, n in enumerate(lens[:5])]
    begin, cut = (700 - window, 680) if window else (0, 257)
    items += [(5, begin, cut, 0), (5, cut, 700, 1)]  # the last sequence in two splits
    run = run_decode(case, items, group_t=decode_group(group), scale=scale, num_slots=2,
                     soft_cap=soft_cap, stages=1)  # fmt: skip
    run_merge(case, run, [0, 0, 0, 0, 0, 0, 2])
    want = ref_decode(case, scale=scale, sliding_window=window, soft_cap=soft_cap or None)
    check_out(run.out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "window", "soft_cap"), [(8, 37, 0.0), (32, 100, 5.0),
                                                                 (16, 1, 2.0)])  # fmt: skip
def test_window_items_and_soft_cap(dtype, block_size, window, soft_cap):
    """Items that start inside a tile (a sliding window: kv_begin = len - window) and a
    soft cap, against the reference's own window and cap."""
    lens = [260, 37, 5, 1000]
    case = make_case(
        block_size + window, lens, [1] * len(lens), num_kv_heads=1, group=8, head_size=128,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    items = [(s, max(0, n - window), n, -1) for s, n in enumerate(lens)]
    run = run_decode(case, items, group_t=8, scale=0.09, soft_cap=soft_cap)
    want = ref_decode(case, scale=0.09, sliding_window=window, soft_cap=soft_cap or None)
    check_out(run.out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_items_and_grid_tail(dtype):
    """Empty ranges write zeros (out) or (-inf, 0) and zero partials; CTAs past *num_items
    (whose item slots hold garbage) touch nothing."""
    case = make_case(3, [40, 40], [1, 1], num_kv_heads=2, group=4, head_size=64, dtype=dtype)
    items = [(0, 10, 10, -1), (1, 30, 5, 0)]
    run = run_decode(case, items, group_t=4, scale=0.1, num_slots=2, spare_ctas=3)
    assert (run.out[0] == 0).all()
    assert torch.isnan(run.out[1]).all()
    assert torch.isneginf(run.part_ml[0, :, 0]).all() and (run.part_ml[0, :, 1] == 0).all()
    assert (run.part_out[0] == 0).all()
    assert torch.isnan(run.part_out[1]).all() and torch.isnan(run.part_ml[1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_range_plan_fields_are_clamped(dtype):
    """A bad plan or table gives wrong numbers, never an out-of-bounds access (the ASan run
    of this test checks the never): block ids outside the cache read block 0 (the null
    block), sequences and key ranges are clamped."""
    lens = [64, 50, 30]
    case = make_case(5, lens, [1] * 3, num_kv_heads=2, group=2, head_size=64, dtype=dtype,
                     block_size=16)  # fmt: skip
    case.block_tables[1, 1] = 10_000
    case.block_tables[1, 2] = -7
    # Seq 0: whole-capacity range from a negative seq; seq 2: seq 99 clamped to the last.
    items = [(1, 0, 50, -1), (-3, -100, 10**9, -1), (99, 0, 64, -1)]
    run = run_decode(case, items, group_t=2, scale=0.1)
    assert torch.isfinite(run.out.float()).all()
    null_k, null_v = case.key_cache[0].float(), case.value_cache[0].float()
    keys, vals = case.dense_keys[1], case.dense_values[1]
    case.dense_keys[1] = torch.cat([keys[:, :16], null_k, null_k, keys[:, 48:]], dim=1)
    case.dense_values[1] = torch.cat([vals[:, :16], null_v, null_v, vals[:, 48:]], dim=1)
    torch.testing.assert_close(
        run.out[1].float(), expected_out(case, 1, 0, 50, 0.1), **tolerance(dtype)
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_contexts_span_table_slices(dtype):
    """8k+ keys: several 256-block table slices per item (block 8: 2048 keys a slice),
    split across items and merged, and one whole-sequence item."""
    lens = [8200, 3000]
    case = make_case(
        17, lens, [1, 1], num_kv_heads=1, group=8, head_size=128, block_size=8, dtype=dtype,
    )  # fmt: skip
    items = [(0, 0, 5000, 0), (0, 5000, 8200, 1), (1, 0, 3000, -1)]
    run = run_decode(case, items, group_t=8, scale=128**-0.5, num_slots=2)
    run_merge(case, run, [0, 2, 2])
    want = ref_decode(case, scale=128**-0.5)
    check_out(run.out, want, dtype)


def test_a_launch_with_too_little_shared_memory_is_refused():
    """The harness refuses (rather than overruns) a launch below the kernel's kSmemBytes."""
    lib = library()
    name = "decode_attention_kernel<__half, 64, 16, 8>"
    need = lib.kvb_emu_smem_bytes(name.encode())
    grid = (ctypes.c_uint * 3)(1, 1, 1)
    block = (ctypes.c_uint * 3)(128, 1, 1)
    args = (ctypes.c_void_p * 18)()
    assert lib.kvb_emu_launch(name.encode(), grid, block, need - 16, args) == -2
