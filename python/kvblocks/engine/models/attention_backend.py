"""The attention-backend protocol every model layer calls.

A batch is flattened: one ``[num_tokens]`` vector of ids with a matching vector of
positions; the attention backend knows where each sequence starts. Every layer's
attention is a call to an :class:`AttentionBackend`, so the same weights run on the
paged KV cache (the model runner, through :mod:`kvblocks.ops`) and in the cache-free
dense reference (:mod:`kvblocks.engine.dense`). The protocol sits below both the layers
(:mod:`kvblocks.engine.models.layers`) and the causal-LM shell
(:mod:`kvblocks.engine.models.base`), which both name it.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from kvblocks.engine.config import AttentionSpec

__all__ = ["AttentionBackend"]


class AttentionBackend(Protocol):
    """Computes one layer's attention for the flattened tokens of a batch."""

    def __call__(
        self,
        layer_idx: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        spec: AttentionSpec,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Attend.

        Args:
            layer_idx: which decoder layer is calling (selects its cache).
            query: ``[num_tokens, num_heads, head_dim]``, rotary already applied.
            key: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens, rotated.
            value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens.
            spec: the layer's window, scale and soft-cap.
            sinks: ``[num_heads]`` learned sink logits when ``spec.sinks`` (gpt-oss).

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in the dtype of ``query``.
        """
        ...
