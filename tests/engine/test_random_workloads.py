"""Random workloads through the whole engine, checked against the dense forward every step.

Each seed draws a request mix (greedy, seeded sampling, n > 1, beam search, stop tokens,
shared prefixes) and an engine configuration (pool size, block size, token budget,
preemption mode). At every step each sampled row's logits must equal the dense,
cache-free forward over that sequence's tokens; at the end greedy single-sequence
requests must have produced the dense greedy continuation.
"""

from __future__ import annotations

import random

import pytest

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate

from .random_workload import draw_requests, install_dense_check


# Seeds 0-7 preempt (both modes), hit the prefix cache and chunk prompts between them;
# a 24-seed sweep passed when this test was written (about 20 s).
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_matches_dense(tiny_llama: LlamaForCausalLM, seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    llm = LLM(
        tiny_llama,
        num_blocks=rng.randint(96 // block_size + 2, 160 // block_size),
        block_size=block_size,
        num_cpu_blocks=64,
        max_num_batched_tokens=rng.choice([16, 48, 2048]),
        max_num_seqs=rng.choice([6, 64]),
        preemption_mode=rng.choice([None, "recompute", "swap"]),
        enable_prefix_caching=rng.random() < 0.8,
        device="cpu",
        seed=seed,
    )
    checked = install_dense_check(llm, tiny_llama)
    prompts, params = draw_requests(
        rng, shared_tokens=(8, 24), count=6, own_tokens=(1, 20), max_tokens=(8, 24), stops=True
    )
    outputs = llm.generate(prompts, params)
    assert checked[0] > 0
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= p.max_tokens
        if p.temperature == 0.0 and p.beam_width == 1:
            expected = dense_greedy_generate(
                tiny_llama, [prompt], p.max_tokens, stop_token_ids=p.stop_token_ids
            )[0]
            assert out.token_ids == expected
            assert out.finish_reason == ("stop" if expected[-1] in p.stop_token_ids else "length")
