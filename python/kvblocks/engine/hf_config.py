"""Reading and writing Hugging Face ``config.json`` files for :class:`ModelConfig`.

The conversions are functions here rather than ``ModelConfig`` methods so that the record
(:mod:`kvblocks.engine.config`) does not import its parser back.

Each family's defaults follow its transformers configuration class (checked against
transformers 5.24): a field missing from the file takes the value transformers would
give it, and a switch this engine does not implement is refused by name
(:class:`~kvblocks.errors.InvalidArgumentError`), never dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.llama4_config import LLAMA4_ARCHITECTURE, llama4_from_hf, llama4_to_hf
from kvblocks.engine.mamba_config import bamba_rope_parameters, mamba_from_hf, mamba_to_hf
from kvblocks.engine.rope_config import RopeScaling, rope_from_hf
from kvblocks.errors import InvalidArgumentError

__all__ = ["config_from_file", "config_from_hf_dict", "config_to_hf_dict"]

# model_types people reach for that are not text decoders this engine runs, with why.
_HINTS = {
    "gemma3": (
        "it is the multimodal Gemma3ForConditionalGeneration; only the text-only "
        "Gemma3ForCausalLM (model_type 'gemma3_text') is supported"
    ),
    "llama4": (
        "it is the multimodal Llama4ForConditionalGeneration; only the text-only "
        "Llama4ForCausalLM (model_type 'llama4_text') is supported"
    ),
}
# rope_theta when a config has none (transformers' per-class default_theta).
_DEFAULT_THETA = {
    "gemma3_text": 1_000_000.0,
    "gpt_oss": 150_000.0,
    "olmo3": 500_000.0,
    "llama4_text": 500_000.0,
}
_DEFAULT_SLIDING_THETA = {"gemma3_text": 10_000.0}
_PER_LAYER_TYPE_ROPE = ("gemma3_text", "olmo3")
# gpt-oss configs without any rope dict get transformers' default YaRN.
_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# Llama4TextConfig's defaults that differ from the other families'.
_LLAMA4_DEFAULTS = {
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096 * 32,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Gemma 3's default period of sliding layers (sliding_window_pattern) when layer_types
# is absent: 5 sliding layers, then a full one.
_GEMMA3_PATTERN = 6


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def _optional_float(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return None if value is None else float(value)


def _refuse_switches(model_type: str, raw: dict[str, Any]) -> None:
    """Refuse, by name, config switches whose behaviour is not implemented."""
    architectures = raw.get("architectures")
    if model_type == "llama4_text" and architectures not in (None, [LLAMA4_ARCHITECTURE]):
        raise InvalidArgumentError(
            f"architectures {architectures!r} are not supported for llama4_text; only the "
            f"text-only {LLAMA4_ARCHITECTURE} is"
        )
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise InvalidArgumentError(
            f"quantized checkpoints are not supported (quantization_config quant_method "
            f"{method!r}); use a checkpoint with unquantized weights"
        )
    if raw.get("mlp_bias", False):
        raise InvalidArgumentError("mlp_bias=true is not supported; expected false")
    if raw.get("use_bidirectional_attention"):
        raise InvalidArgumentError(
            "use_bidirectional_attention=true is not supported (a causal decoder is expected)"
        )
    if model_type == "gemma3_text" and raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma3Attention never applies it, so its meaning is unclear.
        raise InvalidArgumentError(
            "attn_logit_softcapping is not supported for gemma3_text (transformers ignores "
            "it); expected null"
        )
    if model_type in ("llama", "mistral") and raw.get("layer_types") is not None:
        kinds = set(raw["layer_types"]) if isinstance(raw["layer_types"], list) else {None}
        uniform = "sliding_attention" if raw.get("sliding_window") else "full_attention"
        if kinds != {uniform}:
            raise InvalidArgumentError(
                f"layer_types mixing attention kinds is not supported for {model_type} "
                "(transformers ignores them there); use model_type 'ministral' for "
                "alternating sliding and full attention"
            )


def _layer_types(model_type: str, raw: dict[str, Any], n: int) -> tuple[str, ...] | None:
    layer_types = raw.get("layer_types")
    if model_type in ("llama", "mistral"):
        return None  # checked uniform above; the window applies to every layer
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise InvalidArgumentError(
                f"layer_types must be a list of strings, got {layer_types!r}"
            )
        return tuple(layer_types)
    pattern = raw.get("sliding_window_pattern")
    if model_type == "gemma3_text" and pattern is not None and int(pattern) != _GEMMA3_PATTERN:
        period = int(pattern)
        if period < 1:
            raise InvalidArgumentError(f"sliding_window_pattern must be >= 1, got {pattern!r}")
        return tuple(
            "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)
        )
    return None


def config_from_file(path: str | Path) -> ModelConfig:
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
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{path} does not hold a JSON object")
    return config_from_hf_dict(raw)


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the parsed contents of an HF ``config.json``."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise InvalidArgumentError("config.json has no 'model_type'")
    if model_type in _HINTS:
        raise InvalidArgumentError(
            f"model_type {model_type!r} is not supported: {_HINTS[model_type]}"
        )
    try:
        _refuse_switches(model_type, raw)
        if model_type == "bamba":
            raw = bamba_rope_parameters(raw)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim")
        llama4 = model_type == "llama4_text"
        if llama4:
            # transformers' Llama4TextConfig defaults (head_dim is not hidden / heads).
            head_dim = 128 if "head_dim" not in raw else head_dim
            raw = {**_LLAMA4_DEFAULTS, **raw}
        num_layers = int(raw["num_hidden_layers"])
        gemma = model_type in ("gemma2", "gemma3_text")
        sliding_window = raw.get("sliding_window", 128 if model_type == "gpt_oss" else None)
        if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            sliding_window = None
        if model_type == "ministral" and "sliding_window" not in raw:
            sliding_window = 4096
        if gemma and "sliding_window" not in raw:
            sliding_window = 4096
        if model_type == "olmo3" and "sliding_window" not in raw:
            sliding_window = 4096
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v biases
        elif model_type in ("mistral", "ministral"):
            attention_bias = False  # transformers builds them without biases
        else:
            attention_bias = bool(raw.get("attention_bias", model_type == "gpt_oss"))
        if gemma:
            hidden_act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        else:
            hidden_act = raw.get("hidden_act", "silu")
        max_positions = int(raw.get("max_position_embeddings", 4096))
        ropes = rope_from_hf(
            raw,
            max_positions,
            default_theta=_DEFAULT_THETA.get(model_type, 10000.0),
            default_sliding_theta=_DEFAULT_SLIDING_THETA.get(model_type),
            per_layer_type=model_type in _PER_LAYER_TYPE_ROPE,
            default_scaling=_GPT_OSS_DEFAULT_ROPE if model_type == "gpt_oss" else None,
        )
        experts: dict[str, Any] = {}
        if model_type == "bamba":
            experts["mamba"] = mamba_from_hf(raw, hidden, num_layers)
        if model_type == "llama4_text":
            experts = _llama4_fields(raw, num_layers)
        if model_type == "gpt_oss":
            experts = {
                "num_local_experts": int(raw.get("num_local_experts", 128)),
                "num_experts_per_tok": int(
                    raw.get("num_experts_per_tok", raw.get("experts_per_token", 4))
                ),
                "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
            }
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim else hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=ropes.theta,
            rope_scaling=ropes.scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            sliding_window=int(sliding_window) if sliding_window else None,
            max_window_layers=int(raw.get("max_window_layers", 0)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            layer_types=_layer_types(model_type, raw, num_layers),
            hidden_act=hidden_act,
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar", 256.0)
            if gemma
            else None,
            attn_logit_softcapping=_optional_float(raw, "attn_logit_softcapping", 50.0)
            if model_type == "gemma2"
            else None,
            final_logit_softcapping=_optional_float(
                raw, "final_logit_softcapping", 30.0 if model_type == "gemma2" else None
            )
            if gemma
            else None,
            sliding_rope_theta=ropes.sliding_theta,
            sliding_rope_scaling=ropes.sliding_scaling,
            **experts,
        )
    except KeyError as exc:
        raise InvalidArgumentError(
            f"config.json lacks the required field {exc.args[0]!r}"
        ) from None
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"config.json has a malformed field: {exc}") from None


def _llama4_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Llama 4's experts, chunk and switches (transformers' defaults where absent)."""
    return {
        "num_local_experts": int(raw.get("num_local_experts", 16)),
        "num_experts_per_tok": int(raw.get("num_experts_per_tok", 1)),
        "attention_chunk_size": (
            None
            if raw.get("attention_chunk_size", 8192) is None
            else int(raw.get("attention_chunk_size", 8192))
        ),
        "llama4": llama4_from_hf(raw, num_layers),
    }


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    params = scaling.to_dict() if scaling is not None else {"rope_type": "default"}
    return {**params, "rope_theta": theta}


