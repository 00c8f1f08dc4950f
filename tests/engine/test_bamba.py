"""Bamba (Mamba 2 mixers with attention) against transformers' own implementation.

The mixers' states live in the block manager's recurrent-state groups: each step reads a
sequence's state from its block, saves the state at every checkpoint it crosses (every 16
tokens here, blocks of 8, checkpoints every 2 blocks) and at its end. So a second prompt
sharing a prefix restores the cached state of the last checkpoint inside the prefix and
computes only the rest; preemption recomputes or swaps the state; forks (``n > 1``, beam
search) copy it. Every run is checked against transformers on a random checkpoint written
by ``save_pretrained``: greedy tokens equal, log-probs within fp32 tolerance.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks import GroupSpec, InvalidArgumentError
from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.hf_config import config_from_file
from kvblocks.engine.loader import load_checkpoint, save_checkpoint
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams

from .hf_families import hf_greedy, hf_logprobs, load_hf

VOCAB = 128
# Blocks of 8 tokens, a state cached every 2 blocks: prefix hits are multiples of 16.
BLOCK, CHECKPOINT_BLOCKS = 8, 2

#: transformers' BambaConfig of the random checkpoint: five layers, attention in two (a
#: group of 2 attention layers, two state groups of 2 slots, one of them padding).
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "attn_layer_indices": [1, 3],
    "mamba_n_heads": 4,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "max_position_embeddings": 512,
}


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


SHARED = _ids(24, 50)  # three blocks shared by the first three prompts: a hit of 16
PROMPTS = [SHARED + _ids(9, 1), SHARED + _ids(17, 2), SHARED + _ids(3, 3), _ids(13, 4)]
MAX_TOKENS = 16


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights at the engine's tiny-model scales (decisive greedy choices, decays
    that remember a few tokens)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith((".bias", "_bias")):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".A_log"):
            p.copy_(torch.log(0.5 + 4 * torch.rand(p.shape, generator=gen)))
        elif name.endswith(".D") or name == "model.embed_tokens.weight":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name == "lm_head.weight":
            p.copy_(3.0 / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random Bamba written by transformers' ``save_pretrained``, and its model."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("bamba")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.BambaConfig(**HF_CONFIG), dtype=torch.float32, attn_implementation="eager"
        )
    _redraw(model, 3)
    model.save_pretrained(path)
    return path, load_hf(transformers, path)


@pytest.fixture(scope="module")
def expected(hf_checkpoint: tuple[Path, Any]) -> list[list[int]]:
    return [hf_greedy(hf_checkpoint[1], p, MAX_TOKENS) for p in PROMPTS]


def _llm(path: Path, num_blocks: int, **kwargs: Any) -> LLM:
    kwargs.setdefault("state_checkpoint_blocks", CHECKPOINT_BLOCKS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading must not warn about anything dropped
        return LLM(
            str(path),
            num_blocks=num_blocks,
            block_size=BLOCK,
            num_cpu_blocks=64,
            max_num_batched_tokens=32,
            device="cpu",
            **kwargs,
        )


def _check_logprobs(hf: Any, prompt: list[int], tokens: list[int], got: list[float]) -> None:
    want = hf_logprobs(hf, prompt, tokens)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=5e-5)


def test_tiny_bamba_matches_transformers(tmp_path: Path) -> None:
    """The engine's own Bamba checkpoint: transformers reads the config back and computes
    the same logits (dense, every sequence from the zero state)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_config("bamba", vocab_size=VOCAB)
    model = build_tiny_model(config)
    save_checkpoint(model, tmp_path)
    assert load_checkpoint(tmp_path).config == config
    hf = load_hf(transformers, tmp_path)
    assert type(hf).__name__ == "BambaForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    got = dense_logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The mixers matter: the logits of a model whose scans forget at once differ.
    with torch.no_grad():
        for mixer in model.mixers:
            mixer.A_log.fill_(20.0)
    assert (dense_logits(model, ids) - got).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hf_checkpoint_runs_token_for_token(
    hf_checkpoint: tuple[Path, Any], expected: list[list[int]], mode: str
) -> None:
    """``LLM(path)`` on transformers' checkpoint: its greedy tokens under preemption
    (recomputing or swapping the states) and chunked prefill (chunks of 32 tokens end
    between checkpoints), transformers' teacher-forced log-probs, and the same tokens
    again from the prefix cache, which restores the state after 16 shared tokens."""
    path, hf = hf_checkpoint
    config = config_from_file(path)
    assert config.model_type == "bamba" and config.recurrent_layers == (0, 2, 4)
    llm = _llm(path, 20, preemption_mode=mode)
    state = GroupSpec.recurrent(CHECKPOINT_BLOCKS)
    assert llm.manager.groups == [GroupSpec.full_attention(), state, state]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == expected
    assert all(len(set(tokens)) >= 5 for tokens in expected)
    sched = llm.stats()["scheduler"]
    assert sched[f"num_preemptions_{mode}"] > 0, sched
    for prompt, out in zip(PROMPTS, first, strict=True):
        assert out.outputs[0].logprobs is not None
        _check_logprobs(hf, prompt, out.token_ids, [t.logprob for t in out.outputs[0].logprobs])
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == expected
    # Hits end on a cached state (a multiple of 16 tokens); the shared 24 tokens give 16.
    cached = [o.num_cached_tokens for o in again]
    assert max(cached) >= 16 and all(n % (BLOCK * CHECKPOINT_BLOCKS) == 0 for n in cached)
    llm.manager.check_invariants()


def test_forked_sequences_keep_their_own_states(hf_checkpoint: tuple[Path, Any]) -> None:
    """Parallel sampling (``n = 3``) and beam search fork a sequence's state: every
    completion's log-probs are transformers' teacher-forced ones for its own tokens."""
    path, hf = hf_checkpoint
    llm = _llm(path, 24)
    sampled = llm.generate(
        PROMPTS[:2],
        SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, logprobs=0, ignore_eos=True),
    )
    for prompt, out in zip(PROMPTS, sampled, strict=False):
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        for c in out.outputs:
            assert c.logprobs is not None
            _check_logprobs(hf, prompt, c.token_ids, [t.logprob for t in c.logprobs])
    beams = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, beam_width=3, n=2))
    for prompt, out in zip(PROMPTS, beams, strict=False):
        for c in out.outputs:
            want = float(hf_logprobs(hf, prompt, c.token_ids).sum())
            assert c.cumulative_logprob == pytest.approx(want, abs=1e-4)
    llm.manager.check_invariants()


def test_recurrent_models_refuse_what_they_cannot_do(hf_checkpoint: tuple[Path, Any]) -> None:
    path, _ = hf_checkpoint
    with pytest.raises(InvalidArgumentError, match="not supported with a recurrent model"):
        _llm(path, 20, host_cache_blocks=8)
    with pytest.raises(InvalidArgumentError, match="recurrent layers only"):
        LLM(num_blocks=16, block_size=8, device="cpu", state_checkpoint_blocks=2)
    with pytest.raises(InvalidArgumentError, match="state_checkpoint_blocks"):
        _llm(path, 20, state_checkpoint_blocks=0)
