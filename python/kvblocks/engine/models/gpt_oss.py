"""gpt-oss: sliding-window and full attention with sinks, and a mixture of experts.

Layers alternate 128-token windows and full attention (``layer_types``); every
projection of the attention has a bias and every layer has one learned sink logit per
query head (passed to the attention backend, see :mod:`kvblocks.ops.reference`). The
MLP is a top-k mixture of experts: a biased linear router picks ``num_experts_per_tok``
experts per token and weighs them by the softmax of their router logits; each expert is
a clamped SwiGLU whose gate and up projections are interleaved in one matrix::

    gate, up = (x @ gate_up_proj[e] + gate_up_proj_bias[e])[..., ::2], [..., 1::2]
    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    y_e = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e]

Expert weights are stored as HF stores them (``[experts, in, out]``, transposed
relative to a ``Linear``). The experts run as a loop over the experts some token chose
(batched over those tokens), not a per-token loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.llama import LlamaDecoderLayer

__all__ = ["GptOssDecoderLayer", "GptOssExperts", "GptOssForCausalLM", "GptOssMLP"]


class GptOssRouter(nn.Module):
    """Top-k routing: ``(expert ids [n, k], weights [n, k])`` per token."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(
            torch.empty(config.num_local_experts, config.hidden_size, device=device, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.empty(config.num_local_experts, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The chosen experts of each token of ``x`` ``[n, hidden]`` and their weights."""
        logits = F.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1)


class GptOssExperts(nn.Module):
    """The experts' stacked weights and their clamped SwiGLU."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self.gate_up_proj = param(e, h, 2 * i)
        self.gate_up_proj_bias = param(e, 2 * i)
        self.down_proj = param(e, i, h)
        self.down_proj_bias = param(e, h)
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` applied to the rows of ``x``."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out: Tensor = ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
        return out

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """Each token's weighted sum over its chosen experts."""
        out = torch.zeros_like(x)
        # One pass per expert that some token chose, over all the tokens that chose it.
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            y = self.expert(e, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    """Router plus experts (HF names ``mlp.router`` and ``mlp.experts``)."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.router = GptOssRouter(config, device=device, dtype=dtype)
        self.experts = GptOssExperts(config, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """The mixture-of-experts output for ``x`` ``[num_tokens, hidden]``."""
        experts, weights = self.router(x)
        out: Tensor = self.experts(x, experts, weights)
        return out


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with gpt-oss's parts: attention with sinks (from the config),
    then the mixture of experts."""

    mlp_class = GptOssMLP


class GptOssForCausalLM(CausalLM):
    """A gpt-oss causal language model (unquantized weights)."""

    decoder_layer = GptOssDecoderLayer
