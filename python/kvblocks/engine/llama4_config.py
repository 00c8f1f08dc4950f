"""Llama 4's per-layer switches (text-only ``Llama4ForCausalLM``), read from and written to
an HF ``config.json``.

Llama 4 mixes two kinds of layer: RoPE layers, whose attention is chunked local attention
(a query sees only its own ``attention_chunk_size``-token chunk) and whose queries and keys
are L2-normalised after the rope (``use_qk_norm``), and NoPE layers (a ``0`` in
``no_rope_layers``), which attend to every earlier token without any rope and scale their
queries by a temperature that grows with the position (``attn_temperature_tuning``:
``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``). Its feed-forward is a
mixture of experts in the layers ``moe_layers`` names (every ``interleave_moe_layer_step``-th
layer by default) and a dense MLP of ``intermediate_size_mlp`` in the others. The defaults
are transformers' ``Llama4TextConfig``'s (5.24).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int, check_number

__all__ = ["LLAMA4_ARCHITECTURE", "Llama4Options", "llama4_from_hf", "llama4_to_hf"]

#: The one Llama 4 class this engine runs (text only).
LLAMA4_ARCHITECTURE = "Llama4ForCausalLM"

# transformers' Llama4TextConfig defaults for the fields below.
_NO_ROPE_LAYER_INTERVAL = 4
_INTERMEDIATE_SIZE_MLP = 16384
_FLOOR_SCALE = 8192.0
_ATTN_SCALE = 0.1


@dataclass(frozen=True)
class Llama4Options:
    """The Llama 4 fields of a :class:`~kvblocks.engine.config.ModelConfig`.

    ``no_rope_layers[i]`` is 1 for a RoPE layer and 0 for a NoPE layer; ``moe_layers``
    lists the mixture-of-experts layers (the others have a dense MLP of
    ``intermediate_size_mlp``). ``use_qk_norm`` L2-normalises the queries and keys of the
    RoPE layers; ``attn_temperature_tuning`` scales the NoPE layers' queries by
    ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``.
    """

    no_rope_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    intermediate_size_mlp: int = _INTERMEDIATE_SIZE_MLP
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = _FLOOR_SCALE
    attn_scale: float = _ATTN_SCALE

    @classmethod
    def default(
        cls,
        num_layers: int,
        *,
        no_rope_layer_interval: int = _NO_ROPE_LAYER_INTERVAL,
        interleave_moe_layer_step: int = 1,
        **fields: Any,
    ) -> Llama4Options:
        """transformers' layers: a NoPE layer every ``no_rope_layer_interval`` layers (the
        last of each run), a mixture of experts every ``interleave_moe_layer_step``."""
        check_int(no_rope_layer_interval, "no_rope_layer_interval", minimum=1)
        check_int(interleave_moe_layer_step, "interleave_moe_layer_step", minimum=1)
        no_rope = tuple(int((i + 1) % no_rope_layer_interval != 0) for i in range(num_layers))
        step = interleave_moe_layer_step
        moe = tuple(range(step - 1, num_layers, step))
        return cls(no_rope_layers=no_rope, moe_layers=moe, **fields)

    def check(self, num_layers: int) -> None:
        """Refuse switches that do not fit a model of ``num_layers`` layers."""
        if len(self.no_rope_layers) < num_layers or any(
            v not in (0, 1) for v in self.no_rope_layers
        ):
            raise InvalidArgumentError(
                f"no_rope_layers must list 0 or 1 for each of the {num_layers} layers, got "
                f"{list(self.no_rope_layers)}"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < num_layers]
        if bad or len(set(self.moe_layers)) != len(self.moe_layers):
            raise InvalidArgumentError(
                f"moe_layers {list(self.moe_layers)} must be distinct layers in [0, {num_layers})"
            )
        check_int(self.intermediate_size_mlp, "intermediate_size_mlp", minimum=1)
        check_number(self.floor_scale, "floor_scale", positive=True)
        check_number(self.attn_scale, "attn_scale", positive=True)

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` applies the rope (a NoPE layer does not)."""
        return bool(self.no_rope_layers[layer_idx])

    def is_moe(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward is the mixture of experts."""
        return layer_idx in self.moe_layers


def _int_list(raw: dict[str, Any], key: str) -> tuple[int, ...] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise InvalidArgumentError(f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


def llama4_from_hf(raw: dict[str, Any], num_layers: int) -> Llama4Options:
    """The Llama 4 switches of an HF ``config.json`` (transformers' defaults where absent:
    an empty ``no_rope_layers`` also means the default pattern, as transformers reads it)."""
    defaults = Llama4Options.default(
        num_layers,
        no_rope_layer_interval=int(raw.get("no_rope_layer_interval", _NO_ROPE_LAYER_INTERVAL)),
        interleave_moe_layer_step=int(raw.get("interleave_moe_layer_step", 1)),
    )
    no_rope = _int_list(raw, "no_rope_layers") or defaults.no_rope_layers
    moe = _int_list(raw, "moe_layers")
    return Llama4Options(
        no_rope_layers=no_rope,
        moe_layers=defaults.moe_layers if moe is None else moe,
        intermediate_size_mlp=int(raw.get("intermediate_size_mlp", _INTERMEDIATE_SIZE_MLP)),
        use_qk_norm=bool(raw.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
        floor_scale=float(raw.get("floor_scale", _FLOOR_SCALE)),
        attn_scale=float(raw.get("attn_scale", _ATTN_SCALE)),
    )


def llama4_to_hf(options: Llama4Options) -> dict[str, Any]:
    """The ``config.json`` fields of ``options`` (explicit layer lists)."""
    floor = options.floor_scale
    return {
        "no_rope_layers": list(options.no_rope_layers),
        "moe_layers": list(options.moe_layers),
        "intermediate_size_mlp": options.intermediate_size_mlp,
        "use_qk_norm": options.use_qk_norm,
        "attn_temperature_tuning": options.attn_temperature_tuning,
        # transformers types it as an int: write whole numbers as ints.
        "floor_scale": int(floor) if float(floor).is_integer() else floor,
        "attn_scale": options.attn_scale,
    }
