"""The tensor-core prefill kernel (cuda/prefill_attention.cu) on the CPU emulator against
the torch reference: GQA, head sizes, block sizes, mixed chunks, window, soft cap, hints.

Launches are planned by :mod:`kvblocks.ops.prefill_launch`, the code the CUDA backend runs,
on CPU tensors the emulated kernel reads and writes directly (the WMMA emulation is
``cuda/emu/include/mma.h``).
"""

from __future__ import annotations

import pytest
import torch
from emu_runtime import emu_launch, library, recording
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import make_case, ref_prefill, tolerance

from kvblocks.ops import kernel_driver, prefill_launch
from kvblocks.ops.cuda_sources import MIN_SMEM_OPTIN, PREFILL_SOURCE, kernel_names

DTYPES = [torch.float16, torch.bfloat16]


def emu_prefill(case, launch=emu_launch, max_query_len=None, **kw):
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    return kernel_driver.run_prefill(
        launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=kw.get("scale"),
        sliding_window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap"),
        max_query_len=max(q_lens) if max_query_len is None else max_query_len,
        target_ctas=528,
    )  # fmt: skip


def test_every_instantiation_is_in_the_harness_with_the_planned_smem():
    lib = library()
    for name in kernel_names(PREFILL_SOURCE):
        smem = lib.kvb_emu_smem_bytes(name.encode())
        head = int(name[name.index("<") + 1 : -1].split(", ")[1])
        assert smem == prefill_launch.prefill_smem_bytes(head), name
        assert smem <= MIN_SMEM_OPTIN, f"{name} does not fit an sm_86/sm_89 CTA"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group"),
    [(64, 16, 1), (128, 8, 4), (256, 32, 8), (80, 16, 1), (96, 32, 4), (112, 8, 8)],
)
def test_mixed_chunks_match_reference(dtype, head_size, block_size, group):
    # A full prompt, extends (q_len < seq_len) across tile edges, a decode row, an idle
    # sequence (q_len = 0) and a chunk longer than one query tile.
    seq_lens, q_lens = [16, 40, 7, 33, 100], [16, 9, 0, 1, 70]
    case = make_case(3 + head_size + group, seq_lens, q_lens, num_kv_heads=2, group=group,
                     head_size=head_size, block_size=block_size, dtype=dtype)  # fmt: skip
    torch.testing.assert_close(emu_prefill(case), ref_prefill(case), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "q_lens"), [(8, [1, 3, 8, 2]), (6, [5, 1, 11, 4]), (4, [16, 1])])
