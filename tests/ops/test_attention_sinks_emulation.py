"""Attention sinks (gpt-oss) in the CUDA kernels, run on the CPU emulator against the torch
reference (:mod:`kvblocks.ops.reference`, which has the formula).

The sink joins each row's softmax denominator exactly once, where the row is normalized:
``decode_attention_kernel`` for a sequence served by one item, ``merge_partials_kernel``
for a split one (the partials never include it), ``prefill_attention_kernel`` at its final
normalization, and the split-K kernel or ``merge_splits_kernel`` likewise. Every case mixes
per-head sinks that dominate (the row's output is ~0), that vanish (-1e4: no sink), that
are comparable to the scores (the output shrinks by a visible factor) and random ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_kernel_cases import run_decode, run_merge
from emu_runtime import emu_launch, recording
from ops_cases import PagedCase, make_case, ref_decode, ref_prefill, tolerance

from kvblocks.ops import kernel_driver

DTYPES = [torch.float16, torch.bfloat16]
DOMINANT, VANISHING, COMPARABLE = 40.0, -1e4, 3.0


def make_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """fp32 ``[num_heads]``: head 0 dominant, head 1 vanishing, head 2 comparable to the
    scores, the rest random around them."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0
    sinks[:3] = torch.tensor([DOMINANT, VANISHING, COMPARABLE])
    return sinks


def check(got: torch.Tensor, case: PagedCase, want: torch.Tensor, plain: torch.Tensor) -> None:
    """``got`` matches the reference with sinks; the sinks matter (``plain``, the reference
    without them, differs on the comparable head) and the dominant head's rows are ~0."""
    dtype = case.query.dtype
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    assert got[:, 0].float().abs().max() < 1e-6, "a dominant sink leaves no output"
    shrink = (want[:, 2] - plain[:, 2]).abs().max()
    assert shrink > 0.1, "the comparable sink must change the answer for the test to bite"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_splits_merge_the_sink_once(dtype):
    """Hand-built items: a windowed sequence cut into three splits and another into two
    (merged by merge_partials_kernel), whole-sequence items that normalize themselves, an
    empty sequence; GQA 4, soft cap. A sink counted in every split, or in none, fails."""
    lens, window, cap, scale = [700, 45, 300, 0, 1], 400, 5.0, 0.11
    case = make_case(
        31, lens, [1] * len(lens), num_kv_heads=2, group=4, head_size=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    sinks = make_sinks(8, 1)
    items = [
        (0, 300, 429, 0), (0, 429, 600, 1), (0, 600, 700, 2), (1, 0, 45, -1),
        (2, 0, 160, 3), (2, 160, 300, 4), (3, 0, 0, -1), (4, 0, 1, -1),
    ]  # fmt: skip
    run = run_decode(case, items, group_t=4, scale=scale, soft_cap=cap, num_slots=5, sinks=sinks)
    run_merge(case, run, [0, 3, 3, 5, 5, 5], sinks=sinks)
    kw = {"scale": scale, "sliding_window": window, "soft_cap": cap}
    want = ref_decode(case, sinks=sinks, **kw)
    check(run.out, case, want, ref_decode(case, **kw))
    assert (run.out[3] == 0).all(), "a sequence without keys stays zeros with a sink"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_through_the_planner_and_driver(dtype):
    """kernel_driver.run_decode (DecodeAttention's plan on a small device: long sequences
    split and merged) with bf16/fp16 sink tensors the driver converts to fp32."""
    lens = [1000, 3, 260, 0]
    case = make_case(
        32, lens, [1] * len(lens), num_kv_heads=1, group=8, head_size=128, block_size=32,
        dtype=dtype,
    )  # fmt: skip
    sinks = make_sinks(8, 2).to(dtype)
    launches: list = []
    got = kernel_driver.run_decode(
        recording(launches), case.query, case.key_cache, case.value_cache, case.block_tables,
        np.array(lens, dtype=np.int32), scale=None, sliding_window=None, soft_cap=None,
        target_ctas=4, sinks=sinks,
    )  # fmt: skip
    assert [launch.name.split("<")[0] for launch in launches] == [
        "decode_attention_kernel", "merge_partials_kernel",
    ]  # fmt: skip
    check(got, case, ref_decode(case, sinks=sinks), ref_decode(case))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "window", "cap"), [(4, None, None), (2, 50, 4.0)])
