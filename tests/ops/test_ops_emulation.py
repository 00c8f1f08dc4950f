"""The CUDA kernels executed on CPU threads (cuda/emu) against the torch reference.

The launches are planned by the same driver code the CuPy backend uses
(:mod:`kvblocks.ops.kernel_driver`), on CPU tensors whose memory the emulated kernels
read and write directly.
"""

from __future__ import annotations

import pytest
import torch
from emu_runtime import emu_launch, library
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import make_case, tolerance

import kvblocks.ops as ops
from kvblocks.ops import kernel_driver, reference
from kvblocks.ops.cuda_sources import kernel_names
from kvblocks.ops.launch_plan import attention_smem_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def recording(launches):
    """A launcher that runs each launch at once (workspaces die with the call) and logs it."""

    def launch(item):
        launches.append(item)
        emu_launch(item)

    return launch


def emu_decode(case, launch=emu_launch, **kw):
    target_ctas = kw.pop("target_ctas", 528)
    partition = kw.pop("partition_tokens", 256)
    return kernel_driver.run_attention(
        launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, None, max_query_len=1, max_seq_len=None, target_ctas=target_ctas,
        partition_tokens=partition, scale=kw.get("scale"),
        sliding_window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap"),
    )  # fmt: skip


def emu_prefill(case, **kw):
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    return kernel_driver.run_attention(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, case.query_start_loc, max_query_len=max(q_lens), max_seq_len=None,
        target_ctas=528, scale=kw.get("scale"), sliding_window=kw.get("sliding_window"),
        soft_cap=kw.get("soft_cap"),
    )  # fmt: skip


def ref_decode(case, **kw):
    return reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, **kw
    )


def ref_prefill(case, **kw):
    return reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, **kw,
    )  # fmt: skip


def test_every_instantiation_is_in_the_harness_with_the_planned_smem():
    lib = library()
    for name in kernel_names("paged_attention.cu") + kernel_names("cache_ops.cu"):
        smem = lib.kvb_emu_smem_bytes(name.encode())
        assert smem >= 0, name
        if name.startswith("paged_attention_kernel"):
            ctype, head, rows = name[name.index("<") + 1 : -1].split(", ")
            dtype = {"float": torch.float32, "__half": torch.float16,
                     "__nv_bfloat16": torch.bfloat16}[ctype]  # fmt: skip
            assert attention_smem_bytes(dtype, int(head), int(rows)) == smem, name
            assert smem <= 48 * 1024, f"{name} needs opt-in shared memory"


# Sequence lengths around block/tile edges: 1, block-1, block, block+1, several tiles.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group"),
    [(64, 16, 1), (80, 8, 4), (96, 32, 2), (112, 16, 3), (128, 16, 8), (256, 32, 2)],
)
def test_decode_matches_reference(dtype, head_size, block_size, group):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    case = make_case(
        head_size + block_size + group, lens, [1] * len(lens), num_kv_heads=1, group=group,
        head_size=head_size, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    got = emu_decode(case)
    torch.testing.assert_close(got, ref_decode(case), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 5, 16])
def test_decode_gqa_ratios_and_head_chunks(dtype, group):
    # group 16 > 8 rows per decode CTA: two head chunks per KV head.
    case = make_case(7, [40, 9], [1, 1], num_kv_heads=2, group=group, dtype=dtype)
    torch.testing.assert_close(emu_decode(case), ref_decode(case), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, 3.0), (17, None), (40, 2.0)])
def test_decode_split_k_window_soft_cap(dtype, sliding_window, soft_cap):
    # A high CTA target forces split-K; 64-token partitions keep the emulation quick; lengths
    # below, at and across partition edges (and a padded seq_len 0) are covered.
    lens = [130, 64, 65, 1, 200, 0]
    case = make_case(11, lens, [int(n > 0) for n in lens], num_kv_heads=2, group=2,
                     dtype=dtype, block_size=16)  # fmt: skip
    query = torch.zeros((len(lens), *case.query.shape[1:]), dtype=dtype)
    query[[i for i, n in enumerate(lens) if n]] = case.query
    case.query = query
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap, "scale": 0.2}
    launches = []
    got = emu_decode(case, recording(launches), target_ctas=1000, partition_tokens=64, **kw)
    assert [item.name.split("<")[0] for item in launches] == [
        "paged_attention_kernel",
        "merge_splits_kernel",
    ]
    assert launches[0].grid[0] == 4  # ceil(200 / 64) splits
    torch.testing.assert_close(got, ref_decode(case, **kw), **tolerance(dtype))
    assert not got[5].any()


def test_decode_split_k_real_partition():
    case = make_case(12, [600, 257], [1, 1], num_kv_heads=1, group=4, head_size=128,
                     dtype=torch.float16)  # fmt: skip
    launches = []
    got = emu_decode(case, recording(launches), target_ctas=1000)
    assert launches[0].grid[0] == 3  # 600 tokens -> 3 partitions of 256
    torch.testing.assert_close(got, ref_decode(case), **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group", "seq_lens", "q_lens"),
    [
        (64, 16, 1, [16, 40, 7, 33], [16, 9, 0, 1]),
        (128, 8, 4, [23, 17], [23, 5]),
        (256, 32, 2, [33, 1], [3, 1]),
        (80, 16, 16, [20], [20]),
    ],
)
def test_prefill_matches_reference(dtype, head_size, block_size, group, seq_lens, q_lens):
    case = make_case(3 + head_size, seq_lens, q_lens, num_kv_heads=2, group=group,
                     head_size=head_size, block_size=block_size, dtype=dtype)  # fmt: skip
    torch.testing.assert_close(emu_prefill(case), ref_prefill(case), **tolerance(dtype))


