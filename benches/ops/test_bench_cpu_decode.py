"""The CPU engine's native decode kernel (``kvblocks._core.paged_decode_attention``) with the
KV blocks out of the CPU's caches, as the engine meets them, against torch's SDPA on the
same keys laid out densely (what HF ``generate`` runs), in the same run.

In the engine each layer's decode reads blocks that the other layers, the weights and the
activations have evicted since the last step; a call whose blocks were just read runs
from the caches and hides that. So every timed call here follows a pass over a 64 MiB
buffer (untimed), for both sides. The shape is the uniform batch of
``benches/engine/test_engine_vs_transformers.py``: 16 sequences of 144 keys, 8 query / 2
KV heads of 64, blocks of 16 in a 4,096-block cache (the CPU engine's default size), one
thread. Run: ``python -m pytest benches/ops/test_bench_cpu_decode.py --benchmark-only -s``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from kvblocks._core import paged_decode_attention

SEQS, HEADS, KV_HEADS, HEAD, BLOCK, KEYS, NUM_BLOCKS = 16, 8, 2, 64, 16, 144, 4096
ROUNDS = 300


def test_native_decode_from_memory_vs_sdpa(benchmark: Any) -> None:
    """Seconds per call, native kernel and dense SDPA interleaved; the ratio of the medians."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK, HEAD)
    key_cache = rng.standard_normal(shape, dtype=np.float32)
    value_cache = rng.standard_normal(shape, dtype=np.float32)
    per_seq = KEYS // BLOCK
    # Each sequence's blocks in order, the sequences spread over the cache.
    tables = rng.permutation(NUM_BLOCKS)[: SEQS * per_seq].astype(np.int32)
    tables = tables.reshape(SEQS, per_seq)
    lens = np.full(SEQS, KEYS, np.int32)
    query = rng.standard_normal((SEQS, HEADS, HEAD), dtype=np.float32)
    out = np.empty_like(query)
    scale = HEAD**-0.5

    # The same keys, dense: [seqs, kv_heads, keys, head].
    def dense(cache: np.ndarray) -> torch.Tensor:
        rows = torch.from_numpy(cache[tables.reshape(-1)])  # [seqs*per_seq, kv, block, head]
        rows = rows.view(SEQS, per_seq, KV_HEADS, BLOCK, HEAD).permute(0, 2, 1, 3, 4)
        return rows.reshape(SEQS, KV_HEADS, KEYS, HEAD).contiguous()

    k, v = dense(key_cache), dense(value_cache)
    q = torch.from_numpy(query).view(SEQS, HEADS, 1, HEAD)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def native() -> None:
        paged_decode_attention(
            out, query, key_cache, value_cache, tables, lens, scale=scale, threads=1
        )

    native()
    want = sdpa(q, k, v, scale=scale, enable_gqa=True).view(SEQS, HEADS, HEAD)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)

    junk = np.ones(64 * 2**20 // 4, np.float32)
    sdpa_seconds: list[float] = []

    def evict_time_sdpa_then_evict() -> tuple[tuple[()], dict[str, Any]]:
        junk.sum()
        start = time.perf_counter()
        sdpa(q, k, v, scale=scale, enable_gqa=True)
        sdpa_seconds.append(time.perf_counter() - start)
        junk.sum()
        return (), {}

    benchmark.pedantic(native, setup=evict_time_sdpa_then_evict, rounds=ROUNDS, iterations=1)
    native_s = benchmark.stats.stats.median
    sdpa_s = statistics.median(sdpa_seconds)
    benchmark.extra_info.update(
        {"native_s": native_s, "sdpa_s": sdpa_s, "speedup_over_sdpa": sdpa_s / native_s}
    )
    print(
        f"\n[decode {SEQS} x {KEYS} keys, GQA {HEADS // KV_HEADS}, head {HEAD}, from memory] "
        f"native {native_s * 1e6:.0f} us, SDPA dense {sdpa_s * 1e6:.0f} us, "
        f"x{sdpa_s / native_s:.2f}"
    )