def test_short_chunks_pack_gqa_heads_into_one_cta(dtype, group, q_lens):
    # Short chunks (decode-like rows, speculative extends) fill a CTA with several heads of
    # the group: rows are (query, head) pairs that share the K/V tiles.
    seq_lens = [n + 37 for n in q_lens]
    case = make_case(50 + group, seq_lens, q_lens, num_kv_heads=2, group=group, head_size=128,
                     block_size=16, dtype=dtype)  # fmt: skip
    launches = []
    got = emu_prefill(case, recording(launches))
    plan = prefill_launch.plan_prefill(
        dtype=dtype, head_size=128, num_heads=2 * group, num_kv_heads=2,
        num_seqs=len(q_lens), max_query_len=max(q_lens),
    )  # fmt: skip
    assert plan.heads_per_cta > 1 and group % plan.heads_per_cta == 0
    assert launches[0].grid == plan.grid == (2 * plan.head_chunks, len(q_lens), plan.q_tiles)
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "sliding_window", "soft_cap"),
    [(64, 5, None), (128, None, 4.0), (256, 12, 1.5), (96, 70, None), (64, 1, 30.0)],
)
def test_window_and_soft_cap(dtype, head_size, sliding_window, soft_cap):
    # Windows narrower than a tile, wider than a query tile, one token; caps that bite.
    case = make_case(21 + head_size, [150, 30, 90], [130, 12, 1], num_kv_heads=1, group=2,
                     head_size=head_size, block_size=8, dtype=dtype)  # fmt: skip
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap, "scale": 0.3}
    torch.testing.assert_close(emu_prefill(case, **kw), ref_prefill(case, **kw),
                               **tolerance(dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_running_max_jumps_rescale_the_accumulators(dtype):
    # Later keys score far above the first tiles' (by more than 2^8 in P), so the lazy
    # rescale of the output fragments must run, several times and for some rows only.
    case = make_case(77, [200, 140], [200, 60], num_kv_heads=1, group=1, head_size=64,
                     block_size=16, dtype=dtype)  # fmt: skip
    boost = torch.linspace(1.0, 6.0, case.key_cache.shape[0]).to(dtype)
    case.key_cache.mul_(boost.view(-1, 1, 1, 1))
    case.key_cache[0] = 50.0
    got = emu_prefill(case, scale=0.5)
    torch.testing.assert_close(got, ref_prefill(case, scale=0.5), **tolerance(dtype))


@pytest.mark.parametrize("max_query_len", [0, 1, 7, 64])
def test_understated_max_query_len_writes_every_row(max_query_len):
    # The hint shapes the grid (and the head packing); the kernel loops over query tiles
    # so every row of a longer chunk is still computed.
    case = make_case(31, [200, 70, 5], [150, 17, 5], num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    launches = []
    got = emu_prefill(case, recording(launches), max_query_len=max_query_len, sliding_window=40)
    assert launches[0].grid[2] * prefill_launch.plan_prefill(
        dtype=torch.float16, head_size=64, num_heads=8, num_kv_heads=2, num_seqs=3,
        max_query_len=max_query_len,
    ).queries_per_cta < 150  # fmt: skip
    want = ref_prefill(case, sliding_window=40)
    torch.testing.assert_close(got, want, **tolerance(torch.float16))


def test_overstated_max_query_len_idles_the_extra_tiles():
    # A hint above the longest chunk (a CUDA graph captured for longer chunks) plans fewer
    # heads per CTA and more query tiles than the chunks need: the tiles past q_len idle.
    case = make_case(32, [40, 9, 70], [3, 1, 2], num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    args = {"dtype": torch.bfloat16, "head_size": 64, "num_heads": 8, "num_kv_heads": 2,
            "num_seqs": 3}  # fmt: skip
    assert prefill_launch.plan_prefill(max_query_len=3, **args).heads_per_cta == 4
    plan = prefill_launch.plan_prefill(max_query_len=300, **args)
    assert (plan.heads_per_cta, plan.q_tiles) == (1, 3)
    got = emu_prefill(case, max_query_len=300, sliding_window=30)
    want = ref_prefill(case, sliding_window=30)
    torch.testing.assert_close(got, want, **tolerance(torch.bfloat16))


@pytest.mark.parametrize(
    ("dtype", "head_size", "group", "short"),
    [(torch.float16, 128, 32, [3, 1, 2]), (torch.bfloat16, 256, 64, [1, 1, 1])],
)
def test_mqa_sized_groups(dtype, head_size, group, short):
    # Short chunks pack every head of a 32/64-head group into one CTA (4 queries of 128
    # rows, 1 of 64 rows); a longer chunk takes one head per CTA, in `group` head chunks.
    args = {"dtype": dtype, "head_size": head_size, "num_heads": group, "num_kv_heads": 1}
    for seed, seq_lens, q_lens, heads_per_cta in (
        (61, [40, 9, 17], short, group), (62, [90, 33], [70, 5], 1),
    ):  # fmt: skip
        case = make_case(seed, seq_lens, q_lens, num_kv_heads=1, group=group,
                         head_size=head_size, block_size=16, dtype=dtype)  # fmt: skip
        plan = prefill_launch.plan_prefill(num_seqs=len(q_lens), max_query_len=max(q_lens), **args)
        assert plan.heads_per_cta == heads_per_cta
        torch.testing.assert_close(emu_prefill(case), ref_prefill(case), **tolerance(dtype))


def test_out_of_range_block_ids_read_the_null_block():
    # Corrupt ids (past the cache, negative) read block 0, never out of bounds (the ASan
    # build runs this too).
    case = make_case(5, [60, 20], [60, 20], num_kv_heads=1, group=2, block_size=8,
                     dtype=torch.bfloat16)  # fmt: skip
    bad = case.block_tables.clone()
    bad[0, 1] = 10_000
    bad[1, 2] = -7
    good = case.block_tables
    case.block_tables = bad
    got = emu_prefill(case)
    case.block_tables = good.clone()
    case.block_tables[0, 1] = 0
    case.block_tables[1, 2] = 0
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(torch.bfloat16))


def test_query_start_loc_past_the_tokens_is_clamped():
    case = make_case(22, [30, 20], [10, 6], num_kv_heads=1, group=2, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    bad = case.query_start_loc.clone()
    bad[-1] = 1000
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables, bad,
        case.seq_lens, scale=None, sliding_window=None, soft_cap=None, max_query_len=16,
        target_ctas=528,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_with_a_small_scale(dtype):
    # Raw dot products in the thousands, scaled down to a few units: the running max must
    # be kept in scaled units (in raw ones every P would underflow to 0).
    case = make_case(13, [100, 40], [100, 9], num_kv_heads=1, group=2, head_size=64,
                     dtype=dtype)  # fmt: skip
    case.key_cache.mul_(30.0)
    case.key_cache[0] = 50.0
    got = emu_prefill(case, scale=0.01)
    torch.testing.assert_close(got, ref_prefill(case, scale=0.01), **tolerance(dtype))


@pytest.mark.parametrize("scale", [0.0, -0.4])
def test_non_positive_scale_still_matches(scale):
    # The front-ends refuse such scales; the kernel still computes them (the scale is
    # folded into the exponent only when positive).
    case = make_case(9, [90, 30], [90, 7], num_kv_heads=1, group=2, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    got = emu_prefill(case, scale=scale)
    torch.testing.assert_close(got, ref_prefill(case, scale=scale), **tolerance(torch.bfloat16))


def test_fp32_keeps_the_cuda_core_kernel():
    case = make_case(8, [40, 9], [40, 3], num_kv_heads=1, group=2, head_size=64)
    launches = []
    got = emu_prefill(case, recording(launches))
    assert [item.name.split("<")[0] for item in launches] == ["split_k_attention_kernel"]
    torch.testing.assert_close(got, ref_prefill(case), **tolerance(torch.float32))


def test_plan_longest_tiles_first_and_grid_limits():
    from kvblocks.errors import InvalidArgumentError

    args = {"dtype": torch.bfloat16, "head_size": 128, "num_heads": 32, "num_kv_heads": 8}
    plan = prefill_launch.plan_prefill(num_seqs=3, max_query_len=1000, **args)
    assert (plan.heads_per_cta, plan.queries_per_cta) == (1, 128)
    assert plan.grid == (8 * 4, 3, 8)  # query tiles in z: issued last-dimension-slowest
    assert prefill_launch.plan_prefill(num_seqs=1, max_query_len=1 << 30, **args).grid[2] == 65535
    head256 = prefill_launch.plan_prefill(num_seqs=1, max_query_len=1, **{**args, "head_size": 256})
    assert (head256.rows, head256.heads_per_cta) == (64, 4)
    with pytest.raises(InvalidArgumentError, match="65535"):
        prefill_launch.plan_prefill(num_seqs=65536, max_query_len=1, **args)
    with pytest.raises(InvalidArgumentError, match="fp16/bf16"):
        prefill_launch.plan_prefill(num_seqs=1, max_query_len=1, **{**args, "dtype": torch.float32})


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    data=st.data(),
    block_size=st.sampled_from([8, 16, 32]),
    head_size=st.sampled_from([64, 80, 96, 112, 128, 256]),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    dtype=st.sampled_from(DTYPES),
    sliding_window=st.one_of(st.none(), st.integers(1, 90)),
    soft_cap=st.one_of(st.none(), st.floats(0.5, 50.0)),
)
def test_random_batches_match_reference(
    data, block_size, head_size, group, dtype, sliding_window, soft_cap
):
    """Random mixed batches: idle sequences, decode rows, extends, whole prompts, and a
    max_query_len hint anywhere from 0 to the truth."""
    seq_lens = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=4))
    q_lens = [data.draw(st.integers(0, n)) for n in seq_lens]
    if not sum(q_lens):
        q_lens[0], seq_lens[0] = 1, max(1, seq_lens[0])
    case = make_case(
        data.draw(st.integers(0, 2**16)), seq_lens, q_lens, num_kv_heads=2, group=group,
        head_size=head_size, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    hint = data.draw(st.integers(0, max(q_lens)))
    torch.testing.assert_close(
        emu_prefill(case, max_query_len=hint, **kw), ref_prefill(case, **kw), **tolerance(dtype)
    )


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "head_size"), [(torch.bfloat16, 128), (torch.bfloat16, 256)])
def test_long_prompts(dtype, head_size):
    # A whole prompt of a thousand tokens (16 query tiles, up to 32 K/V tiles each) and an
    # extend behind a long context (emulated tensor cores are slow: every lane computes
    # the whole tile).
    case = make_case(99, [1024, 1500], [1024, 100], num_kv_heads=1, group=1,
                     head_size=head_size, block_size=32, dtype=dtype)  # fmt: skip
    torch.testing.assert_close(emu_prefill(case), ref_prefill(case), **tolerance(dtype))
