"""The built-in tiny model: random weights from a fixed seed, the default without a path.

Small enough to run the whole engine (scheduler, block manager, paged kernels) on a
CPU in milliseconds per step, yet shaped like a real model: two layers, grouped-query
attention (4 query heads over 2 KV heads), head size 64 (a size every kernel supports),
and a 256-token vocabulary that doubles as a byte tokenizer. The weights are scaled so
that logits spread over several units: greedy choices then have clear margins, which
the paged-versus-dense equality tests rely on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.llama4_config import Llama4Options
from kvblocks.engine.mamba_config import MambaConfig
from kvblocks.engine.models import CausalLM, build_model
from kvblocks.engine.rope_config import RopeScaling

__all__ = ["TINY_SEED", "build_tiny_model", "tiny_config"]

TINY_SEED = 0
"""Default seed of the tiny model's weights."""


_SLIDE, _FULL = "sliding_attention", "full_attention"

# What each newer family changes in the tiny config, so that every switch is exercised:
# windows short enough (8 tokens) that prompts outgrow them, the soft-caps small enough
# to bend the scores, a rope per layer kind, experts and sinks.
_FAMILY_TINY: dict[str, dict[str, Any]] = {
    "ministral": {"sliding_window": 8, "layer_types": (_SLIDE, _FULL)},
    "qwen3": {"sliding_window": 8, "max_window_layers": 1},
    # OLMo 3 has no head_dim field (hidden / heads): 4 heads of 64.
    "olmo3": {
        "sliding_window": 8,
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "rope_theta": 500000.0,
    },
    "gemma2": {
        "sliding_window": 8,
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32.0,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "sliding_window": 8,
        "num_hidden_layers": 3,
        "layer_types": (_SLIDE, _SLIDE, _FULL),
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 1_000_000.0,
        "rope_scaling": RopeScaling("linear", 4.0),
        "sliding_rope_theta": 10_000.0,
        "tie_word_embeddings": True,
    },
    # Bamba: three Mamba 2 mixers (two head groups) around two attention layers of
    # 64-dim heads (hidden / heads, as transformers builds them).
    "bamba": {
        "hidden_size": 128,
        "num_hidden_layers": 5,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "mamba": MambaConfig(
            attention_layers=(1, 3), n_heads=4, d_head=64, n_groups=2, d_state=16, d_conv=4
        ),
    },
    # Llama 4: three chunked RoPE layers of 16-token chunks and a NoPE layer, experts
    # in every other layer, a temperature that changes every 8 positions, Llama 3 rope.
    "llama4_text": {
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": RopeScaling("llama3", 8.0, original_max_position_embeddings=64),
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "attention_chunk_size": 16,
        "llama4": Llama4Options(
            no_rope_layers=(1, 1, 1, 0),
            moe_layers=(1, 3),
            intermediate_size_mlp=128,
            floor_scale=8.0,
            attn_scale=0.5,
        ),
    },
    "gpt_oss": {
        "sliding_window": 8,
        "attention_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 150000.0,
        "max_position_embeddings": 256,
        "rope_scaling": RopeScaling(
            "yarn", 4.0, original_max_position_embeddings=64, truncate=False
        ),
    },
}


def tiny_config(model_type: str = "llama", **overrides: object) -> ModelConfig:
    """The tiny model's config for a family (any of ``SUPPORTED_MODEL_TYPES``).

    Mistral gets a 24-token sliding window and Qwen2 its q/k/v biases; the families with
    per-layer windows get 8-token windows on some layers and full attention on others,
    Gemma its soft-caps, scale and local/global ropes, gpt-oss four experts (two per
    token), sinks and YaRN, Llama 4 16-token chunks, a NoPE layer, experts and dense
    layers, so each family's difference is exercised. ``overrides``
    replace any field.
    """
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=model_type == "qwen2",
        sliding_window=24 if model_type == "mistral" else None,
        torch_dtype="float32",
    )
    return ModelConfig(**{**fields, **_FAMILY_TINY.get(model_type, {}), **overrides})


@torch.no_grad()
def build_tiny_model(
    config: ModelConfig | None = None,
    *,
    seed: int = TINY_SEED,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """A model with deterministic random weights (same seed, same weights, on any device).

    Weights are drawn on the CPU in float32 from ``torch.Generator().manual_seed(seed)``
    in parameter-name order, then moved and cast, so the model does not depend on the
    device's random number generator.
    """
    config = config or tiny_config()
    model = build_model(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by 1 + weight: their weights are drawn around 0, not 1.
    norm_center = 0.0 if config.model_type in ("gemma2", "gemma3_text") else 1.0
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if name.endswith("norm.weight"):
            # Around 1 rather than exactly 1, so a loader that swaps norms is caught.
            param.copy_(norm_center + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith((".bias", "_bias")):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith((".sinks", ".D")):
            # Sink logits of the order of the scores, so that they visibly matter; the
            # same for a mixer's skip.
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name.endswith(".A_log"):
            # Decay rates in [0.5, 4.5) per unit time step: the state remembers a few
            # tokens back, not just the last one.
            param.copy_(torch.log(0.5 + 4 * torch.rand(param.shape, generator=gen)))
        elif name == "model.embed_tokens.weight":
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            # Logit standard deviation ~3: decisive greedy choices.
            param.copy_(3.0 / math.sqrt(param.shape[1]) * torch.randn(param.shape, generator=gen))
        else:
            # Fan-in: the last dimension (a convolution's kernel; a linear's inputs).
            std = 1.0 / math.sqrt(param.shape[-1])
            param.copy_(std * torch.randn(param.shape, generator=gen))
    return model.to(device=device, dtype=dtype).eval()
