"""The torch reference ops against dense attention on the gathered K/V."""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ops_cases import PagedCase, make_case

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError


def dense_attention(
    case, scale=None, sliding_window=None, soft_cap=None, use_sdpa=True, sinks=None
) -> torch.Tensor:
    """Per-sequence dense attention (SDPA where it can express the op).

    With ``sinks`` it is transformers' gpt-oss formulation: the sink logit of each head is
    appended as one more score column, the softmax runs over all of them, and the sink's
    column is dropped before the weighted sum.
    """
    q_all = case.query.float()
    out = torch.zeros_like(q_all)
    starts = case.query_start_loc.tolist()
    head_size = q_all.shape[-1]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    for s, n in enumerate(case.seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        q = q_all[lo:hi].transpose(0, 1)  # [H, q, D]
        group = q.shape[0] // case.dense_keys[s].shape[0]
        k = case.dense_keys[s].repeat_interleave(group, 0)
        v = case.dense_values[s].repeat_interleave(group, 0)
        pos = n - (hi - lo) + torch.arange(hi - lo).unsqueeze(1)
        j = torch.arange(n).unsqueeze(0)
        mask = j <= pos
        if sliding_window is not None:
            mask &= j > pos - sliding_window
        if use_sdpa and soft_cap is None and sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            logits = (q @ k.transpose(1, 2)) * scale
            if soft_cap is not None:
                logits = soft_cap * torch.tanh(logits / soft_cap)
            logits = logits.masked_fill(~mask, float("-inf"))
            if sinks is None:
                o = torch.softmax(logits, -1) @ v
            else:
                sink_col = sinks.float()[:, None, None].expand(-1, logits.shape[1], 1)
                probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), -1)
                o = probs[..., :-1] @ v
        out[lo:hi] = o.transpose(0, 1)
    return out


