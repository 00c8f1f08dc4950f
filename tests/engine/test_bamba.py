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

import numpy as np
import pytest
import torch

from kvblocks import GroupSpec, InvalidArgumentError
from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.hf_config import config_from_file
from kvblocks.engine.layer_groups import hybrid_layout
from kvblocks.engine.loader import load_checkpoint, save_checkpoint
from kvblocks.engine.runner import ModelRunner
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers.disk import DiskTier
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.transfer import gather_blocks

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
    # Both in float64: in float32 each side's own rounding through the scans reaches 1e-4
    # at logits of magnitude ~10 (9e-5 for ours against its float64 run, on a CPU whose
    # vector width changes the sums' order), as large as the tolerance. In float64 they
    # differ by 2e-5, what transformers computes in float32 whatever the model's dtype
    # (A from A_log, the norms).
    hf, model = hf.double(), model.double()
    with torch.no_grad():
        want = hf(ids).logits.float()
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


def test_recurrent_models_refuse_what_they_cannot_do(
    hf_checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = hf_checkpoint
    # A store whose records are KV payloads only cannot hold the states.
    with pytest.raises(InvalidArgumentError, match="does not match the engine"):
        _llm(path, 20, host_cache_blocks=8, remote_tier=DiskTier(tmp_path, _disk_layout(), 8))
    with pytest.raises(InvalidArgumentError, match="recurrent layers only"):
        LLM(num_blocks=16, block_size=8, device="cpu", state_checkpoint_blocks=2)
    with pytest.raises(InvalidArgumentError, match="state_checkpoint_blocks"):
        _llm(path, 20, state_checkpoint_blocks=0)


def _disk_layout() -> KVLayout:
    return KVLayout(2, 1, BLOCK, 64, torch.float32, weights_digest="0" * 64)


class _TierSpy:
    """Wraps a runner's host-tier copies: records every row an offload wrote, by the
    (group, hash) its slot holds, and checks that every load puts exactly those bytes
    back (a state group's block: its states; group 0's: its KV)."""

    def __init__(self, llm: LLM) -> None:
        self.runner, self.manager = llm.runner, llm.manager
        self.saved: dict[tuple[int, bytes], torch.Tensor] = {}
        self.loaded: dict[int, int] = {}
        self._copy = self.runner._tier_copy
        self.runner._tier_copy = self._spy  # type: ignore[method-assign]

    def _key(self, slot: int) -> tuple[int, bytes]:
        group = self.manager.tier_slot_groups([slot])[0]
        block_hash = self.manager.tier_slot_hashes([slot])[0]
        assert group is not None and block_hash is not None
        return group, block_hash

    def _row(self, group: int, block: int) -> torch.Tensor:
        if group == 0:
            return gather_blocks(self.runner.host_layout, self.runner.kv_caches, [block])[0]
        states = self.runner.states
        assert states is not None
        return states.gather_rows(np.asarray([block]))[0]

    def _spy(self, kind: str, pairs: np.ndarray) -> None:
        self._copy(kind, pairs)
        for a, b in pairs.tolist():
            if kind == "offload":
                key = self._key(b)
                self.saved[key] = self._row(key[0], a).clone()
                # The pool row holds the block's bytes (a row may be wider: padding).
                row = self.runner.host_pool[b, : self.saved[key].numel()]  # type: ignore[index]
                assert torch.equal(row, self.saved[key])
            else:
                key = self._key(a)
                assert torch.equal(self._row(key[0], b), self.saved[key]), key
                self.loaded[key[0]] = self.loaded.get(key[0], 0) + 1


def test_host_tier_reloads_evicted_states(
    hf_checkpoint: tuple[Path, Any], expected: list[list[int]]
) -> None:
    """With a host tier, the cached checkpoints' states evicted from a small GPU pool go
    to the tier (a row holds a state block's states, not KV) and come back as a prefix
    hit: the states loaded are the bytes saved, and the tokens and log-probs are
    transformers'."""
    path, hf = hf_checkpoint
    llm = _llm(path, 20, host_cache_blocks=24)
    spy = _TierSpy(llm)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params)
    # Other prompts push the first one's cached blocks out of the 20-block GPU pool.
    llm.generate(PROMPTS[3:], params)
    llm.generate([_ids(40, 9), _ids(40, 10)], params)
    assert spy.loaded == {}
    again = llm.generate(PROMPTS[:1], params)[0]
    assert first[0].token_ids == again.token_ids == expected[0]
    # The hit ends on the last checkpoint inside the prompt (32 of 33 tokens).
    assert again.num_cached_tokens == 32
    assert again.outputs[0].logprobs is not None
    _check_logprobs(hf, PROMPTS[0], again.token_ids, [t.logprob for t in again.outputs[0].logprobs])
    cache = llm.stats()["cache"]
    assert cache["host_loads"] > 0 and cache["host_offloads"] > 0
    # Both state groups' checkpoints came back from the tier, as did the KV.
    assert spy.loaded.get(0, 0) > 0 and spy.loaded.get(1, 0) > 0 and spy.loaded.get(2, 0) > 0
    llm.manager.check_invariants()


