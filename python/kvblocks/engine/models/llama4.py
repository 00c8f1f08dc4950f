"""Llama 4 (text-only ``Llama4ForCausalLM``): chunked local and NoPE attention, experts.

Each layer is Llama's pre-norm block (attention and feed-forward, each after an RMSNorm,
each with a residual) with Llama 4's parts (:mod:`kvblocks.engine.llama4_config`):

- **RoPE layers** rotate queries and keys in *interleaved pairs* (dimensions ``2i`` and
  ``2i + 1`` are one complex number, as transformers' ``torch.view_as_complex`` reads
  them; not the rotate-half layout of the other families), then, with ``use_qk_norm``,
  L2-normalise each head (an RMSNorm without weight, in float32). Their attention is
  chunked local attention (the layer's
  :class:`~kvblocks.engine.config.AttentionSpec` carries ``chunk_size``): a query sees
  the earlier tokens of its own ``attention_chunk_size``-token chunk only.
- **NoPE layers** apply no rope and attend to every earlier token; with
  ``attn_temperature_tuning`` their queries are multiplied by
  ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``.
- **Feed-forward**: in the ``moe_layers``, a shared expert (a SwiGLU MLP of
  ``intermediate_size``) plus routed experts. The router keeps each token's top
  ``num_experts_per_tok`` logits and weighs those experts by their sigmoid; a chosen
  expert sees the token's hidden state *already multiplied* by its weight::

      y = shared(x) + sum_e expert_e(sigmoid(logit_e) * x)
      expert_e(z) = (up * silu(gate)) @ down_proj[e],  gate, up = split(z @ gate_up_proj[e])

  (``gate_up_proj[e]`` is ``[hidden, 2 * intermediate]``, gate first, as HF stores it).
  The other layers have a dense SwiGLU MLP of ``intermediate_size_mlp``.

Attention uses the ``head_dim ** -0.5`` scale everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.llama4_config import Llama4Options
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.layers import GatedMLP, Linear, RMSNorm, SelfAttention, activation
from kvblocks.errors import InvalidArgumentError

__all__ = [
    "Llama4Attention",
    "Llama4DecoderLayer",
    "Llama4Experts",
    "Llama4ForCausalLM",
    "Llama4Moe",
    "apply_interleaved_rotary",
]


def apply_interleaved_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` in interleaved pairs (float32 math).

    Pair ``i`` is ``(x[2i], x[2i + 1])``, rotated by the angle of frequency ``i`` (cos/sin
    ``[num_tokens, 1, head_dim // 2]``): the complex product transformers' Llama 4 computes.
    """
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _l2_norm(x: Tensor, eps: float) -> Tensor:
    """Llama 4's weightless RMSNorm of the last dimension, in float32, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _options(config: ModelConfig) -> Llama4Options:
    if config.llama4 is None:  # ModelConfig refuses llama4_text without them
        raise InvalidArgumentError("a Llama 4 model needs config.llama4")
    return config.llama4


class Llama4Attention(SelfAttention):
    """Grouped-query attention with Llama 4's rope, QK norm and query temperature (the
    projections are :class:`~kvblocks.engine.models.layers.SelfAttention`'s)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        # No qk_norm for the base class: Llama 4's QK norm has no weight (_l2_norm).
        super().__init__(config, layer_idx, device=device, dtype=dtype)
        options = _options(config)
        self.use_rope = options.uses_rope(layer_idx)
        self.l2_qk_norm = options.use_qk_norm and self.use_rope
        self.temperature = options.attn_temperature_tuning and not self.use_rope
        self.eps = config.rms_norm_eps

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionBackend,
        temperature: Tensor | None = None,
    ) -> Tensor:
        """Attention over the flattened tokens ``x`` ``[num_tokens, hidden]``.

        ``temperature`` is ``[num_tokens]`` float32, each token's query scale (used by
        the NoPE layers when tuning is on).
        """
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q = apply_interleaved_rotary(q, cos, sin)
            k = apply_interleaved_rotary(k, cos, sin)
        if self.l2_qk_norm:
            q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        if self.temperature:
            if temperature is None:
                raise InvalidArgumentError("a NoPE layer with temperature tuning needs the scales")
            q = (q * temperature[:, None, None]).to(q.dtype)
        out = attention(self.layer_idx, q, k, v, self.spec)
        projected: Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class Llama4Experts(nn.Module):
    """The routed experts' stacked weights (``gate_up_proj`` ``[E, hidden, 2 * inter]``,
    ``down_proj`` ``[E, inter, hidden]``, as HF stores them)."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, device=device, dtype=dtype))
        self.act = activation(config.hidden_act)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` applied to the (already weighted) rows of ``x``."""
        gate, up = (x @ self.gate_up_proj[e]).chunk(2, dim=-1)
        out: Tensor = (up * self.act(gate)) @ self.down_proj[e]
        return out


class Llama4Moe(nn.Module):
    """Router, routed experts and the shared expert (HF's ``feed_forward`` of a MoE layer)."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(
            config.hidden_size, config.num_local_experts, bias=False, device=device, dtype=dtype
        )
        self.experts = Llama4Experts(config, device=device, dtype=dtype)
        self.shared_expert = GatedMLP(config, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """The shared expert plus each token's chosen experts, for ``x`` ``[n, hidden]``."""
        top, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.sigmoid(top.float()).to(x.dtype)
        out: Tensor = self.shared_expert(x)
        # One pass per expert that some token chose, over all the tokens that chose it;
        # an expert a token did not choose gets it weighted by sigmoid(-inf) = 0 in
        # transformers and adds exactly nothing there.
        for e in torch.unique(chosen).tolist():
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            y = self.experts.expert(e, x[token] * weights[token, slot, None])
            out.index_add_(0, token, y.to(out.dtype))
        return out


class Llama4DecoderLayer(nn.Module):
    """Pre-norm block: Llama 4 attention, then the experts or the dense MLP."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        options = _options(config)
        self.self_attn = Llama4Attention(config, layer_idx, device=device, dtype=dtype)
        self.feed_forward: nn.Module
        if options.is_moe(layer_idx):
            self.feed_forward = Llama4Moe(config, device=device, dtype=dtype)
        else:
            self.feed_forward = GatedMLP(
                config,
                device=device,
                dtype=dtype,
                intermediate_size=options.intermediate_size_mlp,
            )
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionBackend,
        temperature: Tensor | None = None,
    ) -> Tensor:
        """One decoder block over ``x`` ``[num_tokens, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, temperature)
        out: Tensor = x + self.feed_forward(self.post_attention_layernorm(x))
        return out


class Llama4ForCausalLM(CausalLM):
    """A Llama 4 text model (transformers' ``Llama4ForCausalLM``; unquantized weights)."""

    decoder_layer = Llama4DecoderLayer

    def temperature(self, positions: Tensor) -> Tensor | None:
        """The NoPE layers' query scales ``[num_tokens]`` float32 (``None`` without tuning)."""
        options = _options(self.config)
        if not options.attn_temperature_tuning:
            return None
        steps = torch.floor((positions.float() + 1.0) / options.floor_scale)
        return torch.log1p(steps) * options.attn_scale + 1.0

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the flattened batch (after the final norm);
        see :meth:`CausalLM.forward`."""
        angles = [rotary(positions) for rotary in self.rotaries]
        temperature = self.temperature(positions)
        x = self.embed(input_ids)
        for layer, rope in zip(self.model.layers, self.layer_rope, strict=True):
            cos, sin = angles[rope]
            x = layer(x, cos, sin, attention, temperature)
        out: Tensor = self.model.norm(x)
        return out