def test_prefill_causal_tiles_and_chunked_prefix(dtype, group, window, cap):
    """The tensor-core prefill: a prompt longer than one query tile (causal tiles skipped),
    an extend after a cached prefix, a decode row and an idle sequence; heads 0-2 carry the
    dominant, vanishing and comparable sinks."""
    seq_lens, q_lens = [150, 90, 40, 12], [150, 30, 1, 0]
    case = make_case(
        33 + group, seq_lens, q_lens, num_kv_heads=2, group=group, head_size=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    sinks = make_sinks(2 * group, 3)
    kw = {"sliding_window": window, "soft_cap": cap, "scale": 0.2}
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, max_query_len=150, target_ctas=528,
        sinks=sinks, **kw,
    )  # fmt: skip
    check(got, case, ref_prefill(case, sinks=sinks, **kw), ref_prefill(case, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_gqa_heads_packed_in_one_cta(dtype):
    """Short chunks pack several heads of a group into a CTA (rows are (query, head)
    pairs): each row takes its own head's sink."""
    q_lens = [1, 3, 8, 2]
    seq_lens = [n + 37 for n in q_lens]
    case = make_case(34, seq_lens, q_lens, num_kv_heads=2, group=8, head_size=128,
                     block_size=16, dtype=dtype)  # fmt: skip
    sinks = make_sinks(16, 4)
    got = kernel_driver.run_prefill(
        emu_launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=None, soft_cap=None,
        max_query_len=8, target_ctas=528, sinks=sinks,
    )  # fmt: skip
    check(got, case, ref_prefill(case, sinks=sinks), ref_prefill(case))


@pytest.mark.parametrize(
    ("dtype", "q_lens"), [(torch.float32, None), (torch.float16, None), (torch.float32, [9, 1])]
)
def test_split_k_kernel_and_its_merge(dtype, q_lens):
    """The split-K kernel: fp32 decode and fp16 decode with only a max_seq_len hint (split
    into 256-token chunks on a small device, merged by merge_splits_kernel), and fp32
    prefill (unsplit: the attention kernel normalizes)."""
    seq_lens = [600, 20] if q_lens is None else [40, 20]
    case = make_case(
        35, seq_lens, q_lens or [1, 1], num_kv_heads=1, group=4, head_size=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    sinks = make_sinks(4, 5)
    launches: list = []
    kw = {"scale": None, "sliding_window": 500, "soft_cap": 8.0}
    if q_lens is None:
        got = kernel_driver.run_paged_attention(
            recording(launches), case.query, case.key_cache, case.value_cache,
            case.block_tables, case.seq_lens, max_seq_len=600, seq_lens_host=None,
            split_k_ctas=16, smem_limit=None, sinks=sinks, **kw,
        )  # fmt: skip
        assert [launch.name.split("<")[0] for launch in launches] == [
            "split_k_attention_kernel", "merge_splits_kernel",
        ]  # fmt: skip
        want, plain = ref_decode(case, sinks=sinks, **kw), ref_decode(case, **kw)
    else:
        got = kernel_driver.run_prefill(
            recording(launches), case.query, case.key_cache, case.value_cache,
            case.block_tables, case.query_start_loc, case.seq_lens, max_query_len=9,
            target_ctas=16, sinks=sinks, **kw,
        )  # fmt: skip
        assert [launch.name.split("<")[0] for launch in launches] == ["split_k_attention_kernel"]
        want, plain = ref_prefill(case, sinks=sinks, **kw), ref_prefill(case, **kw)
    check(got, case, want, plain)
