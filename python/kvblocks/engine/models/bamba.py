"""Bamba: Mamba 2 mixers with full attention in a few layers (IBM's hybrid model).

Every layer is pre-norm: ``x + mixer(norm(x))`` (a Mamba 2 mixer, or attention in the
layers ``attn_layer_indices`` names), then ``x + mlp(norm(x))``. Attention is Llama's,
with its rope over the first half of each head. Parameter names follow transformers'
``BambaForCausalLM`` (``model.layers.N.mamba.*``, ``.self_attn.*``, ``.feed_forward.*``,
``.pre_ff_layernorm``, ``model.final_layernorm``), so an HF checkpoint loads as is.

The mixers' states go through a :class:`~kvblocks.engine.models.mamba2.StateBackend`:
the paged engine passes one per step (``states=``), the dense reference none (every
sequence from the zero state).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.mamba_config import BAMBA_PARTIAL_ROTARY_FACTOR
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    apply_rotary,
)
from kvblocks.engine.models.mamba2 import Mamba2Mixer, StateBackend, ZeroStates

__all__ = ["BambaDecoderLayer", "BambaForCausalLM"]


class _PartialRopeAttention(SelfAttention):
    """Llama attention whose rope turns only the first ``rotary_dim`` dims of each head."""

    def __init__(self, config: ModelConfig, layer_idx: int, cache_idx: int, **kw: object) -> None:
        super().__init__(config, layer_idx, **kw)  # type: ignore[arg-type]
        self.rotary_dim = int(config.head_dim * BAMBA_PARTIAL_ROTARY_FACTOR)
        # The attention backend indexes its caches by this (attention layers only).
        self.layer_idx = cache_idx

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """Self-attention over ``x`` ``[num_tokens, hidden]``."""
        n, r = x.shape[0], self.rotary_dim
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        out = attention(self.layer_idx, q, k, v, self.spec)
        projected: Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class BambaDecoderLayer(nn.Module):
    """One Bamba block: a mixer (Mamba 2 or attention) and an MLP, each pre-norm with a
    residual.

    Args:
        slot: the mixer's index among the model's mixers, or the attention layer's among
            its attention layers (which state or KV cache it uses).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        slot: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        assert config.mamba is not None
        eps = config.rms_norm_eps
        self.is_attention = layer_idx in config.mamba.attention_layers
        if self.is_attention:
            self.self_attn = _PartialRopeAttention(
                config, layer_idx, slot, device=device, dtype=dtype
            )
        else:
            self.mamba = Mamba2Mixer(
                config.mamba, config.hidden_size, eps, slot, device=device, dtype=dtype
            )
        self.feed_forward = GatedMLP(config, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionBackend,
        states: StateBackend,
    ) -> Tensor:
        """One block over ``x`` ``[num_tokens, hidden]``."""
        h = self.input_layernorm(x)
        if self.is_attention:
            x = x + self.self_attn(h, cos, sin, attention)
        else:
            x = x + self.mamba(h, states)
        out: Tensor = x + self.feed_forward(self.pre_ff_layernorm(x))
        return out


class BambaForCausalLM(CausalLM):
    """A Bamba causal language model (see the module docstring).

    Attention layers use KV caches ``0 .. num_kv_layers - 1`` and mixers states ``0 ..
    num_state_layers - 1``, in layer order.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(config, device=device, dtype=dtype)
        # transformers names the final norm differently.
        self.model.final_layernorm = self.model.norm
        del self.model.norm
        rotary_dim = int(config.head_dim * BAMBA_PARTIAL_ROTARY_FACTOR)
        self.rotaries = [RotaryEmbedding(rotary_dim, config.rope_theta, config.rope_scaling)]
        self.layer_rope = [0] * config.num_hidden_layers

    def build_layers(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> list[nn.Module]:
        """Attention layers and mixers, each numbered among its own kind."""
        assert config.mamba is not None
        attention = set(config.mamba.attention_layers)
        layers: list[nn.Module] = []
        counts = [0, 0]
        for i in range(config.num_hidden_layers):
            kind = int(i in attention)
            layers.append(BambaDecoderLayer(config, i, counts[kind], device=device, dtype=dtype))
            counts[kind] += 1
        return layers

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV (the attention layers)."""
        assert self.config.mamba is not None
        return len(self.config.mamba.attention_layers)

    @property
    def mixers(self) -> list[Mamba2Mixer]:
        """The Mamba 2 mixers, in layer order (their states' order)."""
        layers = [cast(BambaDecoderLayer, layer) for layer in self.model.layers]
        return [layer.mamba for layer in layers if not layer.is_attention]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionBackend,
        states: StateBackend | None = None,
    ) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm; without ``states``
        every run of positions from 0 is a sequence computed from the zero state."""
        if states is None:
            mixers = self.mixers
            conv, ssm = (mixers[0].conv_shape, mixers[0].ssm_shape) if mixers else ((0, 0), ())
            states = ZeroStates(positions, conv, ssm)
        cos, sin = self.rotaries[0](positions)
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention, states)
        out: Tensor = cast(RMSNorm, self.model.final_layernorm)(x)
        return out