def config_to_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` contents describing ``config``."""
    c = config
    raw: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if c.eos_token_ids else None,
        "torch_dtype": c.torch_dtype or "float32",
    }
    if c.model_type in _PER_LAYER_TYPE_ROPE:
        # transformers 5's layout: one rope dict per layer type.
        sliding = (
            (c.rope_theta, c.rope_scaling)
            if c.sliding_rope_theta is None
            else (c.sliding_rope_theta, c.sliding_rope_scaling)
        )
        raw["rope_parameters"] = {
            "full_attention": _rope_dict(c.rope_theta, c.rope_scaling),
            "sliding_attention": _rope_dict(*sliding),
        }
    else:
        raw["rope_theta"] = c.rope_theta
        raw["rope_scaling"] = c.rope_scaling.to_dict() if c.rope_scaling else None
    if c.model_type not in ("llama", "llama4_text"):
        raw["sliding_window"] = c.sliding_window
    if c.model_type in ("qwen2", "qwen3"):
        raw["use_sliding_window"] = c.sliding_window is not None
        raw["max_window_layers"] = c.max_window_layers
    if c.layer_types is not None:
        raw["layer_types"] = list(c.layer_types)
    if c.model_type in ("gemma2", "gemma3_text"):
        raw["hidden_activation"] = c.hidden_act
        scalar = c.query_pre_attn_scalar
        # transformers types it as an int: write whole numbers as ints.
        raw["query_pre_attn_scalar"] = (
            int(scalar) if scalar is not None and float(scalar).is_integer() else scalar
        )
        raw["attn_logit_softcapping"] = c.attn_logit_softcapping
        raw["final_logit_softcapping"] = c.final_logit_softcapping
    if c.mamba is not None:
        raw.update(mamba_to_hf(c.mamba))
        raw["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": 0.5,
        }
        raw.pop("rope_theta", None)
        raw.pop("rope_scaling", None)
    if c.model_type == "gpt_oss":
        raw["num_local_experts"] = c.num_local_experts
        raw["num_experts_per_tok"] = c.num_experts_per_tok
        raw["swiglu_alpha"] = c.swiglu_alpha
        raw["swiglu_limit"] = c.swiglu_limit
    if c.llama4 is not None:
        raw.update(llama4_to_hf(c.llama4))
        raw["num_local_experts"] = c.num_local_experts
        raw["num_experts_per_tok"] = c.num_experts_per_tok
        raw["attention_chunk_size"] = c.attention_chunk_size
    return raw