def prefill(case: PagedCase, **kwargs: Any) -> torch.Tensor:
    """``ops.paged_prefill_attention`` on the whole of ``case``."""
    return ops.paged_prefill_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        **kwargs,
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [([1, 16, 17, 40], [1, 16, 5, 1]), ([15, 33, 64], [3, 33, 0]), ([100], [100])],
)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_matches_dense(block_size, seq_lens, q_lens, group):
    case = make_case(1, seq_lens, q_lens, block_size=block_size, group=group)
    torch.testing.assert_close(prefill(case), dense_attention(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 1, 7, 32])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_window_and_soft_cap_match_dense(sliding_window, soft_cap):
    case = make_case(2, [9, 48, 70], [9, 20, 1], block_size=16, group=2)
    got = prefill(case, scale=0.3, sliding_window=sliding_window, soft_cap=soft_cap)
    want = dense_attention(case, 0.3, sliding_window, soft_cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _sinks(num_heads: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return spread * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sliding_window", [None, 1, 7])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("group", [1, 4])
def test_sinks_in_prefill_match_dense(sliding_window, soft_cap, group):
    """gpt-oss sinks: a per-head logit in the denominator, with windows and soft caps."""
    case = make_case(11, [1, 9, 48, 70], [1, 9, 20, 1], block_size=8, group=group)
    sinks = _sinks(case.query.shape[1], 3)
    got = prefill(case, scale=0.3, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    want = dense_attention(case, 0.3, sliding_window, soft_cap, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The sinks matter here: without them the output is measurably different.
    plain = prefill(case, scale=0.3, sliding_window=sliding_window, soft_cap=soft_cap)
    assert (got - plain).abs().max() > 1e-2


def test_sinks_in_decode_match_dense_and_pad_zero():
    case = make_case(12, [1, 17, 0, 64], [1, 1, 0, 1], group=4)
    query = torch.zeros((4, *case.query.shape[1:]))
    query[[0, 1, 3]] = case.query
    sinks = _sinks(query.shape[1], 4)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    got = ops.paged_attention(*args, sliding_window=20, sinks=sinks)
    want = dense_attention(case, sliding_window=20, sinks=sinks)
    torch.testing.assert_close(got[[0, 1, 3]], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    # A first token (seq_len 1) sees only itself, yet the sink still takes its share:
    # the output is the value scaled by 1 / (1 + exp(sink - score)).
    k0 = case.dense_keys[0][:, 0].repeat_interleave(4, 0)
    v0 = case.dense_values[0][:, 0].repeat_interleave(4, 0)
    score = (query[0] * k0).sum(-1) / 8.0
    share = 1.0 / (1.0 + torch.exp(sinks - score))
    torch.testing.assert_close(got[0], v0 * share[:, None], rtol=1e-5, atol=1e-5)


def test_sink_extremes():
    """A very negative sink is no sink; a dominant one drives the output to zero."""
    case = make_case(13, [30, 5], [4, 5], group=2)
    heads = case.query.shape[1]
    none = prefill(case)
    faint = prefill(case, sinks=torch.full((heads,), -1e4))
    torch.testing.assert_close(faint, none, rtol=0, atol=1e-6)
    loud = prefill(case, sinks=torch.full((heads,), 1e4))
    assert loud.abs().max() < 1e-30
    # Half-precision sinks are accepted and used as fp32.
    sinks = _sinks(heads, 5)
    torch.testing.assert_close(
        prefill(case, sinks=sinks.half()), prefill(case, sinks=sinks.half().float())
    )


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that claims to be on CUDA, to reach the CUDA dispatch without a GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_cuda_dispatch_hands_sinks_to_the_kernels(monkeypatch):
    """The CUDA front-ends validate sinks and pass them to the backend (the kernels add
    them: tests/ops/test_attention_sinks_emulation.py); bad ones are refused first."""
    case = make_case(14, [20], [1], group=2)
    key_cache = case.key_cache.as_subclass(_FakeCudaTensor)
    value_cache = case.value_cache.as_subclass(_FakeCudaTensor)
    assert key_cache.is_cuda
    seen: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs["sinks"])
        return case.query

    backend = types.SimpleNamespace(paged_attention=record, paged_prefill_attention=record)
    monkeypatch.setattr(ops, "_cuda_backend", lambda: backend)
    sinks = torch.zeros(case.query.shape[1])
    ops.paged_attention(
        case.query, key_cache, value_cache, case.block_tables, case.seq_lens, sinks=sinks
    )
    ops.paged_prefill_attention(
        case.query, key_cache, value_cache, case.block_tables, case.query_start_loc,
        case.seq_lens, sinks=sinks,
    )  # fmt: skip
    assert seen == [sinks, sinks]
    with pytest.raises(InvalidArgumentError, match="sinks must be finite"):
        ops.paged_attention(
            case.query, key_cache, value_cache, case.block_tables, case.seq_lens,
            sinks=torch.full_like(sinks, math.inf),
        )  # fmt: skip
    assert len(seen) == 2


@pytest.mark.parametrize("value", [1e300, -1e300, 3.5e38])
def test_float64_sinks_beyond_float32_are_refused(value: float) -> None:
    """float64 sinks are finite but past float32's range (what every kernel and the
    reference compute in): before, 1e300 became inf and the output NaN, silently."""
    case = make_case(15, [20, 9], [1, 3], group=2)
    sinks = torch.full((case.query.shape[1],), value, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match="sinks must be finite"):
        ops.paged_prefill_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables,
            case.query_start_loc, case.seq_lens, sinks=sinks,
        )  # fmt: skip
    # The largest float32 is still a (very loud) sink: the output is zero, not NaN.
    loud = ops.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, sinks=torch.full_like(sinks, 3.4e38),
    )  # fmt: skip
    assert not loud.isnan().any() and loud.abs().max() < 1e-30


def test_decode_is_prefill_with_one_query_and_pads_zero():
    case = make_case(3, [1, 17, 0, 64], [1, 1, 0, 1], group=4)
    query = torch.zeros((4, *case.query.shape[1:]))
    query[[0, 1, 3]] = case.query
    got = ops.paged_attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        sliding_window=20,
    )
    want = dense_attention(case, sliding_window=20)
    torch.testing.assert_close(got[[0, 1, 3]], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_stale_slots_past_seq_len_do_not_leak(block_size):
    """Slots a sequence does not own yet (the tail of its last block) may hold NaN/inf."""
    # Several sequences per chunk-length group, so the shorter ones are padded.
    case = make_case(6, [5, 17, 0, 40, 2, 9, 33], [1, 1, 0, 1, 2, 3, 4], block_size=block_size)
    want = prefill(case, sliding_window=4)
    stale = torch.ones(case.key_cache.shape[0], block_size, dtype=torch.bool)
    for s, n in enumerate(case.seq_lens.tolist()):
        stale[case.block_tables[s, : -(-n // block_size)].long()] = False
        last = n // block_size
        if n % block_size:
            stale[int(case.block_tables[s, last]), n % block_size :] = True
    case.key_cache.permute(0, 2, 1, 3)[stale] = float("nan")
    case.value_cache.permute(0, 2, 1, 3)[stale] = float("inf")
    assert torch.equal(prefill(case, sliding_window=4), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_keep_dtype(dtype):
    case = make_case(4, [33], [1], dtype=dtype, head_size=128)
    got = ops.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), dense_attention(case), rtol=2e-2, atol=2e-2)


def test_reshape_and_cache_scatters_and_skips_padding():
    ((kc, vc),) = ops.allocate_kv_cache(1, 4, 8, 2, 64, torch.float32, "cpu")
    key = torch.randn(3, 2, 64)
    value = torch.randn(3, 2, 64)
    ops.reshape_and_cache(key, value, kc, vc, torch.tensor([9, -1, 31]))
    torch.testing.assert_close(kc[1, :, 1], key[0])
    torch.testing.assert_close(vc[3, :, 7], value[2])
    assert int((kc != 0).sum()) == 2 * 2 * 64
    with pytest.raises(InvalidArgumentError, match=r"\[0, 32\)"):
        ops.reshape_and_cache(key, value, kc, vc, torch.tensor([0, 1, 32]))
    with pytest.raises(InvalidArgumentError, match=r"value dtype torch\.float16 differs"):
        ops.reshape_and_cache(key, value.half(), kc, vc, torch.tensor([9, -1, 31]))
    with pytest.raises(InvalidArgumentError, match="key must be a 3-D tensor"):
        ops.reshape_and_cache(key[0], value, kc, vc, torch.tensor([9, -1, 31]))
    with pytest.raises(InvalidArgumentError, match=r"key has shape \[3, 1, 64\]"):
        ops.reshape_and_cache(key[:, :1], value, kc, vc, torch.tensor([9, -1, 31]))


def test_allocate_layers_share_one_base():
    caches = ops.allocate_kv_cache(3, 5, 16, 2, 64, torch.float16, "cpu")
    base = caches[0][0].data_ptr()
    step = caches[0][0].numel() * 2
    for layer, (k, v) in enumerate(caches):
        assert k.shape == (5, 2, 16, 64) and k.dtype == torch.float16
        assert k.data_ptr() == base + 2 * layer * step
        assert v.data_ptr() == base + (2 * layer + 1) * step
        assert not k.any()
    with pytest.raises(InvalidArgumentError, match="pin_memory applies to CPU caches"):
        ops.allocate_kv_cache(1, 5, 16, 2, 64, torch.float16, "meta", pin_memory=True)


def test_copy_blocks_all_layers():
    caches = ops.allocate_kv_cache(2, 6, 8, 1, 64, torch.float32, "cpu")
    for k, v in caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    ops.copy_blocks(caches, np.array([[1, 4], [2, 5]], dtype=np.int64))
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k[4], k0[1]) and torch.equal(v[5], v0[2])
        assert torch.equal(k[:4], k0[:4])
    with pytest.raises(InvalidArgumentError, match="destination"):
        ops.copy_blocks(caches, [[1, 6]])


def test_swap_blocks_merges_runs_and_copies():
    src = torch.randn(8, 2, 8, 64)
    dst = torch.zeros(5, 2, 8, 64)
    mapping = torch.tensor([[2, 0], [3, 1], [4, 2], [7, 4]])
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[:3], src[2:5]) and torch.equal(dst[4], src[7])
    assert not dst[3].any()
    from kvblocks.ops.block_runs import merge_block_runs

    assert merge_block_runs(mapping.numpy()) == [(2, 0, 3), (7, 4, 1)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_size": 72}, "supported head sizes are"),
        ({"block_size": 12}, "supported block sizes are"),
        ({"dtype": torch.float64}, "supported dtypes are"),
    ],
)
def test_unsupported_shapes_name_supported_values(kwargs, match):
    args = {"head_size": 64, "block_size": 16, "dtype": torch.float32} | kwargs
    with pytest.raises(InvalidArgumentError, match=match):
        ops.allocate_kv_cache(1, 4, args["block_size"], 1, args["head_size"], args["dtype"], "cpu")


def test_attention_argument_errors():
    case = make_case(5, [20], [1], group=2)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    with pytest.raises(InvalidArgumentError, match="int32"):
        ops.paged_attention(*args[:3], case.block_tables.long(), case.seq_lens)
    with pytest.raises(InvalidArgumentError, match=r"query dtype torch\.float16 differs"):
        ops.paged_attention(case.query.half(), *args[1:])
    with pytest.raises(InvalidArgumentError, match=r"query must be a 3-D tensor"):
        ops.paged_attention(case.query[0], *args[1:])
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        ops.paged_attention(case.query[:, :3], *args[1:])
    with pytest.raises(InvalidArgumentError, match="block ids"):
        ops.paged_attention(*args[:3], case.block_tables + 100, case.seq_lens)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        ops.paged_attention(*args[:4], case.seq_lens + 100)
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        ops.paged_attention(*args, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="query_start_loc"):
        ops.paged_prefill_attention(
            *args[:4], torch.tensor([0, 2], dtype=torch.int32), case.seq_lens
        )
    # The planning hints must be non-negative ints (any such value is correct).
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(InvalidArgumentError, match="max_seq_len"):
            ops.paged_attention(*args, max_seq_len=bad)
        with pytest.raises(InvalidArgumentError, match="max_query_len"):
            ops.paged_prefill_attention(
                *args[:4], torch.tensor([0, 1], dtype=torch.int32), case.seq_lens,
                max_query_len=bad,
            )  # fmt: skip
    assert ops.paged_attention(*args, max_seq_len=0).shape == case.query.shape


def test_importing_ops_needs_no_cupy_or_gpu():
    import subprocess
    import sys

    code = (
        "import sys, kvblocks.ops, kvblocks.ops.reference;"
        "assert 'cupy' not in sys.modules and 'kvblocks.ops.cuda_backend' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
