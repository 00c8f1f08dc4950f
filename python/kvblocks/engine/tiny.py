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
from dataclasses import replace

import torch

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.model import LlamaForCausalLM

__all__ = ["TINY_SEED", "build_tiny_model", "tiny_config"]

TINY_SEED = 0
"""Default seed of the tiny model's weights."""


def tiny_config(model_type: str = "llama", **overrides: object) -> ModelConfig:
    """The tiny model's config for a family (``"llama"``, ``"mistral"``, ``"qwen2"``).

    Mistral gets a 24-token sliding window and Qwen2 its q/k/v biases, so each family's
    difference is exercised; ``overrides`` replace any field.
    """
    config = ModelConfig(
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
    return replace(config, **overrides)  # type: ignore[arg-type]


@torch.no_grad()
def build_tiny_model(
    config: ModelConfig | None = None,
    *,
    seed: int = TINY_SEED,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A model with deterministic random weights (same seed, same weights, on any device).

    Weights are drawn on the CPU in float32 from ``torch.Generator().manual_seed(seed)``
    in parameter-name order, then moved and cast, so the model does not depend on the
    device's random number generator.
    """
    config = config or tiny_config()
    model = LlamaForCausalLM(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            # Around 1 rather than exactly 1, so a loader that swaps norms is caught.
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif name == "model.embed_tokens.weight":
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            # Logit standard deviation ~3: decisive greedy choices.
            param.copy_(3.0 / math.sqrt(param.shape[1]) * torch.randn(param.shape, generator=gen))
        else:
            std = 1.0 / math.sqrt(param.shape[1])
            param.copy_(std * torch.randn(param.shape, generator=gen))
    return model.to(device=device, dtype=dtype).eval()
