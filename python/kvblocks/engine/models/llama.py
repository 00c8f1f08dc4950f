"""Llama-family decoders: Llama, Mistral, Ministral, Qwen2, Qwen3 and OLMo 3.

Llama, Mistral, Ministral, Qwen2 and Qwen3 share one pre-norm block (attention and MLP
each after an RMSNorm, each with a residual); Qwen3 adds a per-head RMSNorm on queries
and keys. OLMo 3 normalises the *outputs* of attention and MLP instead, and its query
and key norms span the whole projection. Windows come from each layer's
:class:`~kvblocks.engine.config.AttentionSpec`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.layers import GatedMLP, RMSNorm, SelfAttention

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "Olmo3DecoderLayer", "Olmo3ForCausalLM"]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: attention and MLP, each with a residual connection."""

    #: The feed-forward block (a family with the same block and another MLP sets its own).
    mlp_class: type[nn.Module] = GatedMLP

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        qk_norm = "head" if config.model_type == "qwen3" else None
        self.self_attn = SelfAttention(
            config, layer_idx, qk_norm=qk_norm, device=device, dtype=dtype
        )
        self.mlp = self.mlp_class(config, device=device, dtype=dtype)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """One decoder block over ``x`` ``[num_tokens, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaForCausalLM(CausalLM):
    """A Llama / Mistral / Ministral / Qwen2 / Qwen3 causal language model.

    Args:
        config: the model's shape.
        device, dtype: where and how the parameters are created. Projection and
            embedding weights are left uninitialised (a checkpoint or the tiny model's
            seeded draw fills them), so building even a large model is instant.
    """

    decoder_layer = LlamaDecoderLayer


class Olmo3DecoderLayer(nn.Module):
    """OLMo 3's block: ``x + norm(attention(x))``, then ``x + norm(mlp(x))``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            config, layer_idx, qk_norm="projection", device=device, dtype=dtype
        )
        self.mlp = GatedMLP(config, device=device, dtype=dtype)
        eps = config.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(
            config.hidden_size, eps, device=device, dtype=dtype
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """One decoder block over ``x`` ``[num_tokens, hidden]``."""
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attention))
        out: Tensor = x + self.post_feedforward_layernorm(self.mlp(x))
        return out


class Olmo3ForCausalLM(CausalLM):
    """An OLMo 3 causal language model (3 sliding-window layers per full one by default)."""

    decoder_layer = Olmo3DecoderLayer