@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(5, None), (None, 4.0), (12, 1.5)])
def test_prefill_window_and_soft_cap(sliding_window, soft_cap):
    case = make_case(21, [45, 30], [30, 12], num_kv_heads=1, group=2, head_size=96,
                     block_size=8)  # fmt: skip
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    torch.testing.assert_close(emu_prefill(case, **kw), ref_prefill(case, **kw),
                               **tolerance(torch.float32))  # fmt: skip


def test_out_of_range_block_ids_are_clamped_to_the_null_block():
    case = make_case(5, [20], [1], num_kv_heads=1, group=1, block_size=8)
    case.block_tables[0, 1] = 10_000  # a corrupt id: read block 0 instead, never out of bounds
    got = emu_decode(case)
    case.block_tables[0, 1] = 0
    torch.testing.assert_close(got, ref_decode(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 256])
def test_reshape_and_cache_matches_reference(dtype, head_size):
    gen = torch.Generator().manual_seed(head_size)
    ((kc, vc),) = ops.allocate_kv_cache(1, 6, 16, 3, head_size, dtype, "cpu")
    ((rk, rv),) = ops.allocate_kv_cache(1, 6, 16, 3, head_size, dtype, "cpu")
    qkv = torch.randn(7, 3, 3 * head_size, generator=gen).to(dtype)
    key, value = qkv[..., :head_size], qkv[..., head_size : 2 * head_size]  # strided views
    slots = torch.tensor([0, 17, -1, 95, 40, 41, -1], dtype=torch.int64)
    kernel_driver.run_reshape_and_cache(emu_launch, key, value, kc, vc, slots)
    reference.reshape_and_cache(key, value, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    # Out-of-range slots are skipped by the kernel, never written.
    kernel_driver.run_reshape_and_cache(
        emu_launch, key[:1], value[:1], kc, vc, torch.tensor([96], dtype=torch.int64)
    )
    assert torch.equal(kc, rk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_one_launch_all_layers(dtype):
    caches = ops.allocate_kv_cache(3, 7, 8, 2, 80, dtype, "cpu")
    for k, v in caches:
        k.normal_()
        v.normal_()
    want = [(k.clone(), v.clone()) for k, v in caches]
    mapping = torch.tensor([[1, 5], [2, 6], [3, 0]], dtype=torch.int64)
    launches = []
    kernel_driver.run_copy_blocks(recording(launches), caches, mapping)
    reference.copy_blocks(want, mapping)
    assert len(launches) == 1 and launches[0].grid[:2] == (3, 6)
    for (k, v), (wk, wv) in zip(caches, want, strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_copy_blocks_separate_tensors_fall_back_per_cache():
    caches = [(torch.randn(4, 1, 8, 64), torch.randn(4, 1, 8, 64)) for _ in range(2)]
    want = [(k.clone(), v.clone()) for k, v in caches]
    mapping = torch.tensor([[3, 1]], dtype=torch.int64)
    kernel_driver.run_copy_blocks(emu_launch, caches, mapping)
    reference.copy_blocks(want, mapping)
    for (k, v), (wk, wv) in zip(caches, want, strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_plan_rejects_batches_beyond_the_grid_limit():
    from kvblocks.errors import InvalidArgumentError
    from kvblocks.ops.launch_plan import plan_attention

    args = {"dtype": torch.float16, "head_size": 128, "num_heads": 8, "num_kv_heads": 8,
            "max_query_len": 1, "max_seq_len": 10, "decode": True, "target_ctas": 528}  # fmt: skip
    assert plan_attention(num_seqs=65535, **args).grid == (1, 65535, 8)
    with pytest.raises(InvalidArgumentError, match="65535"):
        plan_attention(num_seqs=65536, **args)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    data=st.data(),
    block_size=st.sampled_from([8, 16, 32]),
    head_size=st.sampled_from([64, 80, 96, 112, 128, 256]),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4, 6, 8, 9]),
    dtype=st.sampled_from(DTYPES),
    sliding_window=st.one_of(st.none(), st.integers(1, 70)),
    soft_cap=st.one_of(st.none(), st.floats(0.5, 50.0)),
)
def test_random_batches_match_reference(
    data, block_size, head_size, num_kv_heads, group, dtype, sliding_window, soft_cap
):
    """Random mixed batches (decode rows, chunks, idle sequences) through both kernels."""
    seq_lens = data.draw(st.lists(st.integers(0, 90), min_size=1, max_size=4))
    q_lens = [data.draw(st.integers(0, n)) for n in seq_lens]
    case = make_case(
        data.draw(st.integers(0, 2**16)), seq_lens, q_lens, num_kv_heads=num_kv_heads,
        group=group, head_size=head_size, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    if sum(q_lens):
        torch.testing.assert_close(
            emu_prefill(case, **kw), ref_prefill(case, **kw), **tolerance(dtype)
        )
    decode_query = torch.randn(len(seq_lens), num_kv_heads * group, head_size).to(dtype)
    case.query = decode_query
    launches = []
    got = emu_decode(case, recording(launches), target_ctas=64, partition_tokens=32, **kw)
    torch.testing.assert_close(got, ref_decode(case, **kw), **tolerance(dtype))
