"""Engine throughput on the tiny model (CPU): the paged engine vs dense recomputation.

The paged engine (scheduler + Rust block manager + paged attention on the KV cache)
computes each token once; the baseline is the cache-free dense forward that recomputes
every sequence from scratch at each step (``kvblocks.engine.dense``), batched over the
prompts. Both generate the same greedy tokens (asserted), so the ratio of their
generated-tokens-per-second compares the two ways of doing identical work. Measured in
the same run; the ratio is stored in the benchmark's ``extra_info`` and printed.

Run: ``python -m pytest benches/engine --benchmark-only -s`` (``-s`` shows the ratio line).
"""

from __future__ import annotations

import time

import pytest
import torch

from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.tiny import build_tiny_model
from kvblocks.sampling_params import SamplingParams

CASES = [
    pytest.param(8, 32, 64, 0, id="batch8-prompt32-gen64"),
    pytest.param(32, 64, 128, 0, id="batch32-prompt64-gen128"),
    # A shared 96-token system prompt: prefix caching computes it once per round.
    pytest.param(32, 112, 32, 96, id="batch32-prompt112(shared96)-gen32"),
]


@pytest.mark.parametrize(("batch", "prompt_len", "max_tokens", "shared"), CASES)
def test_engine_vs_dense(
    benchmark, batch: int, prompt_len: int, max_tokens: int, shared: int
) -> None:
    """Generated tokens/s of the paged engine and of the dense baseline, and their ratio."""
    # Tiny-model ops last microseconds: intra-op threads only add contention (both sides).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (batch, prompt_len), generator=gen)
    prompts[:, :shared] = prompts[0, :shared]
    prompts = prompts.tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    blocks = batch * ((prompt_len + max_tokens) // 16 + 2) + 1

    def fresh_engine():
        # A new engine per round: no prefix-cache hits carried over between rounds.
        return (LLM(model, num_blocks=blocks, device="cpu"),), {}

    def run_engine(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, params)]

    paged_tokens = benchmark.pedantic(run_engine, setup=fresh_engine, rounds=3, iterations=1)
    paged_s = benchmark.stats.stats.median

    dense_times = []
    for _ in range(3):
        start = time.perf_counter()
        dense_tokens = dense_greedy_generate(model, prompts, max_tokens)
        dense_times.append(time.perf_counter() - start)
    dense_s = sorted(dense_times)[1]
    assert dense_tokens == paged_tokens

    generated = batch * max_tokens
    ratio = dense_s / paged_s
    benchmark.extra_info.update(
        {
            "generated_tokens": generated,
            "paged_tokens_per_s": generated / paged_s,
            "dense_tokens_per_s": generated / dense_s,
            "paged_over_dense_speedup": ratio,
        }
    )
    print(
        f"\n[{batch}x{prompt_len}+{max_tokens}, shared {shared}] "
        f"paged {generated / paged_s:,.0f} tok/s, "
        f"dense recompute {generated / dense_s:,.0f} tok/s, speedup x{ratio:.2f}"
    )
