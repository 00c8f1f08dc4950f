"""Building blocks shared by the model families: projections, norms, rope, MLP, attention.

Parameter names follow Hugging Face's modules (``weight``/``bias``, ``q_proj``,
``q_norm``, ``sinks`` ...), so an HF ``state_dict`` loads as is. Projections and
embeddings are created uninitialised: a checkpoint or the tiny model's seeded draw
fills them, so building even a large model is instant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.rope_config import RopeScaling
from kvblocks.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvblocks.engine.models.attention_backend import AttentionBackend

__all__ = [
    "Embedding",
    "GatedMLP",
    "GemmaRMSNorm",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "activation",
    "apply_rotary",
]

Device = torch.device | None
DType = torch.dtype | None


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
        device: Device = None,
        dtype: DType = None,
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
        self, num_embeddings: int, dim: int, *, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        """Rows of the table for ``ids``."""
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32, as HF Llama does.

    ``weight * normalised``, the normalised value cast back to the input dtype first.
    """

    def __init__(
        self, size: int, eps: float, *, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension of ``x`` and scale it."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (weights stored as offsets from 1).

    Computed in float32 and cast back once at the end, as transformers' Gemma does.
    """

    def __init__(
        self, size: int, eps: float, *, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension of ``x`` and scale it by ``1 + weight``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The MLP activation called ``name`` in HF configs."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"activation {name!r} is not supported; expected one of {', '.join(_ACTIVATIONS)}"
        ) from None


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
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


def _yarn_inverse_frequencies(
    inv_freq: Tensor, head_dim: int, theta: float, scaling: RopeScaling
) -> Tensor:
    """YaRN: interpolate (divide by ``factor``) the dimensions that rotate fewer than
    ``beta_slow`` times over the original context, keep those rotating more than
    ``beta_fast`` times, and ramp linearly in between (the paper's "NTK-by-parts")."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency); 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding:
    """Rotary position embedding in HF's "rotate half" layout.

    Not an ``nn.Module`` on purpose: ``model.to(dtype=torch.bfloat16)`` must not round the
    inverse frequencies. cos/sin are computed from the positions on every forward (one
    small outer product per batch, shared by the layers using this rope) instead of a
    table sized for the longest context. YaRN's attention factor multiplies cos and sin.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self._inv_freq = _inverse_frequencies(head_dim, theta, scaling).to(torch.float32)
        self._factor = scaling.yarn_attention_factor if scaling is not None else 1.0
        self._per_device: dict[torch.device, Tensor] = {}

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin, each ``[num_tokens, 1, head_dim // 2]`` float32."""
        inv_freq = self._per_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq.to(positions.device)
            self._per_device[positions.device] = inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self._factor != 1.0:
            cos, sin = cos * self._factor, sin * self._factor
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by the angles in cos/sin (float32 math)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU with ``silu``, GeGLU ...).

    ``intermediate_size`` overrides the config's (Llama 4's dense layers are wider than
    its experts).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: Device,
        dtype: DType,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        linear = partial(Linear, device=device, dtype=dtype, bias=False)
        inner = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = linear(config.hidden_size, inner)
        self.up_proj = linear(config.hidden_size, inner)
        self.down_proj = linear(inner, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` ``[num_tokens, hidden]``."""
        out: Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class SelfAttention(nn.Module):
    """Grouped-query self-attention projections around an attention backend.

    ``qk_norm`` normalises queries and keys before the rope: ``"head"`` over each head
    (Qwen3, Gemma 3), ``"projection"`` over the whole projection (OLMo 3), ``None`` not
    at all; ``norm`` is the RMSNorm class to use for it. The layer's
    :class:`~kvblocks.engine.config.AttentionSpec` (window, scale, soft-cap) and, for
    gpt-oss, its learned ``sinks`` go to the backend with every call.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        qk_norm: str | None = None,
        norm: type[RMSNorm] | type[GemmaRMSNorm] = RMSNorm,
        device: Device,
        dtype: DType,
    ) -> None:
        super().__init__()
        linear = partial(Linear, device=device, dtype=dtype)
        self.layer_idx = layer_idx
        self.spec = config.layer_attention()[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias, hidden = config.attention_bias, config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = linear(hidden, q_size, bias=bias)
        self.k_proj = linear(hidden, kv_size, bias=bias)
        self.v_proj = linear(hidden, kv_size, bias=bias)
        self.o_proj = linear(q_size, hidden, bias=config.out_proj_bias)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            q_norm, k_norm = (
                (self.head_dim, self.head_dim) if qk_norm == "head" else (q_size, kv_size)
            )
            eps = config.rms_norm_eps
            self.q_norm = norm(q_norm, eps, device=device, dtype=dtype)
            self.k_norm = norm(k_norm, eps, device=device, dtype=dtype)
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads, device=device, dtype=dtype))
            if self.spec.sinks
            else None
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """Self-attention over the flattened tokens ``x`` ``[num_tokens, hidden]``."""
        n = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attention(self.layer_idx, q, k, v, self.spec, sinks=self.sinks)
        projected: Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected
