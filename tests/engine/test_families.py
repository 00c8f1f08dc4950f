"""Gemma 2, Gemma 3, gpt-oss, Qwen3, OLMo 3 and Ministral against transformers' own code.

Two directions: the engine's tiny model of each family saved by the engine and run by
transformers (the dense logits agree), and a random checkpoint written by transformers'
``save_pretrained`` loaded with ``LLM(path)`` and run on the paged engine (greedy tokens
equal transformers' greedy tokens, teacher-forced log-probs within fp32 tolerance) with
a pool small enough to preempt and prefix caching on. Every family mixes 8-token windows
with full attention, and the prompts outgrow the windows.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.hf_config import config_from_file
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams

from .hf_families import (
    FAMILIES,
    assert_checkpoint_matches_hf,
    assert_logprobs_match_hf,
    hf_greedy,
    load_hf,
    random_ids,
    random_prompt,
    save_hf_checkpoint,
)

NEW_FAMILIES = list(FAMILIES)


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_tiny_model_matches_transformers(model_type: str, tmp_path: Path) -> None:
    """The engine's checkpoint of each family: transformers computes the same logits."""
    transformers = pytest.importorskip("transformers")
    assert_checkpoint_matches_hf(transformers, tiny_config(model_type), tmp_path)


def _zero_sinks(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.zero_()


# Each switch changes the logits: without it the comparison above would fail.
SWITCHES = [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": None}),
    ("gemma2", {"sliding_window": None}),
    ("gemma3_text", {"sliding_rope_theta": None}),
    ("gemma3_text", {"rope_scaling": None}),
    ("gemma3_text", {"sliding_window": None}),
    ("gpt_oss", {"rope_scaling": None}),
    ("gpt_oss", {"sliding_window": None}),
    ("gpt_oss", {"swiglu_limit": 0.5}),
    ("gpt_oss", "sinks"),
    ("qwen3", {"sliding_window": None}),
    ("olmo3", {"sliding_window": None}),
    ("ministral", {"sliding_window": None}),
]


@pytest.mark.parametrize(("model_type", "change"), SWITCHES)
def test_each_family_switch_changes_the_logits(model_type: str, change) -> None:
    base = build_tiny_model(tiny_config(model_type))
    if change == "sinks":
        other = build_tiny_model(tiny_config(model_type))
        _zero_sinks(other)
    else:
        other = build_tiny_model(tiny_config(model_type, **change))
    ids = random_ids(1, 40)
    assert (dense_logits(base, ids) - dense_logits(other, ids)).abs().max() > 1e-2


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def hf_checkpoint(request, tmp_path_factory) -> tuple[str, Path, object]:
    """A checkpoint written by transformers, and transformers' model of it."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(transformers, request.param, path, seed=3)
    return request.param, path, load_hf(transformers, path)


SHARED = random_prompt(24, 50)  # three 8-token blocks shared by the first three prompts
PROMPTS = [
    SHARED + random_prompt(9, 1),
    SHARED + random_prompt(17, 2),
    SHARED + random_prompt(3, 3),
    random_prompt(13, 4),
]
MAX_TOKENS = 24


# With KV cache groups a block holds L layer slots (L = 1 in these configs, so 3 and 4
# groups for Gemma 3's and OLMo 3's layers): 14 such blocks starve the window groups of
# Gemma 3 and OLMo 3 (a repeated prompt finds its window blocks evicted, and no sibling is
# admitted while the first computes the shared prefix). These pools still preempt.
GROUPED_BLOCKS = {"gemma3_text": 22, "olmo3": 28}


@pytest.mark.parametrize("kv_cache_groups", [False, True], ids=["one-group", "groups"])
def test_hf_checkpoint_runs_token_for_token(hf_checkpoint, kv_cache_groups: bool) -> None:
    """``LLM(path)`` on transformers' checkpoint: transformers' greedy tokens, under
    preemption (a 13-block pool for four sequences of up to 9 blocks), chunked prefill,
    and again from the prefix cache; its log-probs are transformers' teacher-forced ones.
    Once with every layer in one full-attention group, once with a group per attention
    kind (the default)."""
    model_type, path, hf = hf_checkpoint
    config = config_from_file(path)
    assert config.model_type == model_type
    windows = config.layer_sliding_windows()
    assert 8 in windows and None in windows  # mixed: uniform allocation, windows per layer
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading must not warn about anything dropped
        llm = LLM(
            str(path),
            num_blocks=GROUPED_BLOCKS.get(model_type, 14) if kv_cache_groups else 14,
            block_size=8,
            num_cpu_blocks=64,
            max_num_batched_tokens=32,
            device="cpu",
            kv_cache_groups=kv_cache_groups,
        )
    assert llm.manager.sliding_window is None
    assert (len(llm.manager.groups) > 1) == kv_cache_groups
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == expected
    # Informative continuations, not one token repeated with probability ~1.
    assert all(len(set(tokens)) >= 5 for tokens in expected)
    sched = llm.stats()["scheduler"]
    assert sched["num_preemptions_recompute"] + sched["num_preemptions_swap"] > 0, sched
    assert_logprobs_match_hf(hf, PROMPTS, first)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == expected
    assert max(o.num_cached_tokens for o in again) >= 24
