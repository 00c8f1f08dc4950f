"""The CUDA kernels executed on CPU threads (cuda/emu) against the torch reference.

The launches are planned by the same driver code the CuPy backend uses
(:mod:`kvblocks.ops.kernel_driver`), on CPU tensors whose memory the emulated kernels
read and write directly.
"""

from __future__ import annotations

import pytest
import torch
from emu_runtime import emu_launch, library, recording
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import make_case, ref_decode, ref_prefill, tolerance

import kvblocks.ops as ops
from kvblocks.ops import kernel_driver, reference
from kvblocks.ops.cuda_sources import kernel_names
from kvblocks.ops.launch_plan import split_k_smem_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def emu_decode(case, launch=emu_launch, **kw):
    target_ctas = kw.pop("target_ctas", 528)
    partition = kw.pop("partition_tokens", 256)
    return kernel_driver.run_split_k_attention(
        launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, None, max_query_len=1, max_seq_len=None, target_ctas=target_ctas,
        partition_tokens=partition, scale=kw.get("scale"),
        sliding_window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap"),
    )  # fmt: skip


def emu_prefill(case, **kw):
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    return kernel_driver.run_split_k_attention(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, case.query_start_loc, max_query_len=max(q_lens), max_seq_len=None,
        target_ctas=528, scale=kw.get("scale"), sliding_window=kw.get("sliding_window"),
        soft_cap=kw.get("soft_cap"),
    )  # fmt: skip


def test_every_instantiation_is_in_the_harness_with_the_planned_smem():
    lib = library()
    for name in kernel_names("split_k_attention.cu") + kernel_names("cache_ops.cu"):
        smem = lib.kvb_emu_smem_bytes(name.encode())
        assert smem >= 0, name
        if name.startswith("split_k_attention_kernel"):
            ctype, head, rows = name[name.index("<") + 1 : -1].split(", ")
            dtype = {"float": torch.float32, "__half": torch.float16,
                     "__nv_bfloat16": torch.bfloat16}[ctype]  # fmt: skip
            assert split_k_smem_bytes(dtype, int(head), int(rows)) == smem, name
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


@pytest.mark.parametrize(("dtype", "head_size", "group"), [(torch.float16, 128, 32),
                                                           (torch.bfloat16, 256, 64)])  # fmt: skip
def test_decode_mqa_sized_groups_span_several_head_chunks(dtype, head_size, group):
    # 32/64 query heads per KV head: the tensor-core kernel in 2 head chunks of GROUP 16
    # (head 128) or 8 of GROUP 8 (head 256, where 16 is not instantiated), split-K in
    # chunks of 8; a split sequence is merged per head.
    lens = [200, 1, 0, 37]
    case = make_case(9, lens, [1] * 4, num_kv_heads=1, group=group, head_size=head_size,
                     dtype=dtype)  # fmt: skip
    launches = []
    got = kernel_driver.run_paged_attention(
        recording(launches), case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, scale=None, sliding_window=None, soft_cap=None, max_seq_len=None,
        seq_lens_host=case.seq_lens.numpy(), split_k_ctas=528, smem_limit=None,
    )  # fmt: skip
    assert launches[0].grid[1] == group // (16 if head_size == 128 else 8)
    assert launches[-1].name.startswith("merge_partials_kernel")
    want = ref_decode(case)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    got = emu_decode(case, target_ctas=1000, partition_tokens=64)
    torch.testing.assert_close(got, want, **tolerance(dtype))


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
        "split_k_attention_kernel",
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


def _poison_unused_slots(case):
    """NaN in every cache slot no query may see (past each sequence's length in its last
    block, the null block, the spare blocks); returns the tables the kernels get, whose
    padding entries are the null block, -1, a huge id and a spare block in turn (the
    reference keeps the null block there)."""
    num_blocks, _, block_size, _ = case.key_cache.shape
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = case.block_tables.clone()
    spare = sorted(set(range(1, num_blocks)) - set(case.block_tables.flatten().tolist()))
    for s, n in enumerate(case.seq_lens.tolist()):
        owned = -(-n // block_size)
        for b in range(owned):
            used[int(tables[s, b]), : min(block_size, n - b * block_size)] = True
        for b in range(owned, tables.shape[1]):
            tables[s, b] = [0, -1, 10**6, spare[0]][(s + b) % 4]
    for cache in (case.key_cache, case.value_cache):
        cache.permute(0, 2, 1, 3)[~used] = float("nan")
    return tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_unused_cache_slots_and_table_padding_are_never_read(dtype, sliding_window):
    # Slots past a sequence's length hold whatever their block last held (kvblocks.ops.
    # reference), possibly NaN: no kernel may read one, not even for a masked score whose
    # probability is 0 (0 x NaN is NaN). Extends start mid-block; the decode lengths split
    # (the tensor-core plan on the default 4 CTAs, split-K on 64-token partitions).
    seq_lens, q_lens = [45, 300, 0, 17, 33], [12, 70, 0, 17, 1]
    case = make_case(41, seq_lens, q_lens, num_kv_heads=2, group=4, head_size=64,
                     block_size=16, dtype=dtype)  # fmt: skip
    tables = _poison_unused_slots(case)
    kw = {"scale": None, "sliding_window": sliding_window, "soft_cap": None}
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, tables, case.query_start_loc,
        case.seq_lens, max_query_len=70, target_ctas=528, **kw,
    )  # fmt: skip
    want = ref_prefill(case, sliding_window=sliding_window)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    case.query = torch.randn(len(seq_lens), 8, 64).to(dtype)
    want = ref_decode(case, sliding_window=sliding_window)
    launches = []
    got = kernel_driver.run_split_k_attention(
        recording(launches), case.query, case.key_cache, case.value_cache, tables,
        case.seq_lens, None, max_query_len=1, max_seq_len=None, target_ctas=1000,
        partition_tokens=64, **kw,
    )  # fmt: skip
    assert launches[-1].name.startswith("merge_splits_kernel")
    torch.testing.assert_close(got, want, **tolerance(dtype))
    if dtype != torch.float32:
        launches = []
        got = kernel_driver.run_paged_attention(
            recording(launches), case.query, case.key_cache, case.value_cache, tables,
            case.seq_lens, max_seq_len=None, seq_lens_host=case.seq_lens.numpy(),
            split_k_ctas=528, smem_limit=None, **kw,
        )  # fmt: skip
        merge = ["merge_partials_kernel"] if sliding_window is None else []  # a split
        assert [item.name.split("<")[0] for item in launches] == ["decode_attention_kernel", *merge]
        torch.testing.assert_close(got, want, **tolerance(dtype))
    assert not got[2].any(), "a sequence without keys yields zeros"


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
    from kvblocks.ops.launch_plan import plan_split_k

    args = {"dtype": torch.float16, "head_size": 128, "num_heads": 8, "num_kv_heads": 8,
            "max_query_len": 1, "max_seq_len": 10, "decode": True, "target_ctas": 528}  # fmt: skip
    assert plan_split_k(num_seqs=65535, **args).grid == (1, 65535, 8)
    with pytest.raises(InvalidArgumentError, match="65535"):
        plan_split_k(num_seqs=65536, **args)


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


