"""The kernels the engine launches, emulated at scale, against the torch reference: fp16/bf16
decode through the length-aware plan (``decode_attention_kernel``, its splits merged by
``merge_partials_kernel``), fp16/bf16 prefill on ``prefill_attention_kernel``, and fp32 (the
CUDA-core kernel, what fp32 engines launch): large batches with mixed lengths, 8k-32k
contexts in many splits, a large grid, GQA 8.

The emulator runs a block's threads as fibers and blocks on every core, and computes a
warp's WMMA product once (64 sequences x 4,096 keys of GQA-8 head-128 decode: about 5 s of
CPU per KV head, against 53 s before); the largest cases are marked ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from emu_runtime import emu_launch, recording
from ops_cases import make_case, ref_decode, ref_prefill, tolerance

from kvblocks.ops import kernel_driver


def mixed_lengths(seed: int, n: int, longest: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (n,), generator=gen).tolist()
    lens[0] = longest  # the batch maximum is always present
    lens[1] = 0  # a padded row
    return lens


def decode_case(lens, *, dtype, group, num_kv_heads=1, head_size=128, block_size=16, seed=0):
    case = make_case(
        seed, lens, [int(n > 0) for n in lens], num_kv_heads=num_kv_heads, group=group,
        head_size=head_size, block_size=block_size, dtype=dtype, dense=False,
    )  # fmt: skip
    query = torch.zeros((len(lens), *case.query.shape[1:]), dtype=dtype)
    query[[i for i, n in enumerate(lens) if n]] = case.query
    case.query = query
    return case


def check_planned_decode(lens, *, dtype, group, target_ctas, **kw):
    """Decode as the engine runs it (host lengths: plan, attention, merge); returns the
    launches."""
    window, cap = kw.pop("sliding_window", None), kw.pop("soft_cap", None)
    case = decode_case(lens, dtype=dtype, group=group, **kw)
    launches = []
    got = kernel_driver.run_decode(
        recording(launches), case.query, case.key_cache, case.value_cache, case.block_tables,
        np.array(lens, dtype=np.int32), scale=None, sliding_window=window, soft_cap=cap,
        target_ctas=target_ctas,
    )  # fmt: skip
    want = ref_decode(case, sliding_window=window, soft_cap=cap)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert not got[[i for i, n in enumerate(lens) if not n]].any()
    return launches


def test_decode_batch_64_mixed_lengths_gqa8_bf16():
    launches = check_planned_decode(mixed_lengths(1, 64, 1200), dtype=torch.bfloat16, group=8,
                                    target_ctas=16)  # fmt: skip
    names = [item.name.split("<")[0] for item in launches]
    assert names == ["decode_attention_kernel", "merge_partials_kernel"]
    assert launches[0].grid[0] > 64  # the longest sequences were split


def test_decode_8k_context_many_splits_bf16():
    # One long sequence and a short one, one KV head: the plan cuts the long one into many
    # items, merged by log-sum-exp.
    launches = check_planned_decode([8192, 100], dtype=torch.bfloat16, group=8, target_ctas=64)
    assert launches[0].grid[0] >= 32 and launches[1].name.startswith("merge_partials_kernel")


def test_decode_large_grid_short_sequences():
    launches = check_planned_decode(mixed_lengths(2, 1500, 40), dtype=torch.float16, group=4,
                                    num_kv_heads=2, head_size=64, block_size=8,
                                    target_ctas=528)  # fmt: skip
    assert launches[0].grid[0] >= 1500


def test_prefill_long_chunk_gqa8_bf16():
    seq_lens, q_lens = [700, 300, 64, 1], [512, 300, 1, 1]
    case = make_case(3, seq_lens, q_lens, num_kv_heads=1, group=8, head_size=128,
                     dtype=torch.bfloat16, dense=False)  # fmt: skip
    launches = []
    got = kernel_driver.run_prefill(
        recording(launches), case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=None, soft_cap=None,
        max_query_len=512, target_ctas=528,
    )  # fmt: skip
    assert [item.name.split("<")[0] for item in launches] == ["prefill_attention_kernel"]
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(torch.bfloat16))


@pytest.mark.slow
def test_decode_64_sequences_of_4096_keys_gqa8_head128():
    # Issue 19's case (there 413 s on one thread; about 5 s of CPU per KV head now).
    launches = check_planned_decode([4096] * 64, dtype=torch.float16, group=8, num_kv_heads=2,
                                    target_ctas=264)  # fmt: skip
    assert launches[0].name.startswith("decode_attention_kernel<__half, 128, 16, 8>")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_32k_context_128_splits_soft_cap(dtype):
    launches = check_planned_decode([32768, 20000, 5], dtype=dtype, group=8, target_ctas=256,
                                    soft_cap=30.0)  # fmt: skip
    assert launches[0].grid[0] >= 128


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [None, 1000])
def test_decode_batch_256_mixed_lengths_gqa8(sliding_window):
    check_planned_decode(mixed_lengths(4, 256, 4000), dtype=torch.bfloat16, group=8,
                         num_kv_heads=2, target_ctas=2048,
                         sliding_window=sliding_window)  # fmt: skip


@pytest.mark.slow
def test_decode_16k_contexts_batch_8_fp32():
    # fp32 engines launch the CUDA-core split-K kernel (planned from max_seq_len).
    lens = [16384, 12000, 9000, 8192, 8191, 4097, 1, 0]
    case = decode_case(lens, dtype=torch.float32, group=8, head_size=256, block_size=32)
    got = kernel_driver.run_split_k_attention(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, None, max_query_len=1, max_seq_len=None, target_ctas=4096,
        scale=None, sliding_window=None, soft_cap=None,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_decode(case), **tolerance(torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "head_size"), [(torch.bfloat16, 128), (torch.float16, 256)])
def test_prefill_batch_64_mixed_chunks(dtype, head_size):
    gen = torch.Generator().manual_seed(5)
    seq_lens = torch.randint(1, 1500, (64,), generator=gen).tolist()
    q_lens = [int(torch.randint(0, min(n, 200) + 1, (1,), generator=gen)) for n in seq_lens]
    case = make_case(6, seq_lens, q_lens, num_kv_heads=2, group=4, head_size=head_size,
                     dtype=dtype, dense=False)  # fmt: skip
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=256, soft_cap=None,
        max_query_len=max(q_lens), target_ctas=528,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_prefill(case, sliding_window=256), **tolerance(dtype))


@pytest.mark.slow
def test_prefill_whole_prompts_of_2048_tokens_bf16():
    case = make_case(8, [2048, 1500], [2048, 1500], num_kv_heads=1, group=8, head_size=128,
                     dtype=torch.bfloat16, dense=False)  # fmt: skip
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=None, soft_cap=None,
        max_query_len=2048, target_ctas=528,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(torch.bfloat16))
