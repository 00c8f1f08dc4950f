"""Llama 4 (text-only ``Llama4ForCausalLM``) against transformers' own code.

Chunked local attention in the RoPE layers (an interleaved rope, L2-normalised queries
and keys), NoPE full-attention layers with the query temperature, experts and dense
MLPs. The engine's tiny model saved by the engine is run by transformers (the logits
agree, and every switch changes them); a random checkpoint written by transformers'
``save_pretrained`` runs on the paged engine token for token under preemption, chunked
prefill across chunk boundaries and prefix hits; the chunked group frees the blocks of
past chunks and the attention never reads them (poisoned, they change nothing).

The chunked attention's virtual batches and the engine's chunked groups are tested in
``test_llama4_chunked.py``, configs and refusals in ``test_llama4_config.py``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvblocks import GroupSpec
from kvblocks.engine import LLM
from kvblocks.engine import runner as runner_module
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.hf_config import config_from_file
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams

from .hf_families import (
    assert_checkpoint_matches_hf,
    assert_logprobs_match_hf,
    hf_greedy,
    load_hf,
    random_ids,
    random_prompt,
    save_hf_checkpoint,
)
from .llama4_cases import BLOCK, CHUNK, CHUNKED, FULL, _held, _options

# -- the model against transformers -------------------------------------------------------


def test_tiny_model_matches_transformers(tmp_path: Path) -> None:
    """The engine's checkpoint (16-token chunks, a NoPE layer, experts and dense layers,
    Llama 3 rope): transformers loads it as Llama4ForCausalLM and computes the same
    logits over 40 tokens (three chunks)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_config("llama4_text")
    hf = assert_checkpoint_matches_hf(transformers, config, tmp_path)
    assert config.architecture == "Llama4ForCausalLM"
    assert hf.config.layer_types == [CHUNKED, CHUNKED, CHUNKED, FULL]
    assert hf.config.moe_layers == [1, 3] and hf.config.attention_chunk_size == 16


# Each switch changes the logits: without it the comparison above would fail.
SWITCHES = {
    "no-chunks": {"attention_chunk_size": None},  # every layer full attention
    "no-rope-scaling": {"rope_scaling": None},
    "no-qk-norm": {"llama4": _options(use_qk_norm=False)},
    "no-temperature": {"llama4": _options(attn_temperature_tuning=False)},
    "no-nope-layer": {"llama4": _options(no_rope_layers=(1, 1, 1, 1))},
    "dense-everywhere": {"llama4": _options(moe_layers=())},
    "experts-everywhere": {"llama4": _options(moe_layers=(0, 1, 2, 3))},
    "top-1": {"num_experts_per_tok": 1},
}


@pytest.mark.parametrize("change", SWITCHES.values(), ids=SWITCHES.keys())
def test_each_switch_changes_the_logits(change: dict[str, Any]) -> None:
    base = build_tiny_model(tiny_config("llama4_text"))
    other = build_tiny_model(tiny_config("llama4_text", **change))
    ids = random_ids(1, 40)
    assert (dense_logits(base, ids) - dense_logits(other, ids)).abs().max() > 1e-2


# -- a transformers checkpoint on the paged engine ----------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A checkpoint written by transformers (hf_families.LLAMA4), and its model."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama4")
    save_hf_checkpoint(transformers, "llama4_text", path, seed=3)
    return path, load_hf(transformers, path)