# ---- Launch-path regressions (issue #7 items 20-22) --------------------------------------


def test_decode_with_a_too_small_max_seq_len_covers_every_token():
    # CUDA-graph replay plans from a host bound; a sequence longer than that bound must still
    # be attended in full (the last split covers the rest), not silently truncated.
    case = make_case(20, [1000, 300], [1, 1], num_kv_heads=1, group=4, head_size=128,
                     dtype=torch.float16)  # fmt: skip
    launches = []
    got = kernel_driver.run_split_k_attention(
        recording(launches), case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, None, scale=None, sliding_window=None, soft_cap=None, max_query_len=1,
        max_seq_len=600, target_ctas=1000,
    )  # fmt: skip
    assert launches[0].grid[0] == 3  # planned for 600 tokens: 3 splits of 256
    torch.testing.assert_close(got, ref_decode(case), **tolerance(torch.float16))


@pytest.mark.parametrize("max_query_len", [0, 1, 7, 16])
def test_prefill_with_a_too_small_max_query_len_writes_every_row(max_query_len):
    # The kernel loops over query tiles, so a host bound below the longest chunk (a stale
    # or CUDA-graph value) still computes every output row.
    case = make_case(21, [70, 40, 5], [50, 17, 5], num_kv_heads=2, group=2, head_size=64)
    got = kernel_driver.run_split_k_attention(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, case.query_start_loc, scale=None, sliding_window=9, soft_cap=None,
        max_query_len=max_query_len, max_seq_len=None, target_ctas=528,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_prefill(case, sliding_window=9), **tolerance(torch.float32))


def test_prefill_query_start_loc_past_the_tokens_is_clamped():
    # query_start_loc lives on the device and is not validated when max_query_len is given:
    # an end past num_tokens must not read or write outside query/out (ASan run checks it).
    case = make_case(22, [30, 20], [10, 6], num_kv_heads=1, group=2, head_size=64)
    bad = case.query_start_loc.clone()
    bad[-1] = 1000
    got = kernel_driver.run_split_k_attention(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.seq_lens, bad, scale=None, sliding_window=None, soft_cap=None, max_query_len=16,
        max_seq_len=None, target_ctas=528,
    )  # fmt: skip
    want = ref_prefill(case)
    # The first chunk is intact; the second one (clamped to the real tokens) too.
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def _misaligned_cache_pair(dtype=torch.float16):
    # Contiguous [blocks, heads, block, head] views 4 bytes past a 16-byte boundary.
    shape = (4, 1, 16, 64)
    numel = 4 * 16 * 64
    flat = torch.zeros(2 * numel + 64, dtype=dtype)
    shift = (16 - flat.data_ptr() % 16) // flat.element_size() % 8 + 2
    key_cache = flat[shift : shift + numel].view(shape)
    value_cache = flat[shift + numel : shift + 2 * numel].view(shape)
    assert key_cache.is_contiguous() and key_cache.data_ptr() % 16 == 4
    return key_cache, value_cache


def test_misaligned_caches_are_rejected_before_any_launch():
    from kvblocks.errors import InvalidArgumentError

    key_cache, value_cache = _misaligned_cache_pair()
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    query = torch.randn(1, 2, 64).to(torch.float16)
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        ops.paged_attention(query, key_cache, value_cache, tables, lens)
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        ops.paged_prefill_attention(
            query, key_cache, value_cache, tables, torch.tensor([0, 1], dtype=torch.int32), lens
        )
    kv = torch.randn(1, 1, 64).to(torch.float16)
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        ops.reshape_and_cache(kv, kv, key_cache, value_cache, torch.tensor([3]))
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        ops.copy_blocks([(key_cache, value_cache)], [[1, 2]])
    # The driver the CUDA backend uses refuses too (a second line of defence).
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        kernel_driver.run_reshape_and_cache(
            emu_launch, kv, kv, key_cache, value_cache, torch.tensor([3])
        )
