"""Model configuration read from a Hugging Face ``config.json``.

Only the fields a Llama-family decoder needs are kept; the three supported families
differ in a handful of switches (Qwen2: biases on q/k/v; Mistral: a sliding attention
window; Llama 3: a frequency-dependent rope scaling), so one record covers them all.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblocks.errors import InvalidArgumentError

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "RopeScaling"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""The ``model_type`` values of ``config.json`` this engine can run."""

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (``rope_scaling`` or ``rope_parameters``).

    ``rope_type`` is ``"linear"`` (positions divided by ``factor``) or ``"llama3"``
    (Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp
    in between). Other types (YaRN, dynamic NTK, LongRoPE, ...) are rejected, never
    silently run as unscaled rope.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any] | None,
        *,
        default_original_max_position_embeddings: int = 8192,
        key: str = "rope_scaling",
    ) -> RopeScaling | None:
        """Parse an HF rope dict; ``None`` or type ``"default"`` means no scaling.

        Reads both layouts: transformers 4's ``rope_scaling`` and transformers 5's
        ``rope_parameters`` (the same keys, plus ``rope_theta``, which
        :meth:`ModelConfig.from_hf_dict` reads). ``key`` names the field in errors;
        ``default_original_max_position_embeddings`` is used when a ``llama3`` dict
        lacks that entry.
        """
        if raw is None:
            return None
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise InvalidArgumentError(
                f"{key} type {rope_type!r} is not supported; expected one of "
                f"{', '.join(repr(t) for t in _SUPPORTED_ROPE_TYPES)}"
            )
        partial = raw.get("partial_rotary_factor", 1.0)
        if partial is not None and float(partial) != 1.0:
            raise InvalidArgumentError(
                f"{key}: partial_rotary_factor={partial} is not supported; expected 1.0"
            )
        if rope_type == "default":
            return None
        factor = float(raw.get("factor", 1.0))
        if factor <= 0:
            raise InvalidArgumentError(f"rope_scaling factor must be > 0, got {factor}")
        if rope_type == "linear":
            return cls(rope_type="linear", factor=factor)
        return cls(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                raw.get(
                    "original_max_position_embeddings", default_original_max_position_embeddings
                )
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The HF ``rope_scaling`` dict for this scaling."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes mirror the HF names. ``sliding_window`` is the attention window (in
    tokens, key ``j`` visible from query ``p`` iff ``p - W < j <= p``) of the layers
    listed by :meth:`layer_sliding_windows`; ``attention_bias`` adds biases to the q, k
    and v projections (Qwen2).
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgumentError(
                f"model_type {self.model_type!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise InvalidArgumentError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window}"
            )

    @property
    def architecture(self) -> str:
        """The HF class name written to ``config.json`` (``architectures[0]``)."""
        return _ARCHITECTURES[self.model_type]

    @property
    def default_scale(self) -> float:
        """Attention softmax scale, ``1 / sqrt(head_dim)``."""
        return 1.0 / math.sqrt(self.head_dim)

    def layer_sliding_windows(self) -> list[int | None]:
        """The attention window of each layer (``None`` = full attention).

        Mistral windows every layer; Qwen2 (with ``use_sliding_window``) windows the
        layers from ``max_window_layers`` on, as Hugging Face does.
        """
        n = self.num_hidden_layers
        if self.sliding_window is None:
            return [None] * n
        if self.model_type == "qwen2":
            return [self.sliding_window if i >= self.max_window_layers else None for i in range(n)]
        return [self.sliding_window] * n

    def uniform_sliding_window(self) -> int | None:
        """The window shared by every layer, or ``None`` if any layer attends fully.

        Only a uniform window lets the block manager release blocks that slid out of view.
        """
        windows = set(self.layer_sliding_windows())
        if len(windows) == 1:
            return next(iter(windows))
        return None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of an HF ``config.json``."""
        model_type = raw.get("model_type")
        if model_type is None:
            raise InvalidArgumentError("config.json has no 'model_type'")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = raw.get("head_dim")
            eos = raw.get("eos_token_id")
            if eos is None:
                eos_ids: tuple[int, ...] = ()
            elif isinstance(eos, list):
                eos_ids = tuple(int(e) for e in eos)
            else:
                eos_ids = (int(eos),)
            sliding_window = raw.get("sliding_window")
            if model_type == "qwen2" and not raw.get("use_sliding_window", False):
                sliding_window = None
            # Qwen2 always has q/k/v biases; Llama has an optional attention_bias flag.
            attention_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
            hidden_act = raw.get("hidden_act", "silu")
            if hidden_act != "silu":
                raise InvalidArgumentError(
                    f"hidden_act {hidden_act!r} is not supported; expected 'silu'"
                )
            if raw.get("mlp_bias", False):
                raise InvalidArgumentError("mlp_bias=true is not supported; expected false")
            max_positions = int(raw.get("max_position_embeddings", 4096))
            rope_theta, rope_scaling = _rope_from_hf(raw, max_positions)
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim) if head_dim else hidden // heads,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                sliding_window=int(sliding_window) if sliding_window else None,
                max_window_layers=int(raw.get("max_window_layers", 0)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=raw.get("torch_dtype"),
            )
        except KeyError as exc:
            raise InvalidArgumentError(
                f"config.json lacks the required field {exc.args[0]!r}"
            ) from None
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"config.json has a malformed field: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a ``config.json`` file (or the one inside a checkpoint directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise InvalidArgumentError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` contents describing this model."""
        raw: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_dict() if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else None,
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.model_type == "mistral":
            raw["sliding_window"] = self.sliding_window
        elif self.model_type == "qwen2":
            raw["use_sliding_window"] = self.sliding_window is not None
            raw["sliding_window"] = self.sliding_window
            raw["max_window_layers"] = self.max_window_layers
        return raw


def _rope_from_hf(raw: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either ``config.json`` layout.

    transformers 4 writes ``rope_theta`` and ``rope_scaling`` at the top level;
    transformers 5 writes one ``rope_parameters`` dict holding ``rope_type``,
    ``rope_theta`` and the scaling fields. As transformers 5 does, a non-null
    ``rope_scaling`` takes precedence over ``rope_parameters``, and a ``rope_theta``
    inside the dict over the top-level one. Per-layer-type rope dicts are rejected.
    """
    key = "rope_scaling"
    params = raw.get("rope_scaling")
    if params is None:
        key = "rope_parameters"
        params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgumentError(f"{key} must be an object, got {params!r}")
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        raise InvalidArgumentError(
            f"{key} with one entry per layer type ({', '.join(sorted(params))}) is not "
            "supported; expected a single rope configuration"
        )
    theta = raw.get("rope_theta")
    if params is not None and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise InvalidArgumentError(
            f"partial_rotary_factor={raw['partial_rotary_factor']} is not supported; expected 1.0"
        )
    rope_theta = float(theta) if theta is not None else 10000.0
    if not rope_theta > 0:
        raise InvalidArgumentError(f"rope_theta must be > 0, got {theta!r}")
    scaling = RopeScaling.from_dict(
        params, default_original_max_position_embeddings=max_positions, key=key
    )
    return rope_theta, scaling
