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
import torch

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate, dense_logits
from kvblocks.sampling_params import SamplingParams


def _install_dense_check(llm: LLM, model: LlamaForCausalLM) -> list[int]:
    forward = llm.runner.forward_logits
    checked = [0]

    def checked_forward(out):
        logits = forward(out)
        if logits is None:
            return logits
        position = {int(s): i for i, s in enumerate(out.seq_ids.tolist())}
        for row, seq in enumerate(out.sample_seq_ids.tolist()):
            length = int(out.seq_lens[position[seq]])
            tokens = torch.from_numpy(llm.manager.token_ids(seq)[:length].astype("int64"))
            expected = dense_logits(model, tokens[None])[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            checked[0] += 1
        return logits

    llm.runner.forward_logits = checked_forward  # type: ignore[method-assign]
    return checked


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
    checked = _install_dense_check(llm, tiny_llama)
    shared = [rng.randrange(256) for _ in range(rng.randint(8, 24))]
    prompts, params = [], []
    for _ in range(6):
        own = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        prompts.append(shared + own if rng.random() < 0.6 else own)
        kind = rng.choice(["greedy", "greedy", "sample", "n", "beam"])
        max_tokens = rng.randint(8, 24)
        if kind == "greedy":
            stop = (rng.randrange(256),) if rng.random() < 0.5 else ()
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
            )
        elif kind == "sample":
            params.append(
                SamplingParams(
                    max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=rng.randrange(99)
                )
            )
        elif kind == "n":
            params.append(SamplingParams(max_tokens=max_tokens, n=2, temperature=1.0, top_k=30))
        else:
            params.append(SamplingParams(max_tokens=max_tokens, beam_width=2))
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
