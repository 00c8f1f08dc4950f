"""Small random checkpoints of each newer family, made by transformers itself.

Each config is built with transformers' own configuration class, the model with its own
modeling code, and the directory written by ``save_pretrained``: what the engine loads is
what transformers writes. The random weights are then redrawn from a seeded generator at
the scales of the engine's tiny model, so that greedy choices have clear margins (the
default initialisation, std 0.02, makes every logit nearly equal).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

SLIDE, FULL = "sliding_attention", "full_attention"
VOCAB = 128

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}

# model_type -> (transformers config class name, its arguments). Every family mixes
# 8-token windows with full attention, so prompts of 30+ tokens outgrow the windows.
# Gemma's embeddings are untied here: a random tied model scaled by sqrt(hidden) predicts
# its input token back with probability ~1, which no switch could change (tied weights
# are checked on the engine's tiny Gemma models, whose logits are compared whole).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        {
            **_COMMON,
            "num_hidden_layers": 2,
            "sliding_window": 8,
            "tie_word_embeddings": False,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": [SLIDE, SLIDE, FULL],
            "tie_word_embeddings": False,
            "query_pre_attn_scalar": 32,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                SLIDE: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            **_COMMON,
            "num_hidden_layers": 2,
            "sliding_window": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
                "rope_theta": 150_000.0,
            },
        },
    ),
    "qwen3": (
        "Qwen3Config",
        {
            **_COMMON,
            "num_hidden_layers": 2,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    "olmo3": (
        "Olmo3Config",
        {
            # No head_dim field: hidden / heads = 64.
            **{k: v for k, v in _COMMON.items() if k != "head_dim"},
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "eos_token_id": 2,  # the default, 50279, is outside this vocabulary
        },
    ),
    "ministral": (
        "MinistralConfig",
        {**_COMMON, "num_hidden_layers": 2, "sliding_window": 8, "layer_types": [SLIDE, FULL]},
    ),
}

# Llama 4 (text): 32-token chunks in the RoPE layers (0, 2), NoPE full attention with a
# temperature that changes every 16 positions in layers 1 and 3, experts in layers 0 and 1
# and dense MLPs in 2 and 3 (every combination of the two), Llama 3 rope. Not in FAMILIES:
# it has chunks, not windows (tests/engine/test_llama4.py).
LLAMA4: tuple[str, dict[str, Any]] = (
    "Llama4TextConfig",
    {
        **_COMMON,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_layers": [0, 1],
        "no_rope_layers": [1, 0, 1, 0],
        "attention_chunk_size": 32,
        "floor_scale": 16,
        "attn_scale": 0.5,
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500_000.0,
        },
    },
)


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int, *, norm_center: float) -> None:
    """Seeded weights at the tiny model's scales (see :mod:`kvblocks.engine.tiny`)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if name.endswith("norm.weight"):
            param.copy_(norm_center + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith((".bias", "_bias")):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".sinks") or name == "model.embed_tokens.weight":
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            param.copy_(3.0 / math.sqrt(param.shape[1]) * torch.randn(param.shape, generator=gen))
        else:
            std = 1.0 / math.sqrt(param.shape[1])
            param.copy_(std * torch.randn(param.shape, generator=gen))


def save_hf_checkpoint(transformers: Any, model_type: str, path: Path, seed: int = 0) -> Any:
    """Build the family's random model with transformers, save it to ``path``; return it."""
    class_name, kwargs = LLAMA4 if model_type == "llama4_text" else FAMILIES[model_type]
    config = getattr(transformers, class_name)(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
    redraw(model, seed, norm_center=0.0 if model_type.startswith("gemma") else 1.0)
    model.save_pretrained(path)
    return model.eval()


def load_hf(transformers: Any, path: Path) -> Any:
    """transformers' own implementation of the checkpoint at ``path`` (eager attention)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by transformers, recomputing the whole sequence each step."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@torch.no_grad()
def hf_logprobs(model: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log-probs of ``generated`` after ``prompt``, teacher-forced."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids).logits[0].double().log_softmax(-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(generated))
    return logits[rows, torch.tensor(generated)]


def assert_logprobs_match_hf(
    model: Any, prompts: list[list[int]], outputs: list[Any], atol: float = 5e-5
) -> None:
    """Each output's log-probs (greedy, one sample) equal transformers' teacher-forced
    ones within ``atol``, and are informative (mean below -0.1, not all near 0)."""
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].logprobs is not None
        got = torch.tensor([t.logprob for t in out.outputs[0].logprobs], dtype=torch.float64)
        want = hf_logprobs(model, prompt, out.token_ids)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        assert float(want.mean()) < -0.1


def random_ids(batch: int, length: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    """``[batch, length]`` token ids drawn from ``seed``."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_prompt(n: int, seed: int) -> list[int]:
    """An ``n``-token prompt of the tiny models' vocabulary drawn from ``seed``."""
    return random_ids(1, n, VOCAB, seed)[0].tolist()


def assert_checkpoint_matches_hf(transformers: Any, config: Any, path: Path) -> Any:
    """The engine's tiny model of ``config``, saved to ``path``, reloads as ``config`` and
    transformers loads it as ``config.architecture`` and computes the same logits over two
    40-token rows, with clear greedy margins. Returns transformers' model."""
    from kvblocks.engine.dense import dense_logits
    from kvblocks.engine.loader import load_checkpoint, save_checkpoint
    from kvblocks.engine.tiny import build_tiny_model

    model = build_tiny_model(config)
    save_checkpoint(model, path)
    assert load_checkpoint(path).config == config
    hf = load_hf(transformers, path)
    assert type(hf).__name__ == config.architecture
    ids = random_ids(2, 40)
    with torch.no_grad():
        expected = hf(ids).logits
    got = dense_logits(model, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    top2 = got.topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4  # clear greedy margins
    return hf
