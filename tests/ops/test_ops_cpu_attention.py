"""The fast CPU path (``ops.cpu_attention``, ``ops.cpu_cache``) against the torch reference.

``kvblocks.ops`` runs the fast path for CPU tensors; ``kvblocks.ops.reference`` is the
plain statement of the semantics. Every case here computes both and holds them to fp32
rounding (1e-5): decode, prefill, chunked prefill and mixed batches, GQA, per-layer
sliding windows on one plan, soft-caps, attention sinks, every block size with lengths
off the block boundaries, empty and one-token contexts, stale slots holding NaN/inf, and
the cache write. Decodes run two ways, both held to the reference: the native kernel
(:func:`kvblocks._core.paged_decode_attention`, fp32 caches) and the torch buckets
(``native_decode=False``, and what fp16/bf16 caches take).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from ops_cases import PagedCase, make_case, ref_prefill

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import reference
from kvblocks.ops.cpu_attention import CpuAttentionPlan, length_buckets
from kvblocks.ops.cpu_cache import CpuCacheSlots

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return 3.0 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


def _variants(num_heads: int) -> list[dict[str, object]]:
    """Layer parameters: plain, scaled, windows, soft-cap, sinks and all at once."""
    return [
        {},
        {"scale": 0.3},
        {"sliding_window": 1},
        {"sliding_window": 7},
        {"soft_cap": 2.0},
        {"sinks": _sinks(num_heads, 1)},
        {"scale": 0.2, "sliding_window": 9, "soft_cap": 3.0, "sinks": _sinks(num_heads, 2)},
    ]


def _prefill_plan(case: PagedCase, *, native_decode: bool = True) -> CpuAttentionPlan:
    num_blocks, num_kv_heads, block_size, _ = case.key_cache.shape
    return CpuAttentionPlan.for_prefill(
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        native_decode=native_decode,
    )


def _decode_plan(case: PagedCase, *, native_decode: bool) -> CpuAttentionPlan:
    num_blocks, num_kv_heads, block_size, _ = case.key_cache.shape
    return CpuAttentionPlan.for_decode(
        case.block_tables,
        case.seq_lens,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        native_decode=native_decode,
    )


def _decode_query(case: PagedCase, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (case.seq_lens.shape[0], *case.query.shape[1:])
    return torch.randn(shape, generator=gen).to(case.query.dtype)


# (seq_lens, q_lens): full prompts, chunk continuations, decodes, idle sequences, and
# equal-shaped chunks that share one SDPA call.
BATCHES = [
    ([1], [1]),
    ([100], [100]),
    ([1, 16, 17, 40], [1, 16, 5, 1]),
    ([15, 33, 64, 0], [3, 33, 0, 0]),
    ([20, 20, 20, 9, 9], [20, 20, 20, 4, 4]),
    ([5, 17, 40, 2, 9, 33, 70], [1, 1, 1, 2, 3, 4, 70]),
]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("seq_lens", "q_lens"), BATCHES)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_matches_reference(block_size, seq_lens, q_lens, group):
    case = make_case(7, seq_lens, q_lens, block_size=block_size, group=group)
    for kwargs in _variants(case.query.shape[1]):
        got = ops.paged_prefill_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables,
            case.query_start_loc, case.seq_lens, **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(got, ref_prefill(case, **kwargs), **TIGHT)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [0], [1, 0, 2], [16, 16, 16], [3, 17, 100, 250, 0, 1, 64, 33], list(range(1, 300, 23))],
)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("native", [True, False], ids=["native", "buckets"])
def test_decode_matches_reference(block_size, seq_lens, group, native):
    """One query per sequence; ``seq_len == 0`` rows are zero, lengths span buckets."""
    case = make_case(8, seq_lens, [0] * len(seq_lens), block_size=block_size, group=group)
    query = _decode_query(case, 9)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    plan = _decode_plan(case, native_decode=native)
    assert (plan.native is not None) == (native and any(seq_lens))
    for kwargs in _variants(query.shape[1]):
        got = plan.run(query, case.key_cache, case.value_cache, **kwargs)
        want = reference.paged_attention(*args, **kwargs)
        torch.testing.assert_close(got, want, **TIGHT)
        torch.testing.assert_close(ops.paged_attention(*args, **kwargs), want, **TIGHT)
        idle = case.seq_lens == 0
        assert torch.equal(got[idle], torch.zeros_like(got[idle]))


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 4), (2, 3), (4, 1), (1, 8)])
def test_native_decode_odd_shapes_match_reference(head_size, num_kv_heads, group):
    """Head sizes off the kernel's vector width, GQA groups of 1, 3 and 4, odd lengths."""
    lens = [1, 7, 31, 33, 0, 129, 2, 65]
    case = make_case(
        21, lens, [0] * len(lens), block_size=16, head_size=head_size,
        num_kv_heads=num_kv_heads, group=group,
    )  # fmt: skip
    query = _decode_query(case, 22)
    plan = _decode_plan(case, native_decode=True)
    assert plan.native is not None and not plan.decode
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    for kwargs in _variants(num_kv_heads * group):
        got = plan.run(query, case.key_cache, case.value_cache, **kwargs)
        torch.testing.assert_close(got, reference.paged_attention(*args, **kwargs), **TIGHT)