SHARED = random_prompt(48, 50)  # three 16-token blocks shared by the first three prompts
PROMPTS = [
    SHARED + random_prompt(21, 1),
    SHARED + random_prompt(45, 2),
    SHARED + random_prompt(5, 3),
    random_prompt(37, 4),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(hf_checkpoint: tuple[Path, Any]) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS (computed once for the module)."""
    return [hf_greedy(hf_checkpoint[1], p, MAX_TOKENS) for p in PROMPTS]


def test_checkpoint_config(hf_checkpoint: tuple[Path, Any]) -> None:
    path, _ = hf_checkpoint
    config = config_from_file(path)
    assert config.model_type == "llama4_text" and config.architecture == "Llama4ForCausalLM"
    assert config.layer_attention_chunks() == [CHUNK, None, CHUNK, None]
    assert config.layer_sliding_windows() == [None] * 4
    assert config.llama4 is not None and config.llama4.moe_layers == (0, 1)
    assert config.llama4.floor_scale == 16.0 and config.llama4.attn_temperature_tuning
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rms_norm_eps == 1e-6 and config.head_dim == 64


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_cache_groups", [False, True], ids=["one-group", "groups"])
def test_hf_checkpoint_runs_token_for_token(
    hf_checkpoint: tuple[Path, Any],
    expected: list[list[int]],
    kv_cache_groups: bool,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LLM(path)`` on transformers' checkpoint, prompts of 37-93 tokens (up to three
    32-token chunks) plus 24 generated: transformers' greedy tokens under preemption (a
    16-block pool), chunked prefill in 40-token steps (prefill chunks that cross chunk
    boundaries), and again from the prefix cache; the log-probs are transformers'
    teacher-forced ones. Once with a full-attention group and a chunked group (the
    default), once with one full-attention group of every layer (the chunked layers
    still read only their chunk)."""
    path, hf = hf_checkpoint
    split: list[int] = []  # sequences of a prefill batch split at a chunk boundary
    real = runner_module.chunked_batch

    def spy(qsl: np.ndarray, lens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        batch = real(qsl, lens, *args, **kwargs)
        split.append(len(batch.rows) - len(np.unique(batch.rows)))
        return batch

    monkeypatch.setattr(runner_module, "chunked_batch", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading must not warn about anything dropped
        llm = LLM(
            str(path),
            num_blocks=16,
            block_size=BLOCK,
            num_cpu_blocks=64,
            max_num_batched_tokens=40,
            preemption_mode=mode,  # type: ignore[arg-type]
            device="cpu",
            kv_cache_groups=kv_cache_groups,
        )
    want_groups = [GroupSpec.full_attention()]
    if kv_cache_groups:
        want_groups.append(GroupSpec.chunked_local_attention(CHUNK))
    assert llm.manager.groups == want_groups
    assert len(llm.runner.kv_caches) == (2 if kv_cache_groups else 4)  # L = 2 per group
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == expected
    assert all(len(set(tokens)) >= 5 for tokens in expected)  # informative continuations
    sched = llm.stats()["scheduler"]
    assert sched[f"num_preemptions_{mode}"] > 0, sched
    assert max(split) > 0  # some prefill step crossed a chunk boundary in a sequence
    assert_logprobs_match_hf(hf, PROMPTS, first)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == expected
    assert max(o.num_cached_tokens for o in again) >= 48  # a hit mid-chunk (32..63)
    llm.manager.check_invariants()


def _poison_unheld_blocks(llm: LLM, poisoned: list[int]) -> None:
    """Before every forward pass, fill every block the step's sequences do not hold in
    any group (the null block, and the past chunks' blocks the chunked group freed) with
    NaN in every layer slot: an attention reading one turns the logits into NaN."""
    runner = llm.runner
    forward = runner.forward_logits

    def poisoned_forward(out: Any) -> Any:
        tables = out.group_block_table
        if tables is None:  # one group
            tables = np.asarray(out.block_table)[None]
        held = np.unique(np.asarray(tables)[:, np.asarray(out.block_table_rows)])
        unheld = np.setdiff1d(np.arange(runner.num_blocks), held)
        index = torch.from_numpy(unheld)
        for k, v in runner.kv_caches:
            k[index] = float("nan")
            v[index] = float("nan")
        poisoned.append(len(unheld))
        return forward(out)

    runner.forward_logits = poisoned_forward  # type: ignore[method-assign]


def test_chunked_group_frees_past_chunks_and_never_reads_them(
    hf_checkpoint: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 45-token prompt decodes 100 tokens (five chunks): after every step the chunked
    group holds exactly its current chunk's blocks (the formula of
    docs/hybrid-groups.md), the full group every block; with every block the sequence
    does not hold poisoned with NaN before each step, the tokens are still
    transformers' and the log-probs finite. The poison has teeth: chunks that start at
    block 0 (reading the freed entries) turn the output into NaN."""
    path, hf = hf_checkpoint
    prompt = random_prompt(45, 9)
    expected = hf_greedy(hf, prompt, 100)
    params = SamplingParams(max_tokens=100, temperature=0.0, logprobs=0, ignore_eos=True)

    def engine() -> LLM:
        llm = LLM(str(path), num_blocks=24, block_size=BLOCK, num_cpu_blocks=0, device="cpu")
        assert [g.chunk for g in llm.manager.groups] == [None, CHUNK]
        return llm

    llm = engine()
    poisoned: list[int] = []
    _poison_unheld_blocks(llm, poisoned)
    tokens: list[int] = []
    checked = 0
    logprobs: list[float] = []
    for rec in llm.stream([prompt], params):
        out = rec.outputs[0]
        tokens = out.token_ids
        logprobs = [t.logprob for t in out.logprobs or []]
        if out.finish_reason is not None:
            break
        computed = len(prompt) + len(tokens) - 1
        used = llm.manager.group_stats()["num_used_blocks"]
        assert used == [_held(computed, None, BLOCK), _held(computed, CHUNK, BLOCK)], computed
        assert used[1] <= CHUNK // BLOCK + 1
        checked += 1
    assert tokens == expected
    assert all(math.isfinite(lp) for lp in logprobs)
    assert checked >= 90
    # By the end the full group holds 10 blocks and the chunked one 1: the chunked
    # group's other 8 were freed and poisoned (with the pool's 13 never used).
    assert max(poisoned) >= 24 - 1 - 10 - 1
    # Negative control: a virtual batch whose pieces start at block 0 reads the freed
    # (poisoned) entries of the chunked group's table.
    real = runner_module.chunked_batch

    def from_block_zero(qsl: np.ndarray, lens: np.ndarray, chunk: int, *a: Any, **k: Any) -> Any:
        return real(qsl, lens, 1 << 20, *a, **k)

    monkeypatch.setattr(runner_module, "chunked_batch", from_block_zero)
    bad = engine()
    _poison_unheld_blocks(bad, [])
    (out,) = bad.generate([prompt], params)
    assert out.token_ids != expected or not all(
        math.isfinite(t.logprob) for t in out.outputs[0].logprobs or []
    )
