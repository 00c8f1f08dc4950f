"""Model configuration read from a Hugging Face ``config.json``.

One record covers every supported family; they differ in a handful of switches:

- Llama-family decoders: ``llama`` (frequency-dependent Llama 3 or YaRN rope),
  ``mistral`` (one sliding window for every layer), ``ministral`` (``layer_types``
  mixing sliding-window and full-attention layers), ``qwen2`` (q/k/v biases, windows
  from ``max_window_layers`` on), ``qwen3`` (per-head QK RMSNorm), ``olmo3`` (norms
  after attention and MLP, QK RMSNorm over the whole projection, 3 sliding layers per
  full one, a rope per layer type);
- ``gemma2`` and ``gemma3_text`` (Gemma 3's text-only ``Gemma3ForCausalLM``): Gemma's
  ``(1 + weight)`` RMSNorm, norms before and after attention and MLP, embeddings scaled
  by ``sqrt(hidden_size)``, ``gelu_pytorch_tanh``, the ``query_pre_attn_scalar``
  attention scale, alternating window and full layers, logit soft-caps (Gemma 2), QK
  norm and local/global rope bases (Gemma 3);
- ``gpt_oss``: alternating 128-token windows and full attention, attention sinks,
  biases on every attention projection, a top-k mixture of experts with a clamped
  SwiGLU, YaRN rope;
- ``bamba``: Mamba 2 mixers (recurrent layers, :attr:`ModelConfig.mamba`) with full
  attention in the layers ``attn_layer_indices`` names, its rope over half of each head;
- ``llama4_text`` (the text-only ``Llama4ForCausalLM``): chunked local attention
  (``attention_chunk_size``) with an interleaved rope and L2-normalised queries and keys
  in the RoPE layers, full attention without rope and with a position-dependent query
  temperature in the NoPE layers, a mixture of experts (sigmoid router, shared expert)
  and dense MLP layers (:attr:`ModelConfig.llama4`,
  :mod:`kvblocks.engine.llama4_config`).

Anything else (another ``model_type``, a quantized checkpoint, a rope type or switch
that is not implemented) raises :class:`~kvblocks.errors.InvalidArgumentError` naming
it; nothing is silently run as something else. The ``config.json`` parsing and writing
live in :mod:`kvblocks.engine.hf_config` (``config_from_file``, ``config_from_hf_dict``,
``config_to_hf_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvblocks.engine.llama4_config import LLAMA4_ARCHITECTURE, Llama4Options
from kvblocks.engine.mamba_config import MambaConfig
from kvblocks.engine.rope_config import RopeScaling
from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int, check_number, check_optional_int

__all__ = [
    "LAYER_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "AttentionSpec",
    "ModelConfig",
    "RopeScaling",
]

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "bamba": "BambaForCausalLM",
    "llama4_text": LLAMA4_ARCHITECTURE,
}

SUPPORTED_MODEL_TYPES = tuple(_ARCHITECTURES)
"""The ``model_type`` values of ``config.json`` this engine can run."""

_FULL, _SLIDE, _CHUNK = "full_attention", "sliding_attention", "chunked_attention"
LAYER_TYPES = (_FULL, _SLIDE)
"""The ``layer_types`` entries this engine can run (and ``"chunked_attention"`` for
Llama 4, whose layers are full or chunked, never sliding)."""
_LLAMA4 = "llama4_text"
_LLAMA4_LAYER_TYPES = (_FULL, _CHUNK)

# Families whose layers alternate windows by a fixed pattern when layer_types is absent:
# a layer is full attention iff (index + 1) % period == 0 (transformers' defaults).
_DEFAULT_FULL_PERIOD = {"gemma2": 2, "gemma3_text": 6, "gpt_oss": 2, "olmo3": 4}
_GEMMA = ("gemma2", "gemma3_text")
# transformers ignores attention_bias for these (no biases) or always has q/k/v biases.
_NO_ATTENTION_BIAS = ("mistral", "ministral")
# The output projection carries a bias exactly when the q/k/v ones do.
_OUT_PROJ_BIAS = (
    "llama",
    "qwen3",
    "olmo3",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "bamba",
    _LLAMA4,
)
# The families with a mixture of experts.
_MOE = ("gpt_oss", _LLAMA4)
_ACTIVATIONS = {
    "llama": ("silu",),
    "gemma": ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu"),
}


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes beyond causal ``softmax(q k^T) v``.

    ``sliding_window``: key ``j`` is visible from query ``p`` iff ``p - W < j <= p``
    (``None``: every earlier key); ``scale`` multiplies ``q . k``; ``soft_cap`` applies
    ``cap * tanh(s / cap)`` to the scaled scores (Gemma 2); ``sinks`` says the layer
    passes a learned per-head sink logit (gpt-oss); ``chunk_size`` makes it chunked local
    attention (Llama 4): key ``j`` is visible from query ``p`` iff ``j <= p`` and both are
    in the same ``chunk_size``-token chunk (``j // C == p // C``). The exact formula is in
    :mod:`kvblocks.ops.reference`; the paged engine runs a chunked layer as ordinary
    causal attention over each chunk (:class:`~kvblocks.engine.runner.PagedAttention`).
    """

    sliding_window: int | None
    scale: float
    soft_cap: float | None = None
    sinks: bool = False
    chunk_size: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a supported decoder (see the module docstring).

    Attributes mirror the HF names. ``sliding_window`` is the attention window of the
    layers :meth:`layer_types_resolved` marks ``"sliding_attention"``; ``layer_types``
    lists them explicitly (``None``: the family's default pattern); ``attention_bias``
    adds biases to the q, k and v projections (and to the output projection where the
    family does). ``sliding_rope_theta``/``sliding_rope_scaling`` are the rope of the
    sliding layers when it differs from the full layers' (``None``: the same).
    ``query_pre_attn_scalar`` sets the attention scale to its inverse square root
    (Gemma; ``None``: ``1/sqrt(head_dim)``). ``num_local_experts`` > 0 makes the MLP a
    mixture of experts (gpt-oss) with ``num_experts_per_tok`` experts per token.
    ``mamba`` describes the recurrent mixers of a hybrid model (Bamba; ``None`` for the
    attention-only families). ``attention_chunk_size`` is the chunk of Llama 4's
    ``"chunked_attention"`` layers and ``llama4`` its other switches (``None`` for the
    other families).
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
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mamba: MambaConfig | None = None
    attention_chunk_size: int | None = None
    llama4: Llama4Options | None = None

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
            check_int(getattr(self, name), name, minimum=1, expected="a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        check_optional_int(
            self.sliding_window,
            "sliding_window",
            minimum=1,
            expected="a positive integer or None",
        )
        self._check_layer_types()
        self._check_numerics()
        self._check_experts()
        if self.model_type == "bamba" and self.mamba is None:
            raise InvalidArgumentError("bamba needs mamba (its mixers' MambaConfig)")
        if self.model_type != "bamba" and self.mamba is not None:
            raise InvalidArgumentError(f"mamba applies to bamba, not to {self.model_type}")
        if self.mamba is not None:
            self.mamba.check(self.hidden_size, self.num_hidden_layers)
        self._check_llama4()

    def _check_llama4(self) -> None:
        check_optional_int(
            self.attention_chunk_size,
            "attention_chunk_size",
            minimum=1,
            expected="a positive integer or None",
        )
        if self.model_type != _LLAMA4:
            for name in ("llama4", "attention_chunk_size"):
                if getattr(self, name) is not None:
                    raise InvalidArgumentError(
                        f"{name} applies to llama4_text, not to {self.model_type}"
                    )
            return
        if self.llama4 is None:
            raise InvalidArgumentError("llama4_text needs llama4 (its Llama4Options)")
        self.llama4.check(self.num_hidden_layers)
        if self.sliding_window is not None:
            raise InvalidArgumentError(
                "sliding_window is not supported for llama4_text (its local layers are "
                "chunked: attention_chunk_size)"
            )
        if _CHUNK in self.layer_types_resolved() and self.attention_chunk_size is None:
            raise InvalidArgumentError(
                "layer_types has chunked_attention layers but attention_chunk_size is None"
            )

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if self.model_type in ("llama", "mistral"):
            # transformers ignores layer_types for these two; Ministral is Mistral with them.
            raise InvalidArgumentError(
                f"layer_types are not supported for {self.model_type} (transformers ignores "
                "them); use model_type 'ministral' for per-layer sliding and full attention"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise InvalidArgumentError(
                f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        allowed = _LLAMA4_LAYER_TYPES if self.model_type == _LLAMA4 else LAYER_TYPES
        unknown = sorted(set(self.layer_types) - set(allowed))
        if unknown:
            raise InvalidArgumentError(
                f"layer_types {', '.join(repr(t) for t in unknown)} are not supported for "
                f"{self.model_type}; expected {' or '.join(repr(t) for t in allowed)}"
            )

    def _check_numerics(self) -> None:
        family = "gemma" if self.model_type in _GEMMA else "llama"
        if self.model_type != "gpt_oss" and self.hidden_act not in _ACTIVATIONS[family]:
            raise InvalidArgumentError(
                f"hidden_act {self.hidden_act!r} is not supported for {self.model_type}; "
                f"expected {' or '.join(repr(a) for a in _ACTIVATIONS[family])}"
            )
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "sliding_rope_theta",
        ):
            value = getattr(self, name)
            if value is not None:
                check_number(value, name, positive=True)
        if self.sliding_rope_theta is None and self.sliding_rope_scaling is not None:
            raise InvalidArgumentError("sliding_rope_scaling needs a sliding_rope_theta")

    def _check_experts(self) -> None:
        if self.model_type not in _MOE:
            if self.num_local_experts:
                raise InvalidArgumentError(
                    f"num_local_experts applies to {' and '.join(_MOE)}, not to {self.model_type}"
                )
            return
        experts, top_k = self.num_local_experts, self.num_experts_per_tok
        for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
            check_int(value, name, minimum=1, expected="a positive integer")
        if top_k > experts:
            raise InvalidArgumentError(
                f"num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})"
            )
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def architecture(self) -> str:
        """The HF class name written to ``config.json`` (``architectures[0]``)."""
        return _ARCHITECTURES[self.model_type]

    @property
    def attention_scale(self) -> float:
        """Attention softmax scale: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
        if self.query_pre_attn_scalar is not None:
            return 1.0 / math.sqrt(self.query_pre_attn_scalar)
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def default_scale(self) -> float:
        """The attention scale (:attr:`attention_scale`; the name predates Gemma)."""
        return self.attention_scale

    @property
    def out_proj_bias(self) -> bool:
        """Whether ``o_proj`` has a bias (with ``attention_bias``, except Qwen2's)."""
        return self.attention_bias and self.model_type in _OUT_PROJ_BIAS

    @property
    def has_attention_sinks(self) -> bool:
        """Whether every layer has a learned per-head sink logit (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that are recurrent mixers (Bamba's Mamba 2 layers); empty for the
        attention-only families."""
        if self.mamba is None:
            return ()
        attention = set(self.mamba.attention_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in attention)

    def layer_types_resolved(self) -> list[str]:
        """Each layer's kind, ``"sliding_attention"`` or ``"full_attention"``.

        ``layer_types`` when given; otherwise the family's default: Mistral and (with a
        window) Ministral slide in every layer, Qwen2/Qwen3 from ``max_window_layers``
        on, Gemma 2 and gpt-oss in every other layer, Gemma 3 in 5 of 6, OLMo 3 in 3 of 4
        (as transformers fills in a missing ``layer_types``).
        """
        if self.layer_types is not None:
            return list(self.layer_types)
        n = self.num_hidden_layers
        if self.llama4 is not None:
            # Llama 4: RoPE layers are chunked (when there is a chunk), NoPE layers full.
            chunked = self.attention_chunk_size is not None
            return [_CHUNK if chunked and self.llama4.uses_rope(i) else _FULL for i in range(n)]
        period = _DEFAULT_FULL_PERIOD.get(self.model_type)
        if period is not None:
            return [_FULL if (i + 1) % period == 0 else _SLIDE for i in range(n)]
        if self.sliding_window is None:
            return [_FULL] * n
        if self.model_type in ("qwen2", "qwen3"):
            return [_SLIDE if i >= self.max_window_layers else _FULL for i in range(n)]
        return [_SLIDE] * n

    def layer_sliding_windows(self) -> list[int | None]:
        """The attention window of each layer (``None`` = full attention).

        A layer slides when :meth:`layer_types_resolved` says so and the config has a
        ``sliding_window`` (transformers runs a "sliding" layer without one as full).
        """
        return [
            self.sliding_window if kind == _SLIDE else None for kind in self.layer_types_resolved()
        ]

    def layer_attention_chunks(self) -> list[int | None]:
        """The attention chunk of each layer (``None``: not chunked; Llama 4's
        ``"chunked_attention"`` layers have ``attention_chunk_size``)."""
        return [
            self.attention_chunk_size if kind == _CHUNK else None
            for kind in self.layer_types_resolved()
        ]

    def uniform_sliding_window(self) -> int | None:
        """The window shared by every layer, or ``None`` if any layer attends fully.

        Only a uniform window lets the block manager release blocks that slid out of view.
        """
        windows = set(self.layer_sliding_windows())
        if len(windows) == 1:
            return next(iter(windows))
        return None

    def layer_attention(self) -> list[AttentionSpec]:
        """Each layer's :class:`AttentionSpec` (window, scale, soft-cap, sinks, chunk)."""
        return [
            AttentionSpec(
                sliding_window=window,
                scale=self.attention_scale,
                soft_cap=self.attn_logit_softcapping,
                sinks=self.has_attention_sinks,
                chunk_size=chunk,
            )
            for window, chunk in zip(
                self.layer_sliding_windows(), self.layer_attention_chunks(), strict=True
            )
        ]

    def layer_rope(self, layer_idx: int) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of a layer's rope: the sliding rope on sliding layers."""
        kind = self.layer_types_resolved()[layer_idx]
        if kind == _SLIDE and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling
