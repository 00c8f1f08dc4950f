"""The Mamba 2 mixer's shape in a hybrid model's config (Bamba), read from and written to
an HF ``config.json``.

Bamba's layers are Mamba 2 mixers except those listed in ``attn_layer_indices``, which are
attention. Each mixer projects to a gate, the convolved ``x, B, C`` and a time step per
head, convolves ``x, B, C`` causally over ``d_conv`` positions, runs the selective scan
(``n_heads`` heads of ``d_head``, state ``d_state`` per head, ``B``/``C`` shared by the
``n_groups`` head groups), and normalises the result gated by the gate. Its recurrent
state is the convolution's last ``d_conv - 1`` inputs and the scan's ``[n_heads, d_head,
d_state]`` state (see :mod:`kvblocks.engine.models.mamba2`). Switches this engine does
not implement are refused by name (a time-step limit, another rope than the default
one over half of each head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int

__all__ = [
    "BAMBA_PARTIAL_ROTARY_FACTOR",
    "MambaConfig",
    "bamba_rope_parameters",
    "mamba_from_hf",
    "mamba_to_hf",
]

#: Bamba's rope rotates this fraction of each head (transformers hard-codes it).
BAMBA_PARTIAL_ROTARY_FACTOR = 0.5


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba 2 mixers of a hybrid model (HF's ``mamba_*`` fields).

    ``attention_layers``: the layers that are attention (``attn_layer_indices``), every
    other layer a mixer. ``expand * hidden_size`` is the mixer's inner size,
    ``n_heads * d_head`` of it.
    """

    attention_layers: tuple[int, ...]
    n_heads: int = 128
    d_head: int = 64
    n_groups: int = 1
    d_state: int = 256
    d_conv: int = 4
    expand: int = 2
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False

    def check(self, hidden_size: int, num_layers: int) -> None:
        """Refuse shapes the mixer cannot have."""
        for name in ("n_heads", "d_head", "n_groups", "d_state", "d_conv", "expand", "chunk_size"):
            check_int(
                getattr(self, name), f"mamba_{name}", minimum=1, expected="a positive integer"
            )
        if self.n_heads * self.d_head != self.expand * hidden_size:
            raise InvalidArgumentError(
                f"mamba_n_heads * mamba_d_head ({self.n_heads} * {self.d_head}) must equal "
                f"mamba_expand * hidden_size ({self.expand} * {hidden_size})"
            )
        if self.n_heads % self.n_groups:
            raise InvalidArgumentError(
                f"mamba_n_heads ({self.n_heads}) must be a multiple of mamba_n_groups "
                f"({self.n_groups})"
            )
        bad = [i for i in self.attention_layers if not 0 <= i < num_layers]
        if bad or len(set(self.attention_layers)) != len(self.attention_layers):
            raise InvalidArgumentError(
                f"attn_layer_indices {list(self.attention_layers)} must be distinct layers "
                f"in [0, {num_layers})"
            )

    def inner_size(self, hidden_size: int) -> int:
        """The mixer's inner size, ``expand * hidden_size``."""
        return self.expand * hidden_size

    def conv_dim(self, hidden_size: int) -> int:
        """Channels of the convolution: ``x`` (inner size), ``B`` and ``C``."""
        return self.inner_size(hidden_size) + 2 * self.n_groups * self.d_state

    def state_numel(self, hidden_size: int) -> tuple[int, int]:
        """Values of one layer's state: the convolution's and the scan's."""
        return (
            self.conv_dim(hidden_size) * (self.d_conv - 1),
            self.n_heads * self.d_head * self.d_state,
        )


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        return default
    return int(value)


def _json_float(value: Any) -> float:
    """A float as transformers writes it (``{"__float__": "Infinity"}`` for infinities)."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


#: ``time_step_limit`` as transformers writes its default, ``(0.0, inf)``.
_NO_TIME_STEP_LIMIT = [0.0, {"__float__": "Infinity"}]


def mamba_from_hf(raw: dict[str, Any], hidden_size: int, num_layers: int) -> MambaConfig:
    """The mixers of a Bamba ``config.json`` (transformers' ``BambaConfig`` defaults)."""
    limit = raw.get("time_step_limit")
    if limit is not None and (
        len(limit) != 2 or _json_float(limit[0]) != 0.0 or not math.isinf(_json_float(limit[1]))
    ):
        # transformers clamps the time step in its prefill scan but not when decoding.
        raise InvalidArgumentError(
            f"time_step_limit={list(limit)} is not supported; expected [0.0, Infinity]"
        )
    n_heads = _int(raw, "mamba_n_heads", 128)
    expand = _int(raw, "mamba_expand", 2)
    d_head = raw.get("mamba_d_head", "auto")
    d_head = expand * hidden_size // n_heads if d_head in (None, "auto") else int(d_head)
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list):
        raise InvalidArgumentError(f"attn_layer_indices must be a list, got {indices!r}")
    config = MambaConfig(
        attention_layers=tuple(int(i) for i in indices),
        n_heads=n_heads,
        d_head=d_head,
        n_groups=_int(raw, "mamba_n_groups", 1),
        d_state=_int(raw, "mamba_d_state", 256),
        d_conv=_int(raw, "mamba_d_conv", 4),
        expand=expand,
        chunk_size=_int(raw, "mamba_chunk_size", 256),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
    )
    config.check(hidden_size, num_layers)
    return config


def bamba_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with Bamba's rope checked (the default rope over half of each head) and its
    partial rotary factor taken out, for the common rope parser."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgumentError(f"rope_parameters must be an object, got {params!r}")
    factor = params.get("partial_rotary_factor", BAMBA_PARTIAL_ROTARY_FACTOR)
    if float(factor) != BAMBA_PARTIAL_ROTARY_FACTOR:
        raise InvalidArgumentError(
            f"partial_rotary_factor={factor} is not supported for bamba; expected "
            f"{BAMBA_PARTIAL_ROTARY_FACTOR}"
        )
    if params.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise InvalidArgumentError(
            f"rope_type {params.get('rope_type')!r} is not supported for bamba; expected 'default'"
        )
    rest = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    return {**raw, "rope_parameters": rest or None}


def mamba_to_hf(config: MambaConfig) -> dict[str, Any]:
    """The ``config.json`` fields describing the mixers."""
    return {
        "attn_layer_indices": list(config.attention_layers),
        "mamba_n_heads": config.n_heads,
        "mamba_d_head": config.d_head,
        "mamba_n_groups": config.n_groups,
        "mamba_d_state": config.d_state,
        "mamba_d_conv": config.d_conv,
        "mamba_expand": config.expand,
        "mamba_chunk_size": config.chunk_size,
        "mamba_conv_bias": config.conv_bias,
        "mamba_proj_bias": config.proj_bias,
        "time_step_limit": list(_NO_TIME_STEP_LIMIT),
    }
