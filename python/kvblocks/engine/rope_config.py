"""Rotary-embedding configuration read from a Hugging Face ``config.json``.

One :class:`RopeScaling` describes the frequency scaling of one rope (``linear``,
``llama3`` or ``yarn``); :func:`rope_from_hf` reads a config's rope in either layout
(transformers 4's top-level ``rope_theta`` + ``rope_scaling``, transformers 5's
``rope_parameters``), including the per-layer-type dicts of models whose sliding-window
layers use another rope than their full-attention layers (Gemma 3, OLMo 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvblocks.errors import InvalidArgumentError

__all__ = ["LayerRopes", "RopeScaling", "rope_from_hf"]

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (``rope_scaling`` or ``rope_parameters``).

    ``rope_type`` is ``"linear"`` (positions divided by ``factor``), ``"llama3"``
    (Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp
    in between) or ``"yarn"`` (YaRN, as gpt-oss uses it: dimensions below the
    ``beta_fast``/``beta_slow`` correction range extrapolated, above it interpolated by
    ``factor``, cos/sin multiplied by :attr:`yarn_attention_factor`). Other types
    (dynamic NTK, LongRoPE, ...) are rejected, never silently run as unscaled rope.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

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
        :func:`rope_from_hf` reads). ``key`` names the field in errors;
        ``default_original_max_position_embeddings`` is used when a ``llama3`` or
        ``yarn`` dict lacks that entry (transformers uses ``max_position_embeddings``).
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
        original = int(
            raw.get("original_max_position_embeddings") or default_original_max_position_embeddings
        )
        raw_factor = raw.get("factor")
        if raw_factor is None and rope_type == "yarn":
            # transformers: a YaRN dict without a factor scales max_position_embeddings.
            raw_factor = default_original_max_position_embeddings / original
        factor = float(1.0 if raw_factor is None else raw_factor)
        if not factor > 0:
            raise InvalidArgumentError(f"{key} factor must be > 0, got {raw_factor!r}")
        if rope_type == "linear":
            return cls(rope_type="linear", factor=factor)
        if rope_type == "llama3":
            return cls(
                rope_type="llama3",
                factor=factor,
                low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
                high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=original,
            )

        def optional(name: str) -> float | None:
            return None if raw.get(name) is None else float(raw[name])

        return cls(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            # transformers reads `x or default`: an explicit 0 means the default too.
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            truncate=bool(raw.get("truncate", True)),
            attention_factor=optional("attention_factor"),
            mscale=optional("mscale"),
            mscale_all_dim=optional("mscale_all_dim"),
        )

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's cos/sin multiplier (1.0 for the other types).

        The configured ``attention_factor``, else ``0.1 * ln(factor) + 1`` (with
        ``mscale``/``mscale_all_dim`` the ratio of two such terms), as transformers does.
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(
                self.factor, self.mscale_all_dim
            )
        return get_mscale(self.factor)

    def to_dict(self) -> dict[str, Any]:
        """The HF ``rope_scaling`` dict for this scaling."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "yarn":
            raw: dict[str, Any] = {
                "rope_type": "yarn",
                "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "truncate": self.truncate,
            }
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    raw[name] = getattr(self, name)
            return raw
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class LayerRopes:
    """The rope of the full-attention layers and, if it differs, of the sliding ones.

    ``sliding_theta`` is ``None`` when the sliding-window layers share the full layers'
    rope (theta and scaling); otherwise they use ``sliding_theta`` and
    ``sliding_scaling``.
    """

    theta: float
    scaling: RopeScaling | None
    sliding_theta: float | None = None
    sliding_scaling: RopeScaling | None = None


def _check_theta(theta: Any, key: str) -> float:
    value = float(theta)
    if not value > 0 or math.isinf(value):
        raise InvalidArgumentError(f"{key} rope_theta must be a finite number > 0, got {theta!r}")
    return value


def rope_from_hf(
    raw: dict[str, Any],
    max_positions: int,
    *,
    default_theta: float = 10000.0,
    default_sliding_theta: float | None = None,
    per_layer_type: bool = False,
    default_scaling: dict[str, Any] | None = None,
) -> LayerRopes:
    """The ropes of an HF ``config.json`` in either layout.

    transformers 4 writes ``rope_theta`` and ``rope_scaling`` at the top level;
    transformers 5 writes one ``rope_parameters`` dict holding ``rope_type``,
    ``rope_theta`` and the scaling fields, or, for models with ``per_layer_type`` ropes,
    one such dict per layer type (``full_attention``, ``sliding_attention``). As
    transformers 5 does, a non-null ``rope_scaling`` takes precedence over
    ``rope_parameters``, and a ``rope_theta`` inside the dict over the top-level one; in
    the flat layout of a per-layer-type model the scaling applies to the full-attention
    layers only and the sliding layers' theta is ``rope_local_base_freq`` (Gemma 3)
    or ``default_sliding_theta``. ``default_scaling`` is the rope dict used when the
    config has none (gpt-oss defaults to YaRN). Per-layer-type dicts are rejected for
    the other models.
    """
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise InvalidArgumentError(
            f"partial_rotary_factor={raw['partial_rotary_factor']} is not supported; expected 1.0"
        )
    key = "rope_scaling"
    params = raw.get("rope_scaling")
    if params is None:
        key = "rope_parameters"
        params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgumentError(f"{key} must be an object, got {params!r}")
    if params is None and default_scaling is not None:
        params = dict(default_scaling)
    nested = params is not None and any(isinstance(v, dict) for v in params.values())
    top_theta = raw.get("rope_theta")

    def one(sub: dict[str, Any] | None, sub_key: str, fallback_theta: float) -> tuple[float, Any]:
        theta = top_theta if top_theta is not None else fallback_theta
        if sub is not None and sub.get("rope_theta") is not None:
            theta = sub["rope_theta"]
        scaling = RopeScaling.from_dict(
            sub, default_original_max_position_embeddings=max_positions, key=sub_key
        )
        return _check_theta(theta, sub_key), scaling

    if nested:
        assert params is not None
        if not per_layer_type or set(params) - set(_LAYER_TYPE_KEYS):
            raise InvalidArgumentError(
                f"{key} with one entry per layer type ({', '.join(sorted(params))}) is not "
                "supported for this model; expected a single rope configuration"
            )
        full = params.get("full_attention")
        sliding = params.get("sliding_attention")
        for name, sub in (("full_attention", full), ("sliding_attention", sliding)):
            if sub is not None and not isinstance(sub, dict):
                raise InvalidArgumentError(f"{key}.{name} must be an object, got {sub!r}")
        theta, scaling = one(full, f"{key}.full_attention", default_theta)
        local_default = default_theta if default_sliding_theta is None else default_sliding_theta
        sliding_theta, sliding_scaling = one(sliding, f"{key}.sliding_attention", local_default)
    else:
        theta, scaling = one(params, key, default_theta)
        if not per_layer_type:
            return LayerRopes(theta, scaling)
        local = raw.get("rope_local_base_freq")
        if local is None:
            local = theta if default_sliding_theta is None else default_sliding_theta
        sliding_theta, sliding_scaling = _check_theta(local, "rope_local_base_freq"), None
    if sliding_theta == theta and sliding_scaling == scaling:
        return LayerRopes(theta, scaling)
    return LayerRopes(theta, scaling, sliding_theta, sliding_scaling)
