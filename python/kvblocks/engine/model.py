"""The decoder models with pluggable attention (compatibility module).

The implementations live in :mod:`kvblocks.engine.models` (one module per family, the
shared blocks in :mod:`kvblocks.engine.models.layers`); this module keeps the names
earlier code imported from here. The module tree and parameter names follow Hugging
Face's ``*ForCausalLM`` classes (``model.layers.0.self_attn.q_proj.weight`` ...), so an
HF ``state_dict`` loads as is, and every layer's attention is a call to an
:class:`AttentionBackend`.
"""

from __future__ import annotations

from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.models import (
    CausalLM,
    GemmaForCausalLM,
    GptOssForCausalLM,
    LlamaForCausalLM,
    Olmo3ForCausalLM,
    build_model,
)
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.layers import (
    GemmaRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    _inverse_frequencies,
    apply_rotary,
)

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "CausalLM",
    "GemmaForCausalLM",
    "GemmaRMSNorm",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "Olmo3ForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "_inverse_frequencies",
    "apply_rotary",
    "build_model",
]