def test_tier_rows_keep_states_and_kv_apart(hf_checkpoint: tuple[Path, Any]) -> None:
    """The runner's host-tier copies by each slot's group: a state slot's row holds the
    block's states of every slot (and leaves its KV alone), a KV slot's row its K and V."""
    path, _ = hf_checkpoint
    model = load_checkpoint(path)
    layout = hybrid_layout(model.config, BLOCK, CHECKPOINT_BLOCKS)
    assert layout is not None
    slot_group = {0: 1, 1: 0, 2: 2}
    runner = ModelRunner(
        model,
        num_blocks=8,
        block_size=BLOCK,
        host_cache_blocks=3,
        layout=layout,
        tier_slot_groups=lambda slots: [slot_group.get(int(s)) for s in slots],
    )
    states = runner.states
    assert states is not None and runner.host_pool is not None
    assert runner.host_pool.shape[1] == max(states.row_nbytes, runner.host_layout.payload_nbytes)
    gen = torch.Generator().manual_seed(0)
    for t in (states.conv, states.ssm, *(c for kv in runner.kv_caches for c in kv)):
        t.copy_(torch.randn(t.shape, generator=gen))
    conv, ssm = states.conv.clone(), states.ssm.clone()
    kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.apply_block_ops([("offload", np.array([[3, 0], [5, 1], [4, 2]]))])
    for t in (states.conv, states.ssm, *(c for pair in runner.kv_caches for c in pair)):
        t.zero_()
    runner.apply_block_ops([("load", np.array([[0, 6], [1, 7], [2, 1]]))])
    assert torch.equal(states.conv[:, 6], conv[:, 3]) and torch.equal(states.ssm[:, 6], ssm[:, 3])
    assert torch.equal(states.conv[:, 1], conv[:, 4]) and torch.equal(states.ssm[:, 1], ssm[:, 4])
    assert not states.conv[:, 7].any() and not states.ssm[:, 7].any()
    for (k, v), (k0, v0) in zip(runner.kv_caches, kv, strict=True):
        assert torch.equal(k[7], k0[5]) and torch.equal(v[7], v0[5])
        assert not k[6].any() and not v[6].any() and not k[1].any()
    with pytest.raises(InvalidArgumentError, match="hold no block"):
        runner.apply_block_ops([("load", np.array([[9, 2]]))])
    with pytest.raises(InvalidArgumentError, match="tier_slot_groups"):
        ModelRunner(model, num_blocks=8, block_size=BLOCK, host_cache_blocks=3, layout=layout)


def test_remote_tier_shares_states(
    hf_checkpoint: tuple[Path, Any], expected: list[list[int]], tmp_path: Path
) -> None:
    """Engine A computes a prompt with a disk directory as its remote tier (write-through);
    a fresh engine B on the directory loads the prefix up to the last checkpoint: the KV
    blocks and, in each state group, the checkpoint's states (keyed by group and hash),
    the bytes A saved, and B's tokens and log-probs are transformers'."""
    path, hf = hf_checkpoint
    stores: dict[KVLayout, DiskTier] = {}

    def store(layout: KVLayout) -> DiskTier:
        assert layout.state_nbytes > 0  # the records hold a state block's states
        return stores.setdefault(layout, DiskTier(tmp_path, layout, 256))

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    a = _llm(path, 40, host_cache_blocks=32, host_offload="commit", remote_tier=store)
    a_spy = _TierSpy(a)
    assert a.generate(PROMPTS[:1], params)[0].token_ids == expected[0]
    a.close()
    b = _llm(path, 40, host_cache_blocks=32, host_offload="commit", remote_tier=store)
    b_spy = _TierSpy(b)
    b_spy.saved = a_spy.saved  # B's loads must put back exactly what A offloaded
    out = b.generate(PROMPTS[:1], params)[0]
    assert out.token_ids == expected[0]
    assert out.num_cached_tokens == 32  # the last checkpoint inside the 33-token prompt
    assert out.outputs[0].logprobs is not None
    _check_logprobs(hf, PROMPTS[0], out.token_ids, [t.logprob for t in out.outputs[0].logprobs])
    # Four KV blocks and the checkpoint's states of both state groups.
    assert b.stats()["remote"]["imported_blocks"] == 4 + 2
    assert b_spy.loaded == {0: 4, 1: 1, 2: 1}
    b.close()
    for s in stores.values():
        s.close()
