"""The weights identity an engine gives its shared tiers (see :mod:`kvblocks.tiers.weights`).

A checkpoint directory is identified by the digest of its files (``config.json`` and the
safetensors weights the loader reads), cached across processes; a model object (the
built-in tiny model, a model passed to ``LLM``) by the digest of its state dict and config,
as it runs (after any cast to the engine's dtype).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.loader import weight_files
from kvblocks.engine.models import CausalLM
from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers.weights import CheckpointDigest, checkpoint_digest, tensors_digest

__all__ = ["checkpoint_weights", "model_weights_digest", "weights_digest"]


def model_weights_digest(model: CausalLM) -> str:
    """The weights digest of a model object: its state dict and every field of its config."""
    return tensors_digest(dict(model.state_dict()), _config_identity(model.config))


def _config_identity(config: ModelConfig) -> dict[str, Any]:
    """Every field of ``config`` as JSON data. Not its HF dict: that leaves out what a
    family's ``config.json`` has no key for (a Llama's ``sliding_window`` or
    ``query_pre_attn_scalar``), yet the model object runs with it, and its KV differs."""
    return {"kvblocks-model-config-v1": dataclasses.asdict(config)}


def checkpoint_weights(path: str | Path) -> CheckpointDigest:
    """The weights digest of a checkpoint directory (cached; see
    :func:`kvblocks.tiers.weights.checkpoint_digest`), with the versions of its files."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidArgumentError(
            f"model path {path} is not a directory; expected a Hugging Face checkpoint "
            "directory (config.json + *.safetensors)"
        )
    return checkpoint_digest(path / "config.json", weight_files(path))


def weights_digest(model: str | Path | CausalLM) -> str:
    """The hex weights digest of a checkpoint directory or a model object: what a
    :class:`~kvblocks.tiers.layout.KVLayout`'s ``weights_digest`` must be for an ``LLM`` of
    that model to use a store built on it."""
    if isinstance(model, CausalLM):
        return model_weights_digest(model)
    return checkpoint_weights(model).digest
