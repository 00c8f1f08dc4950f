"""The length-aware decode planner: plan invariants over random batches, and the content
check that executing its items and merging them gives the reference attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from decode_abi import LOG2E, partial_state
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import make_case, ref_decode

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.decode_plan import DecodeItems, plan_decode, visible_ranges


def check_invariants(
    lens: np.ndarray,
    plan: DecodeItems,
    *,
    window: int | None,
    target_items: int,
    max_items: int | None,
    granularity: int,
    min_chunk: int,
) -> None:
    """Every visible key covered exactly once, nothing before the window, contiguous
    slots per split sequence, the item budget kept and the chunk as small as allowed."""
    items = plan.items
    n = len(lens)
    assert items.dtype == np.int32 and items.shape == (plan.num_items, 4)
    assert plan.merge_indptr.dtype == np.int32 and plan.merge_indptr.shape == (n + 1,)
    begin, end = visible_ranges(lens, window)
    seqs = items[:, 0]
    assert np.all(np.diff(seqs) >= 0), "items grouped by sequence"
    counts = np.bincount(seqs, minlength=n)
    assert np.all(counts >= 1), "every sequence has an item"
    for s in range(n):
        mine = items[seqs == s]
        # Exactly once: consecutive ranges that tile [begin, end) with no gap or overlap.
        assert mine[0, 1] == begin[s] and mine[-1, 2] == end[s]
        assert np.array_equal(mine[1:, 1], mine[:-1, 2])
        assert np.all(mine[1:, 1] % granularity == 0), "boundaries on the granularity"
        if end[s] > begin[s]:
            assert np.all(mine[:, 2] > mine[:, 1]), "no empty item of a non-empty sequence"
        lo, hi = plan.merge_indptr[s], plan.merge_indptr[s + 1]
        if len(mine) == 1:
            assert mine[0, 3] == -1 and lo == hi
        else:
            assert np.array_equal(mine[:, 3], np.arange(lo, hi)), "contiguous slots per sequence"
    assert plan.num_slots == plan.merge_indptr[-1] == int(counts[counts > 1].sum())
    budget = target_items + n if max_items is None else min(max_items, target_items + n)
    assert plan.num_items <= max(budget, n)
    # Balance: no item longer than the chunk, and the chunk is the smallest allowed one.
    chunk = plan.chunk_tokens
    assert chunk % granularity == 0 and chunk >= min_chunk
    assert np.all(items[:, 2] - items[:, 1] <= chunk)
    smaller = chunk - granularity
    if smaller >= min_chunk:
        spans = np.where(end > begin, end - (begin - begin % granularity), 0)
        assert int(np.maximum(-(-spans // smaller), 1).sum()) > budget


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40_000), min_size=0, max_size=300),
    window=st.none() | st.integers(1, 9000),
    target_items=st.integers(1, 700),
    extra=st.none() | st.integers(0, 500),
    granularity=st.sampled_from([16, 64, 256]),
    min_chunk=st.sampled_from([1, 128, 512]),
)
def test_plan_invariants(lens, window, target_items, extra, granularity, min_chunk):
    arr = np.array(lens, dtype=np.int32)
    max_items = None if extra is None else len(lens) + extra
    plan = plan_decode(
        arr, target_items=target_items, max_items=max_items, sliding_window=window,
        granularity=granularity, min_chunk_tokens=min_chunk,
    )  # fmt: skip
    check_invariants(
        arr, plan, window=window, target_items=target_items, max_items=max_items,
        granularity=granularity, min_chunk=min_chunk,
    )  # fmt: skip


def test_one_long_sequence_among_short_ones_gets_many_splits():
    lens = np.array([32768] + [100] * 63, dtype=np.int32)
    plan = plan_decode(lens, target_items=33)  # H100 at head 128: 132 SMs x 2 CTAs / 8 KV heads
    counts = np.bincount(plan.items[:, 0])
    assert counts[0] >= 30 and np.all(counts[1:] == 1)
    assert plan.num_slots == counts[0] and plan.merge_indptr[1] == counts[0]
    # Alone, a long sequence fills the device; a full batch of long ones is not split.
    assert plan_decode(np.array([32768]), target_items=33).num_items >= 30
    assert plan_decode(np.full(256, 4096), target_items=33).num_slots == 0


def test_window_drops_whole_splits():
    lens = np.array([20000], dtype=np.int32)
    plan = plan_decode(lens, target_items=64, sliding_window=1000)
    assert plan.items[0, 1] == 19000 and plan.items[-1, 2] == 20000
    assert plan.num_items <= math.ceil(1000 / plan.chunk_tokens) + 1


def test_empty_batch_and_empty_sequences():
    plan = plan_decode(np.zeros(0, dtype=np.int32), target_items=8)
    assert plan.items.shape == (0, 4) and plan.merge_indptr.tolist() == [0]
    plan = plan_decode(np.array([0, 5, 0]), target_items=8)
    assert plan.items.tolist() == [[0, 0, 0, -1], [1, 0, 5, -1], [2, 0, 0, -1]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seq_lens": np.array([[1]])},
        {"seq_lens": np.array([1.0])},
        {"seq_lens": [1, 2]},
        {"seq_lens": np.array([-1])},
        {"sliding_window": 0},
        {"target_items": 0},
        {"max_items": 1},
        {"granularity": 0},
    ],
)
def test_bad_arguments_raise(kwargs):
    args = {"seq_lens": np.array([3, 4]), "target_items": 4, **kwargs}
    with pytest.raises(InvalidArgumentError):
        plan_decode(args.pop("seq_lens"), **args)


# --- content: execute the items on the dense K/V and merge by log-sum-exp ----------------


def execute_plan(case, plan: DecodeItems, *, scale: float, soft_cap: float | None) -> torch.Tensor:
    """Run each item on its key range of the dense K/V and merge per sequence."""
    num_seqs, num_heads, dim = case.query.shape
    group = num_heads // case.dense_keys[0].shape[0]
    out = torch.zeros(num_seqs, num_heads, dim)
    states: dict[int, list] = {}
    for seq, begin, end, _slot in plan.items.tolist():
        keys = case.dense_keys[seq][:, begin:end].permute(1, 0, 2).repeat_interleave(group, 1)
        vals = case.dense_values[seq][:, begin:end].permute(1, 0, 2).repeat_interleave(group, 1)
        states.setdefault(seq, []).append(
            partial_state(case.query[seq], keys, vals, scale, soft_cap or 0.0)
        )
    for seq, parts in states.items():
        acc = torch.stack([p[0] for p in parts])
        m = torch.stack([p[1] for p in parts])
        s = torch.stack([p[2] for p in parts])
        top = m.max(dim=0).values
        top = torch.where(torch.isinf(top), 0, top)
        w = torch.exp2(m - top)
        total = (w * s).sum(0)
        merged = (w[:, :, None] * acc).sum(0) / total.clamp_min(1e-30)[:, None]
        out[seq] = torch.where(total[:, None] > 0, merged, 0)
    return out


CONTENT_CASES = [
    ([3000, 40, 1, 0, 700], None, None),
    ([3000, 40, 1, 0, 700], 300, 20.0),
    ([5000, 17, 257], 64, None),
]


@pytest.mark.parametrize(("lens", "window", "soft_cap"), CONTENT_CASES)
def test_executed_plan_equals_reference(lens, window, soft_cap):
    case = make_case(11, lens, [1] * len(lens), num_kv_heads=2, group=4, head_size=64)
    plan = plan_decode(
        np.array(lens), target_items=16, sliding_window=window, granularity=16, min_chunk_tokens=16
    )
    assert plan.num_slots > 0, "the case must exercise splits"
    scale = 1 / math.sqrt(64)
    got = execute_plan(case, plan, scale=scale, soft_cap=soft_cap)
    want = ref_decode(case, sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_content_check_fails_when_a_range_is_dropped():
    lens = [3000, 40, 700]
    case = make_case(12, lens, [1] * 3, num_kv_heads=2, group=4, head_size=64)
    plan = plan_decode(np.array(lens), target_items=16, granularity=16)
    want = ref_decode(case)
    keep = np.ones(plan.num_items, dtype=bool)
    keep[1] = False  # the second chunk of the long sequence
    broken = DecodeItems(plan.items[keep], plan.merge_indptr, plan.num_slots, plan.chunk_tokens)
    with pytest.raises(AssertionError):
        check_invariants(
            np.array(lens), broken, window=None, target_items=16, max_items=None,
            granularity=16, min_chunk=128,
        )  # fmt: skip
    got = execute_plan(case, broken, scale=1 / 8, soft_cap=None)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert LOG2E > 1  # partials are in log2 units, as the kernel ABI keeps them
