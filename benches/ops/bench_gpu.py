"""GPU benchmark of the paged-attention kernels (needs a CUDA GPU and CuPy).

Decode: batch 1/32/256 x context 1k/8k/32k (fp16 and bf16, 32 query heads over 8 KV
heads (GQA 8), head size 128, block size 16): time per call of the tensor-core kernel
through the length-aware planner (``seq_lens_host``) and of the older split-K kernel
(``max_seq_len`` only) in the same run, and the achieved fraction of HBM bandwidth (K/V
bytes read / time / peak), timed with CUDA events. Each row also times a
device-to-device copy of the same number of bytes (the achievable bandwidth baseline).
Mixed lengths: batch 64 with one 32k sequence among 1k ones, and uniform random lengths
to 16k. CUDA graph: ``DecodeAttention(cuda_graph=True)`` captured with 1k-token
lengths and replayed after ``plan()`` with the row's (longer) lengths.
Prefill: whole prompts of 1k/8k/32k tokens (batch x context <= 64k tokens): time,
TFLOP/s and the ratio to torch's scaled_dot_product_attention on dense K/V (a
flash-attention kernel on recent torch) measured in the same run.

    python benches/ops/bench_gpu.py [--peak-gbps N] [--quick]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

import kvblocks.ops as ops

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float16

# Peak HBM bandwidth (GB/s) by device-name fragment, for the fraction column.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000,
             "H100": 3350, "A100-SXM4-80GB": 2039, "A100-PCIE-80GB": 1935, "A100": 1555,
             "L40S": 864, "L4": 300}  # fmt: skip


def peak_gbps(override: float | None) -> float:
    """The device's peak HBM bandwidth in GB/s (``override`` wins)."""
    if override:
        return override
    name = torch.cuda.get_device_name()
    for key, value in PEAK_GBPS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown peak bandwidth for {name!r}; pass --peak-gbps")


