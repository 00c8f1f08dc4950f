"""Random workloads with a host tier, checked against the dense forward at every step.

As tests/engine/test_random_workloads.py, with a small host tier under a small device pool
and the request mix run twice (two generate calls), so that the second round finds prefixes
in the tier while swaps (swap preemption), copy-on-write copies (beams, n > 1), offloads and
loads share each step's ordered op list. Every sampled row's logits must equal the dense,
cache-free forward over its sequence: a block loaded with the wrong bytes, or loaded after
the attention that reads it, or overwritten before its offload read it, changes them.
"""

from __future__ import annotations

import random

import pytest

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.sampling_params import SamplingParams

from .random_workload import install_dense_check


def _mix(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    shared = [rng.randrange(256) for _ in range(rng.randint(16, 40))]
    prompts, params = [], []
    for _ in range(5):
        own = [rng.randrange(256) for _ in range(rng.randint(1, 24))]
        prompts.append(shared + own if rng.random() < 0.6 else own + shared)
        kind = rng.choice(["greedy", "greedy", "sample", "n", "beam"])
        max_tokens = rng.randint(4, 12)
        if kind == "greedy":
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0))
        elif kind == "sample":
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=7))
        elif kind == "n":
            params.append(SamplingParams(max_tokens=max_tokens, n=2, temperature=1.0))
        else:
            params.append(SamplingParams(max_tokens=max_tokens, beam_width=2))
    return prompts, params


# Seeds whose second round loads from the tier; among them both policies, swap and recompute
# preemption, beams and chunked prefill (a 16-seed sweep passed when this was written).
@pytest.mark.parametrize("seed", [0, 2, 3, 4, 5, 6, 8, 9])
def test_random_workload_with_a_host_tier_matches_dense(
    tiny_llama: LlamaForCausalLM, seed: int
) -> None:
    rng = random.Random(1000 + seed)
    block_size = rng.choice([8, 16])
    llm = LLM(
        tiny_llama,
        num_blocks=rng.randint(128 // block_size + 2, 192 // block_size),
        block_size=block_size,
        num_cpu_blocks=64,
        max_num_batched_tokens=rng.choice([16, 48, 2048]),
        max_num_seqs=rng.choice([3, 64]),
        preemption_mode=["recompute", "swap", None][seed % 3],
        host_cache_blocks=rng.choice([2, 6, 32]),
        host_offload=["evict", "commit"][seed % 2],  # type: ignore[arg-type]
        device="cpu",
        seed=seed,
    )
    checked = install_dense_check(llm, tiny_llama)
    prompts, params = _mix(rng)
    for _round in range(2):
        outputs = llm.generate(prompts, params)
        for prompt, p, out in zip(prompts, params, outputs, strict=True):
            if p.temperature == 0.0 and p.beam_width == 1:
                assert out.token_ids == dense_greedy_generate(tiny_llama, [prompt], p.max_tokens)[0]
    assert checked[0] > 0
    cache = llm.stats()["cache"]
    assert cache["host_offloads"] > 0 and cache["host_loads"] > 0
    assert cache["num_host_pinned_blocks"] == 0
    llm.manager.check_invariants()