@pytest.mark.parametrize("threads", [1, 3])
def test_native_decode_is_the_same_on_any_thread_count(threads):
    """Work split over threads by key count: every split gives the reference's answer.

    ~7,000 keys at 8 heads of 64 are enough work (NATIVE_WORK_PER_THREAD) for 3 threads.
    """
    lens = [3000, 1, 17, 2500, 640, 3, 0, 990]
    case = make_case(23, lens, [0] * len(lens), block_size=8, group=4)
    query = _decode_query(case, 24)
    plan = _decode_plan(case, native_decode=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = plan.run(query, case.key_cache, case.value_cache, sinks=_sinks(8, 3))
    finally:
        torch.set_num_threads(before)
    want = reference.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        sinks=_sinks(8, 3),
    )  # fmt: skip
    torch.testing.assert_close(got, want, **TIGHT)


def test_native_plan_on_half_caches_falls_back_to_buckets():
    """A plan built for the native kernel still answers right on fp16 caches."""
    case = make_case(25, [40, 3, 17], [0, 0, 0], dtype=torch.float16, group=2)
    query = _decode_query(case, 26)
    plan = _decode_plan(case, native_decode=True)
    got = plan.run(query, case.key_cache, case.value_cache, soft_cap=3.0)
    want = reference.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, soft_cap=3.0
    )
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=torch.finfo(torch.float16).eps, atol=1e-5)


def test_one_plan_serves_every_layer():
    """A plan is built once per step: layers with other caches and windows reuse it."""
    case = make_case(10, [9, 48, 70, 1, 30], [9, 20, 1, 1, 1], block_size=16, group=4)
    plan = _prefill_plan(case)
    gen = torch.Generator().manual_seed(3)
    for window in (None, 8, None, 3):
        case.key_cache.normal_(generator=gen)
        case.value_cache.normal_(generator=gen)
        got = plan.run(case.query, case.key_cache, case.value_cache, sliding_window=window)
        torch.testing.assert_close(got, ref_prefill(case, sliding_window=window), **TIGHT)


def test_decode_buckets_split_by_length_and_keep_rows():
    """A batch of very different lengths runs as several buckets, rows in place."""
    lens = [1000, 3, 990, 7, 500, 0, 2, 1001]
    case = make_case(11, lens, [0] * len(lens), block_size=8, group=2)
    num_blocks, num_kv_heads, block_size, _ = case.key_cache.shape
    plan = CpuAttentionPlan.for_decode(
        case.block_tables, case.seq_lens,
        num_blocks=num_blocks, num_kv_heads=num_kv_heads, block_size=block_size,
        native_decode=False,
    )  # fmt: skip
    assert len(plan.decode) >= 3 and not plan.covers_all
    query = _decode_query(case, 12)
    got = plan.run(query, case.key_cache, case.value_cache, sinks=_sinks(4, 5))
    want = reference.paged_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        sinks=_sinks(4, 5),
    )  # fmt: skip
    torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("native", [True, False], ids=["native", "buckets"])
