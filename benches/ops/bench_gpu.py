"""GPU benchmark of the paged-attention kernels (needs a CUDA GPU and CuPy).

Decode: batch 1/32/256 x context 1k/8k/32k (fp16, 32 query heads, 8 KV heads, head
size 128, block size 16): time per call and achieved fraction of HBM bandwidth
(K/V bytes read / time / peak). Each row also times, in the same run, a
device-to-device copy of the same number of bytes (the achievable bandwidth baseline)
and reports the kernel's time as a ratio to it.
Prefill: whole prompts of 1k/8k/32k tokens (batch x context <= 64k tokens): time,
TFLOP/s and the ratio to torch's scaled_dot_product_attention on dense K/V (a
flash-attention kernel on recent torch) measured in the same run.

    python benches/ops/bench_gpu.py [--peak-gbps N] [--quick]
"""

from __future__ import annotations

import argparse
import math

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


def paged_batch(batch: int, ctx: int, q_len: int):
    """A cache holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks."""
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    ((key_cache, value_cache),) = ops.allocate_kv_cache(
        1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, DTYPE, "cuda"
    )
    key_cache.normal_()
    value_cache.normal_()
    perm = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int64) + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    return query, key_cache, value_cache, tables, seq_lens


def _decode_row(batch: int, ctx: int, kv_bytes: int) -> tuple[float, float]:
    """Seconds per decode call and per same-volume device copy."""
    query, kc, vc, tables, seq_lens = paged_batch(batch, ctx, 1)
    seconds = timed(
        lambda: ops.paged_attention(query, kc, vc, tables, seq_lens, max_seq_len=ctx), 20
    )
    # Baseline: copying half the K/V bytes (read + write = the kernel's read volume).
    half = kc.view(-1)[: kv_bytes // 4]
    sink = torch.empty_like(half)
    return seconds, timed(lambda: sink.copy_(half), 20)


def bench_decode(peak: float, quick: bool) -> None:
    """Decode rows: time, GB/s, fraction of peak, ratio to a same-size D2D copy."""
    print(f"decode  fp16 H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_SIZE} bs={BLOCK_SIZE}"
          f"  peak {peak:.0f} GB/s")  # fmt: skip
    print(f"{'batch':>6} {'ctx':>6} {'us/call':>9} {'GB/s':>8} {'of peak':>8} "
          f"{'copy us':>8} {'vs copy':>8}")  # fmt: skip
    for batch in (1, 32, 256):
        for ctx in (1024, 8192, 32768):
            kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
            free, _ = torch.cuda.mem_get_info()
            if kv_bytes * 1.6 > free or (quick and kv_bytes > 4e9):
                print(f"{batch:>6} {ctx:>6}  skipped ({kv_bytes / 1e9:.1f} GB of K/V)")
                continue
            seconds, copy_seconds = _decode_row(batch, ctx, kv_bytes)
            torch.cuda.empty_cache()
            gbps = kv_bytes / seconds / 1e9
            print(f"{batch:>6} {ctx:>6} {seconds * 1e6:>9.1f} {gbps:>8.0f} {gbps / peak:>8.1%} "
                  f"{copy_seconds * 1e6:>8.1f} {seconds / copy_seconds:>7.2f}x")  # fmt: skip


def _prefill_row(batch: int, ctx: int) -> tuple[float, float]:
    """Seconds per paged prefill call and per dense SDPA call of the same shape."""
    query, kc, vc, tables, seq_lens = paged_batch(batch, ctx, ctx)
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
    bench_decode(peak_gbps(args.peak_gbps), args.quick)
    bench_prefill(args.quick)


if __name__ == "__main__":
    main()
