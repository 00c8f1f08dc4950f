"""The pieces of the random-workload tests (``test_random_workloads.py``,
``test_random_hybrid_workloads.py``): a per-step check of the engine's logits against
the dense forward, and a drawn request mix."""

from __future__ import annotations

import random

import torch

from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.models import CausalLM
from kvblocks.sampling_params import SamplingParams


def install_dense_check(llm: LLM, model: CausalLM, tol: float = 1e-4) -> list[int]:
    """Make every forward of ``llm`` compare each sampled row's logits with the dense,
    cache-free forward over that sequence's tokens; the returned list counts the rows."""
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
            torch.testing.assert_close(logits[row], expected, rtol=tol, atol=tol)
            checked[0] += 1
        return logits

    llm.runner.forward_logits = checked_forward  # type: ignore[method-assign]
    return checked


def draw_requests(
    rng: random.Random,
    *,
    shared_tokens: tuple[int, int],
    count: int | tuple[int, int],
    own_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    stops: bool,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts (60% of them behind one shared prefix) and their sampling parameters:
    greedy (with a drawn stop token when ``stops``), seeded sampling, ``n = 2`` or beam
    search. Ranges are inclusive; the draws' order is fixed, so a seed keeps its mix."""
    shared = [rng.randrange(256) for _ in range(rng.randint(*shared_tokens))]
    num = count if isinstance(count, int) else rng.randint(*count)
    prompts, params = [], []
    for _ in range(num):
        own = [rng.randrange(256) for _ in range(rng.randint(*own_tokens))]
        prompts.append(shared + own if rng.random() < 0.6 else own)
        kind = rng.choice(["greedy", "greedy", "sample", "n", "beam"])
        limit = rng.randint(*max_tokens)
        if kind == "greedy":
            stop = (rng.randrange(256),) if stops and rng.random() < 0.5 else ()
            params.append(SamplingParams(max_tokens=limit, temperature=0.0, stop_token_ids=stop))
        elif kind == "sample":
            params.append(
                SamplingParams(max_tokens=limit, temperature=0.9, top_p=0.9, seed=rng.randrange(99))
            )
        elif kind == "n":
            params.append(SamplingParams(max_tokens=limit, n=2, temperature=1.0, top_k=30))
        else:
            params.append(SamplingParams(max_tokens=limit, beam_width=2))
    return prompts, params