def test_stale_slots_past_seq_len_do_not_leak(block_size, native):
    """NaN keys and inf values past each length (and in the null block) change nothing."""
    lens, q_lens = [5, 17, 0, 40, 2, 9, 33, 31], [1, 1, 0, 1, 2, 3, 4, 1]
    case = make_case(6, lens, q_lens, block_size=block_size)
    query = _decode_query(case, 13)
    decode_args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    want_prefill = ref_prefill(case, sliding_window=4)
    want_decode = reference.paged_attention(*decode_args)
    stale = torch.ones(case.key_cache.shape[0], block_size, dtype=torch.bool)
    for s, n in enumerate(lens):
        stale[case.block_tables[s, : -(-n // block_size)].long()] = False
        if n % block_size:
            stale[int(case.block_tables[s, n // block_size]), n % block_size :] = True
    case.key_cache.permute(0, 2, 1, 3)[stale] = float("nan")
    case.value_cache.permute(0, 2, 1, 3)[stale] = float("inf")
    got_prefill = _prefill_plan(case, native_decode=native).run(
        case.query, case.key_cache, case.value_cache, sliding_window=4
    )
    torch.testing.assert_close(got_prefill, want_prefill, **TIGHT)
    decode_plan = _decode_plan(case, native_decode=native)
    got_decode = decode_plan.run(query, case.key_cache, case.value_cache)
    torch.testing.assert_close(got_decode, want_decode, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_match_reference(dtype):
    case = make_case(14, [33, 5, 70], [1, 5, 30], dtype=dtype, head_size=128, group=2)
    got = ops.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, soft_cap=4.0,
    )  # fmt: skip
    assert got.dtype == dtype
    # Both accumulate in fp32 and round once: at most one rounding step apart.
    one_step = {"rtol": torch.finfo(dtype).eps, "atol": 1e-5}
    torch.testing.assert_close(got, ref_prefill(case, soft_cap=4.0), **one_step)
    query = _decode_query(case, 15)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(
        ops.paged_attention(*args), reference.paged_attention(*args), **one_step
    )


def test_plan_rejects_what_the_reference_rejects():
    case = make_case(16, [20, 5], [3, 5], block_size=8)
    shape = {"num_blocks": case.key_cache.shape[0], "num_kv_heads": 2, "block_size": 8}
    with pytest.raises(InvalidArgumentError, match="block ids"):
        CpuAttentionPlan.for_decode(case.block_tables + 100, case.seq_lens, **shape)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        CpuAttentionPlan.for_decode(case.block_tables, case.seq_lens + 100, **shape)
    with pytest.raises(InvalidArgumentError, match="seq_lens must include the chunk"):
        CpuAttentionPlan.for_prefill(
            case.block_tables, case.query_start_loc, torch.tensor([2, 5], dtype=torch.int32),
            **shape,
        )  # fmt: skip


def _brute_force_cost(lengths: list[int], cost: int) -> float:
    """The cheapest split of the sorted lengths into contiguous buckets, by enumeration."""
    values = sorted(lengths)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(values) - 1):
        total, start = 0.0, 0
        for i in range(len(values)):
            if i == len(values) - 1 or cuts[i]:
                total += cost + (i + 1 - start) * values[i]
                start = i + 1
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_length_buckets_are_optimal_partitions(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=int(rng.integers(1, 9))) * 16
    cost = int(rng.choice([16, 64, 256, 1024]))
    buckets = length_buckets(lengths, cost)
    members = np.sort(np.concatenate(buckets))
    assert members.tolist() == list(range(lengths.size))
    total = sum(cost + b.size * lengths[b].max() for b in buckets)
    assert total == _brute_force_cost(lengths.tolist(), cost)
    assert length_buckets(np.zeros(0, dtype=np.int64)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cache_write_matches_reference(dtype, block_size):
    """Every kept token lands where the reference puts it; slot -1 writes nothing."""
    gen = torch.Generator().manual_seed(17)
    ((kc, vc),) = ops.allocate_kv_cache(1, 9, block_size, 2, 64, dtype, "cpu")
    kc.normal_(generator=gen)
    vc.normal_(generator=gen)
    rk, rv = kc.clone(), vc.clone()
    slots = torch.randperm(9 * block_size, generator=gen)[:20]
    slots[[3, 11]] = -1
    key = torch.randn(20, 2, 64, generator=gen).to(dtype)
    value = torch.randn(20, 2, 64, generator=gen).to(dtype)
    ops.reshape_and_cache(key, value, kc, vc, slots)
    reference.reshape_and_cache(key, value, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    # The same rows serve every layer of a step.
    rows = CpuCacheSlots.build(slots, num_blocks=9, num_kv_heads=2, block_size=block_size)
    ((kc2, vc2),) = ops.allocate_kv_cache(1, 9, block_size, 2, 64, dtype, "cpu")
    rows.write(key, value, kc2, vc2)
    written = torch.zeros(9 * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = kc2.permute(0, 2, 1, 3).reshape(9 * block_size, 2, 64)
    assert torch.equal(flat[written], rk.permute(0, 2, 1, 3).reshape(-1, 2, 64)[written])
    assert not flat[~written].any()
    with pytest.raises(InvalidArgumentError, match=r"\[0, "):
        CpuCacheSlots.build(
            torch.tensor([0, 9 * block_size]), num_blocks=9, num_kv_heads=2, block_size=block_size
        )


@pytest.mark.parametrize("native", [True, False], ids=["native", "buckets"])
def test_decodes_inside_a_prefill_batch_match_reference(native):
    """Decodes inside a prefill batch go natively or by buckets, prefill through SDPA."""
    case = make_case(18, [64, 1, 65, 200, 3], [64, 1, 1, 1, 3], block_size=16, group=4)
    plan = _prefill_plan(case, native_decode=native)
    assert (len(plan.decode) >= 1) != native and (plan.native is not None) == native
    assert len(plan.prefill) == 2
    got = plan.run(case.query, case.key_cache, case.value_cache, soft_cap=5.0)
    torch.testing.assert_close(got, ref_prefill(case, soft_cap=5.0), **TIGHT)


def test_native_kernel_refuses_bad_arrays_before_writing():
    """The binding's own checks: layout, shapes and ranges, ``out`` untouched.

    A Fortran-ordered array is contiguous too, and was read as if C-ordered (a silently
    wrong answer) until the binding checked the order itself.
    """
    from kvblocks._core import paged_decode_attention

    case = make_case(27, [20, 5], [0, 0], block_size=8, group=4)
    query = _decode_query(case, 28).numpy()
    kc, vc = case.key_cache.numpy(), case.value_cache.numpy()
    tables, lens = case.block_tables.numpy(), case.seq_lens.numpy()
    out = np.full_like(query, 7.0)
    bad_tables = tables.copy()
    bad_tables[0, 0] = kc.shape[0]
    calls = {
        "C-contiguous": (out, np.asfortranarray(query), kc, vc, tables, lens),
        "differ in shape": (out, query, kc, vc[:-1], tables, lens),
        "must have 2 rows": (out, query, kc, vc, tables[:1], lens),
        "outside": (out, query, kc, vc, bad_tables, lens),
        "capacity": (out, query, kc, vc, tables, lens + 1000),
    }
    for needle, args in calls.items():
        with pytest.raises(InvalidArgumentError, match=needle):
            paged_decode_attention(*args, scale=0.125)
    with pytest.raises(InvalidArgumentError, match="out must be C-contiguous"):
        paged_decode_attention(np.asfortranarray(out), query, kc, vc, tables, lens, scale=0.1)
    # numpy's borrow checker refuses an out that is an input before the kernel sees it.
    with pytest.raises(TypeError, match="borrowed"):
        paged_decode_attention(query, query, kc, vc, tables, lens, scale=0.125)
    with pytest.raises(InvalidArgumentError, match="one per query head"):
        paged_decode_attention(
            out, query, kc, vc, tables, lens, scale=0.125, sinks=np.zeros(3, np.float32)
        )
    assert (out == 7.0).all()
