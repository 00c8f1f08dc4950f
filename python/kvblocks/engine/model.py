"""A Llama-family decoder in torch (Llama, Mistral, Qwen2) with pluggable attention.

The module tree and parameter names follow Hugging Face's ``*ForCausalLM`` classes
(``model.layers.0.self_attn.q_proj.weight`` ...), so an HF ``state_dict`` loads as is.
Everything but the attention itself lives here; the attention of every layer is a call
to an :class:`AttentionBackend`, so the same weights run on the paged KV cache (the
model runner, through :mod:`kvblocks.ops`) and in the cache-free dense reference
(:mod:`kvblocks.engine.dense`). Tokens are flattened: a batch is one ``[num_tokens]``
vector of ids with a matching vector of positions; the backend knows where each
sequence starts.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig, RopeScaling

__all__ = [
    "AttentionBackend",
    "LlamaForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
]


class AttentionBackend(Protocol):
    """Computes one layer's attention for the flattened tokens of a batch."""

    def __call__(self, layer_idx: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Attend.

        Args:
            layer_idx: which decoder layer is calling (selects its cache and window).
            query: ``[num_tokens, num_heads, head_dim]``, rotary already applied.
            key: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens, rotated.
            value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in the dtype of ``query``.
        """
        ...


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (HF names ``weight``/``bias``).

    Unlike ``nn.Linear`` it spends no time on random initialisation: every weight is
    about to be overwritten by a checkpoint or by the tiny model's seeded draw.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the projection to the last dimension of ``x``."""
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table with an uninitialised ``weight`` (see :class:`Linear`)."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        """Rows of the table for ``ids``."""
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32, as HF Llama does."""

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension of ``x`` and scale it."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotary position embedding in HF's "rotate half" layout.

    Not an ``nn.Module`` on purpose: ``model.to(dtype=torch.bfloat16)`` must not round the
    inverse frequencies. cos/sin are computed from the positions on every forward (one
    small outer product per batch, shared by all layers) instead of a table sized for
    the longest context.
    """

    def __init__(self, config: ModelConfig) -> None:
        inv = _inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self._inv_freq = inv.to(torch.float32)
        self._per_device: dict[torch.device, Tensor] = {}

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin, each ``[num_tokens, 1, head_dim // 2]`` float32."""
        inv_freq = self._per_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq.to(positions.device)
            self._per_device[positions.device] = inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by the angles in cos/sin (float32 math)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention projections around an attention backend."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        linear = partial(Linear, device=device, dtype=dtype)
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """Self-attention over the flattened tokens ``x`` ``[num_tokens, hidden]``."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        linear = partial(Linear, device=device, dtype=dtype)
        self.gate_proj = linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` ``[num_tokens, hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: attention and MLP, each with a residual connection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, device=device, dtype=dtype)
        self.mlp = LlamaMLP(config, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """One decoder block over ``x`` ``[num_tokens, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, device=device, dtype=dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """A Llama / Mistral / Qwen2 causal language model.

    Args:
        config: the model's shape.
        device, dtype: where and how the parameters are created. Projection and
            embedding weights are left uninitialised (a checkpoint or the tiny model's
            seeded draw fills them), so building even a large model is instant.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self.config = config
        self.model = LlamaModel(config, device=dev, dtype=dtype)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, bias=False, device=dev, dtype=dtype
        )
        self.rotary = RotaryEmbedding(config)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the flattened batch (after the final norm).

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``, each token's position in its sequence.
            attention: the backend that attends each layer's new tokens.
        """
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits ``[rows, vocab]`` of the given hidden states."""
        return self.lm_head(hidden).float()
