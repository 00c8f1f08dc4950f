"""The real CUDA kernels (CuPy) against the torch reference; skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_cases import make_case, tolerance

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def to_cuda(case):
    moved = {
        name: getattr(case, name).cuda()
        for name in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc",
                     "seq_lens")
    }  # fmt: skip
    return moved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(dtype, head_size, block_size, group):
    lens = [1, block_size, block_size + 1, 300, 1500]
    case = make_case(head_size + group, lens, [1] * len(lens), num_kv_heads=2, group=group,
                     head_size=head_size, block_size=block_size, dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    got = ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                              dev["block_tables"], dev["seq_lens"])  # fmt: skip
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, 30.0), (100, None), (7, 5.0)])
def test_decode_split_k_long_context(dtype, sliding_window, soft_cap):
    case = make_case(5, [8000, 3000, 0], [1, 1, 0], num_kv_heads=1, group=4, head_size=128,
                     dtype=dtype)  # fmt: skip
    query = torch.zeros((3, *case.query.shape[1:]), dtype=dtype)
    query[:2] = case.query
    case.query = query
    dev = to_cuda(case)
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    got = ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                              dev["block_tables"], dev["seq_lens"], **kw)  # fmt: skip
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens, **kw)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))


MIXED_LENS = [8192, 37, 1, 0, 300, 16, 2049, 100]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, None), (1000, None), (None, 30.0)])
def test_decode_planned_gqa8_mixed_lengths(dtype, head_size, sliding_window, soft_cap):
    """The tensor-core kernel through the length-aware planner (host lengths given)."""
    lens = MIXED_LENS
    case = make_case(21, lens, [1] * len(lens), num_kv_heads=2, group=8, head_size=head_size,
                     dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    got = ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"],
                              dev["block_tables"], dev["seq_lens"],
                              seq_lens_host=np.array(lens, dtype=np.int32), **kw)  # fmt: skip
    want = reference.paged_attention(case.query, case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens, **kw)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))


def _graph_decoder(case, dtype, cuda_graph=True):
    _, num_kv_heads, block_size, head_size = case.key_cache.shape
    return ops.DecodeAttention(
        num_heads=case.query.shape[1], num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=dtype, device="cuda", max_seqs=case.query.shape[0],
        cuda_graph=cuda_graph,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_cuda_graph_replay_with_longer_sequences(dtype):
    """Capture once with short lengths; plan() longer (and other) ones and replay."""
    long_lens = MIXED_LENS
    case = make_case(22, long_lens, [1] * len(long_lens), num_kv_heads=8, group=8,
                     head_size=128, dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    dec = _graph_decoder(case, dtype)
    out = torch.empty_like(dev["query"])
    short = np.array([40, 10, 1, 0, 200, 16, 3, 100], dtype=np.int32)
    dec.plan(short, dev["block_tables"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernel loading) off the capture
        dec.run(dev["query"], dev["key_cache"], dev["value_cache"], out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(dev["query"], dev["key_cache"], dev["value_cache"], out=out)
    for lens in (
        np.array(long_lens, dtype=np.int32),
        short,
        np.array(long_lens, dtype=np.int32) * 3 // 4,
    ):
        dec.plan(lens, dev["block_tables"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        case.seq_lens = torch.from_numpy(lens)
        want = reference.paged_attention(case.query, case.key_cache, case.value_cache,
                                         case.block_tables, case.seq_lens)  # fmt: skip
        torch.testing.assert_close(out.cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill(dtype, head_size, group):
    case = make_case(9, [500, 37, 16, 90], [500, 20, 0, 1], num_kv_heads=2, group=group,
                     head_size=head_size, block_size=16, dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    got = ops.paged_prefill_attention(
        dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
        dev["query_start_loc"], dev["seq_lens"], sliding_window=64,
    )  # fmt: skip
    want = reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, sliding_window=64,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize(("group", "sliding_window", "soft_cap"), [(8, None, None), (4, 200, 30.0)])
def test_prefill_tensor_core_kernel_shapes(dtype, head_size, group, sliding_window, soft_cap):
    """prefill_attention_kernel (mma.sync/ldmatrix, K/V through cp.async): prompts of many
    K/V tiles and query tiles (the two-stage K/V pipeline, causal tiles skipped), an extend
    behind a long context, short chunks whose GQA heads share a CTA, an idle sequence, a
    decode row; every head size the kernel is instantiated for."""
    seq_lens, q_lens = [1100, 1500, 9, 40, 700], [1100, 260, 9, 0, 1]
    case = make_case(30 + head_size, seq_lens, q_lens, num_kv_heads=2, group=group,
                     head_size=head_size, block_size=16, dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    got = ops.paged_prefill_attention(
        dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
        dev["query_start_loc"], dev["seq_lens"], **kw,
    )  # fmt: skip
    want = reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, **kw,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))
    # Short chunks only: several heads of a group packed into one CTA.
    short = make_case(31 + head_size, [50, 17, 90], [3, 1, 8], num_kv_heads=2, group=group,
                      head_size=head_size, block_size=16, dtype=dtype)  # fmt: skip
    dev = to_cuda(short)
    got = ops.paged_prefill_attention(
        dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
        dev["query_start_loc"], dev["seq_lens"], **kw,
    )  # fmt: skip
    want = reference.paged_prefill_attention(
        short.query, short.key_cache, short.value_cache, short.block_tables,
        short.query_start_loc, short.seq_lens, **kw,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))


def gpu_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Per-head sink logits: one dominant, one vanishing, one comparable to the scores."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0
    sinks[:3] = torch.tensor([40.0, -1e4, 3.0])
    return sinks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, None), (1000, 30.0)])
def test_attention_sinks(dtype, head_size, sliding_window, soft_cap):
    """gpt-oss's sinks in every attention kernel: decode through the planner (long
    sequences split and merged: the sink counted once), decode with only max_seq_len (the
    split-K kernel and its merge), prefill (tensor-core for fp16/bf16, split-K for fp32)."""
    lens = MIXED_LENS
    case = make_case(40 + head_size, lens, [1] * len(lens), num_kv_heads=2, group=4,
                     head_size=head_size, dtype=dtype)  # fmt: skip
    sinks = gpu_sinks(8, head_size)
    dev = to_cuda(case)
    kw = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    want = reference.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        sinks=sinks, **kw,
    )  # fmt: skip
    args = (dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
            dev["seq_lens"])  # fmt: skip
    on_gpu = sinks.cuda()
    for hint in ({"seq_lens_host": np.array(lens, dtype=np.int32)}, {"max_seq_len": 8192}):
        got = ops.paged_attention(*args, sinks=on_gpu, **hint, **kw)
        torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))
    # Found finite once (no sync on later calls), checked again after torch writes to it.
    on_gpu[3] = float("inf")
    with pytest.raises(InvalidArgumentError, match="sinks must be finite"):
        ops.paged_attention(*args, sinks=on_gpu, **kw)
    seq_lens, q_lens = [1100, 1500, 9, 40, 700], [1100, 260, 9, 0, 1]
    case = make_case(41 + head_size, seq_lens, q_lens, num_kv_heads=2, group=4,
                     head_size=head_size, block_size=16, dtype=dtype)  # fmt: skip
    dev = to_cuda(case)
    got = ops.paged_prefill_attention(
        dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
        dev["query_start_loc"], dev["seq_lens"], sinks=sinks.cuda(), **kw,
    )  # fmt: skip
    want = reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, sinks=sinks, **kw,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))
    assert got[:, 0].abs().max() < 1e-6, "a dominant sink leaves no output"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_ops(dtype):
    caches = ops.allocate_kv_cache(2, 10, 16, 4, 128, dtype, "cuda")
    ref_caches = ops.allocate_kv_cache(2, 10, 16, 4, 128, dtype, "cpu")
    key = torch.randn(33, 4, 128).to(dtype)
    value = torch.randn(33, 4, 128).to(dtype)
    slots = torch.randperm(160)[:33]
    slots[5] = -1
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        ops.reshape_and_cache(key.cuda(), value.cuda(), k, v, slots.cuda())
        ops.reshape_and_cache(key, value, rk, rv, slots)
    mapping = torch.tensor([[1, 7], [2, 8], [3, 9]])
    ops.copy_blocks(caches, mapping)
    ops.copy_blocks(ref_caches, mapping)
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        assert torch.equal(k.cpu(), rk) and torch.equal(v.cpu(), rv)
    host = torch.zeros((10, 4, 16, 128), dtype=dtype).pin_memory()
    ops.swap_blocks(caches[0][0], host, [[1, 0], [2, 1], [5, 4]])
    torch.cuda.synchronize()
    assert torch.equal(host[[0, 1, 4]], ref_caches[0][0][[1, 2, 5]])
