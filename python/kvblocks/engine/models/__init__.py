"""The model families, one module each, and the registry that picks one by ``model_type``.

:mod:`~kvblocks.engine.models.attention_backend` holds the protocol every layer's attention
calls, :mod:`~kvblocks.engine.models.layers` the shared building blocks,
:mod:`~kvblocks.engine.models.base` the causal-LM shell;
:mod:`~kvblocks.engine.models.llama` (Llama, Mistral, Ministral, Qwen2, Qwen3, OLMo 3),
:mod:`~kvblocks.engine.models.gemma` (Gemma 2, Gemma 3 text) and
:mod:`~kvblocks.engine.models.gpt_oss`, :mod:`~kvblocks.engine.models.llama4` (Llama 4
text) and :mod:`~kvblocks.engine.models.bamba` (with the Mamba 2 mixer of
:mod:`~kvblocks.engine.models.mamba2`) the families.
"""

from __future__ import annotations

import torch

from kvblocks.engine.config import SUPPORTED_MODEL_TYPES, ModelConfig
from kvblocks.engine.models.attention_backend import AttentionBackend
from kvblocks.engine.models.bamba import BambaForCausalLM
from kvblocks.engine.models.base import CausalLM
from kvblocks.engine.models.gemma import GemmaForCausalLM
from kvblocks.engine.models.gpt_oss import GptOssForCausalLM
from kvblocks.engine.models.llama import LlamaForCausalLM, Olmo3ForCausalLM
from kvblocks.engine.models.llama4 import Llama4ForCausalLM
from kvblocks.errors import InvalidArgumentError

__all__ = [
    "MODEL_CLASSES",
    "AttentionBackend",
    "BambaForCausalLM",
    "CausalLM",
    "GemmaForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "LlamaForCausalLM",
    "Olmo3ForCausalLM",
    "build_model",
    "model_class",
]

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "ministral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "olmo3": Olmo3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "bamba": BambaForCausalLM,
    "llama4_text": Llama4ForCausalLM,
}
"""The implementation of each supported ``model_type``."""

assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class implementing ``config.model_type``."""
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise InvalidArgumentError(
            f"model_type {config.model_type!r} is not supported; expected one of "
            f"{', '.join(MODEL_CLASSES)}"
        ) from None


def build_model(
    config: ModelConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """An uninitialised model of ``config``'s family (a checkpoint or a draw fills it)."""
    return model_class(config)(config, device=device, dtype=dtype)