def timed(fn, iters: int) -> float:
    """Mean seconds per call of ``fn`` (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def paged_batch(batch: int, ctx: int, q_len: int, dtype: torch.dtype = DTYPE, lens=None):
    """A cache holding ``batch`` sequences of ``ctx`` tokens (or ``lens``) in shuffled blocks."""
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    ((key_cache, value_cache),) = ops.allocate_kv_cache(
        1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype, "cuda"
    )
    key_cache.normal_()
    value_cache.normal_()
    perm = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int64) + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    host = np.full(batch, ctx, dtype=np.int32) if lens is None else np.asarray(lens, np.int32)
    seq_lens = torch.from_numpy(host).cuda()
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_SIZE, dtype=dtype, device="cuda")
    return query, key_cache, value_cache, tables, seq_lens, host


def _copy_seconds(kc: torch.Tensor, kv_bytes: int) -> float:
    """Baseline: copying half the K/V bytes (read + write = the kernel's read volume)."""
    half = kc.view(-1)[: kv_bytes // 4]
    sink = torch.empty_like(half)
    return timed(lambda: sink.copy_(half), 20)


def _kv_bytes(lens: np.ndarray, dtype: torch.dtype) -> int:
    esize = torch.empty((), dtype=dtype).element_size()
    return int(2 * lens.astype(np.int64).sum() * NUM_KV_HEADS * HEAD_SIZE * esize)


def _decode_times(batch: int, ctx: int, dtype: torch.dtype, lens=None):
    """Seconds per call: planned tensor-core kernel, older kernel, graph replay, copy."""
    query, kc, vc, tables, seq_lens, host = paged_batch(batch, ctx, 1, dtype, lens)
    new = timed(
        lambda: ops.paged_attention(query, kc, vc, tables, seq_lens, seq_lens_host=host), 20
    )
    old = timed(lambda: ops.paged_attention(query, kc, vc, tables, seq_lens, max_seq_len=ctx), 20)
    dec = ops.DecodeAttention(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
        block_size=BLOCK_SIZE, dtype=dtype, device="cuda", max_seqs=batch, cuda_graph=True,
    )  # fmt: skip
    out = torch.empty_like(query)
    dec.plan(np.minimum(host, 1024), tables)  # captured with shorter contexts
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec.run(query, kc, vc, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(query, kc, vc, out=out)
    dec.plan(host, tables)  # replayed with the row's lengths
    replay = timed(graph.replay, 20)
    return new, old, replay, _copy_seconds(kc, _kv_bytes(host, dtype)), host


def _print_decode_row(label: str, peak: float, dtype: torch.dtype, times) -> None:
    new, old, replay, copy, host = times
    kv_bytes = _kv_bytes(host, dtype)
    gbps = kv_bytes / new / 1e9
    print(f"{label:>14} {new * 1e6:>9.1f} {gbps:>8.0f} {gbps / peak:>8.1%} "
          f"{kv_bytes / replay / 1e9 / peak:>8.1%} {old * 1e6:>9.1f} {old / new:>7.2f}x "
          f"{copy * 1e6:>8.1f} {new / copy:>7.2f}x")  # fmt: skip


def bench_decode(peak: float, quick: bool, dtype: torch.dtype) -> None:
    """Decode rows: time, GB/s, fraction of peak (eager and graph replay), the older
    kernel's time and its ratio, and the ratio to a same-size D2D copy."""
    name = str(dtype).removeprefix("torch.")
    print(f"\ndecode  {name} H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_SIZE} "
          f"bs={BLOCK_SIZE}  peak {peak:.0f} GB/s")  # fmt: skip
    print(f"{'batch x ctx':>14} {'us/call':>9} {'GB/s':>8} {'of peak':>8} {'graph':>8} "
          f"{'old us':>9} {'old/new':>8} {'copy us':>8} {'vs copy':>8}")  # fmt: skip
    for batch in (1, 32, 256):
        for ctx in (1024, 8192, 32768):
            kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes * 1.6 > free or (quick and kv_bytes > 4e9):
                print(f"{batch:>6} x {ctx:>5}  skipped ({kv_bytes / 1e9:.1f} GB of K/V)")
                continue
            times = _decode_times(batch, ctx, dtype)
            torch.cuda.empty_cache()
            _print_decode_row(f"{batch} x {ctx}", peak, dtype, times)
    rng = np.random.default_rng(0)
    mixed = {
        "64: 32k+1k": np.array([32768] + [1024] * 63, dtype=np.int32),
        "64: rand 16k": rng.integers(1, 16384, 64).astype(np.int32),
    }
    for label, lens in mixed.items():
        times = _decode_times(len(lens), int(lens.max()), dtype, lens)
        torch.cuda.empty_cache()
        _print_decode_row(label, peak, dtype, times)


def _prefill_row(batch: int, ctx: int) -> tuple[float, float]:
    """Seconds per paged prefill call and per dense SDPA call of the same shape."""
    query, kc, vc, tables, seq_lens, _ = paged_batch(batch, ctx, ctx)
    qsl = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    seconds = timed(
        lambda: ops.paged_prefill_attention(
            query, kc, vc, tables, qsl, seq_lens, max_query_len=ctx
        ),
        3,
    )
    dense_q = query.view(batch, ctx, NUM_HEADS, HEAD_SIZE).transpose(1, 2)
    dense_k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_SIZE, dtype=DTYPE, device="cuda")
    dense_v = torch.randn_like(dense_k)
    sdpa = timed(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True
        ),
        3,
    )
    return seconds, sdpa


def bench_prefill(quick: bool) -> None:
    """Prefill rows: time, TFLOP/s and ratio to torch SDPA on dense K/V."""
    print("\nprefill (causal, whole prompts)")
    print(f"{'batch':>6} {'ctx':>6} {'ms/call':>9} {'TFLOP/s':>8} {'sdpa ms':>8} {'vs sdpa':>8}")
    for batch in (1, 32, 256):
        for ctx in (1024, 8192, 32768):
            if batch * ctx > (16384 if quick else 65536):
                continue
            seconds, sdpa = _prefill_row(batch, ctx)
            torch.cuda.empty_cache()
            flops = 4 * batch * NUM_HEADS * HEAD_SIZE * ctx * ctx / 2  # causal half
            print(f"{batch:>6} {ctx:>6} {seconds * 1e3:>9.2f} {flops / seconds / 1e12:>8.1f} "
                  f"{sdpa * 1e3:>8.2f} {seconds / sdpa:>7.1f}x")  # fmt: skip


def main() -> None:
    """Run the decode and prefill tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, default=None)
    parser.add_argument("--quick", action="store_true", help="skip the largest shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for dtype in (torch.float16, torch.bfloat16):
        bench_decode(peak_gbps(args.peak_gbps), args.quick, dtype)
    bench_prefill(args.quick)


if __name__ == "__main__":
    main()
