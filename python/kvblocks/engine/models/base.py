"""What every model family shares: the causal-LM shell.

Every layer's attention is a call to an
:class:`~kvblocks.engine.models.attention_backend.AttentionBackend`, so the same weights
run on the paged KV cache and in the cache-free dense reference.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvblocks.engine.config import AttentionSpec, ModelConfig
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.layers import Embedding, GemmaRMSNorm, Linear, RMSNorm, RotaryEmbedding

__all__ = ["AttentionSpec", "CausalLM", "DecoderModel"]


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        norm: type[RMSNorm] | type[GemmaRMSNorm],
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)


class CausalLM(nn.Module):
    """A decoder-only causal language model: the shell every family fills in.

    Subclasses build ``self.model`` (a :class:`DecoderModel` whose layers take
    ``(x, cos, sin, attention)``) through :meth:`build_layers` and may override
    :meth:`embed` (Gemma scales embeddings). Each layer gets the cos/sin of its own rope
    (Gemma 3 and OLMo 3 give sliding-window layers another base); the final logits are
    soft-capped when ``config.final_logit_softcapping`` is set.

    Args:
        config: the model's shape.
        device, dtype: where and how the parameters are created (uninitialised).
    """

    norm_class: type[RMSNorm] | type[GemmaRMSNorm] = RMSNorm

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
        self.model = DecoderModel(
            config,
            self.build_layers(config, device=dev, dtype=dtype),
            self.norm_class,
            device=dev,
            dtype=dtype,
        )
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, bias=False, device=dev, dtype=dtype
        )
        # One rotary embedding per distinct (theta, scaling); layers index into them.
        ropes: dict[tuple[object, ...], int] = {}
        self.rotaries: list[RotaryEmbedding] = []
        self.layer_rope: list[int] = []
        for i in range(config.num_hidden_layers):
            key = config.layer_rope(i)
            if key not in ropes:
                ropes[key] = len(self.rotaries)
                self.rotaries.append(RotaryEmbedding(config.head_dim, *key))
            self.layer_rope.append(ropes[key])
        self.tie_weights()

    #: The family's decoder block, built once per layer by :meth:`build_layers` as
    #: ``decoder_layer(config, layer_idx, device=, dtype=)``; a family whose layers differ
    #: in kind (a hybrid) overrides :meth:`build_layers` instead.
    decoder_layer: type[nn.Module] | None = None

    def build_layers(
        self, config: ModelConfig, *, device: torch.device | None, dtype: torch.dtype | None
    ) -> list[nn.Module]:
        """The decoder layers, in order (each family's own)."""
        if self.decoder_layer is None:
            raise NotImplementedError
        return [
            self.decoder_layer(config, i, device=device, dtype=dtype)
            for i in range(config.num_hidden_layers)
        ]

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the paged cache (every layer of an attention-only
        model; a hybrid model's attention layers)."""
        return self.config.num_hidden_layers

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rope of the full-attention layers (the only one in most families)."""
        return self.rotaries[0]

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """The input embeddings of ``input_ids``."""
        out: Tensor = self.model.embed_tokens(input_ids)
        return out

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the flattened batch (after the final norm).

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``, each token's position in its sequence.
            attention: the backend that attends each layer's new tokens.
        """
        angles = [rotary(positions) for rotary in self.rotaries]
        x = self.embed(input_ids)
        for layer, rope in zip(self.model.layers, self.layer_rope, strict=True):
            cos, sin = angles[rope]
            x = layer(x, cos, sin, attention)
        out: Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits ``[rows, vocab]`` of the given hidden states (soft-capped if set)."""
        logits: Tensor = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits
