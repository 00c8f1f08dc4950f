"""Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM``).

Both wrap attention and MLP in RMSNorms on both sides (``input``/``post_attention``,
``pre_feedforward``/``post_feedforward``), use Gemma's ``(1 + weight)`` RMSNorm, scale
the input embeddings by ``sqrt(hidden_size)`` (rounded to the weights' dtype, as
transformers does), use the ``query_pre_attn_scalar ** -0.5`` attention scale and
alternate sliding-window and full-attention layers. Gemma 2 soft-caps the attention
logits (``attn_logit_softcapping``, carried by each layer's
:class:`~kvblocks.engine.config.AttentionSpec`) and both may soft-cap the final logits.
Gemma 3 adds a per-head RMSNorm on queries and keys and gives its sliding layers their
own rope base (``rope_local_base_freq``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.layers import GatedMLP, GemmaRMSNorm, SelfAttention

__all__ = ["GemmaDecoderLayer", "GemmaForCausalLM"]


class GemmaDecoderLayer(nn.Module):
    """Gemma's sandwich block: ``x + norm(attn(norm(x)))``, then the same for the MLP."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        qk_norm = "head" if config.model_type == "gemma3_text" else None
        self.self_attn = SelfAttention(
            config, layer_idx, qk_norm=qk_norm, norm=GemmaRMSNorm, device=device, dtype=dtype
        )
        self.mlp = GatedMLP(config, device=device, dtype=dtype)

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """One decoder block over ``x`` ``[num_tokens, hidden]``."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attention)
        x = x + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        out: Tensor = x + self.post_feedforward_layernorm(mlp_out)
        return out


class GemmaForCausalLM(CausalLM):
    """A Gemma 2 or Gemma 3 (text) causal language model."""

    norm_class = GemmaRMSNorm

    decoder_layer = GemmaDecoderLayer

    def embed(self, input_ids: Tensor) -> Tensor:
        """Embeddings times ``sqrt(hidden_size)``, the factor rounded to the weights' dtype."""
        table = self.model.embed_tokens.weight
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=table.dtype, device=table.device)
        out: Tensor = self.model.embed_tokens(input_ids) * scale
        return out
