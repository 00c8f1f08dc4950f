"""Which KV cache group each layer belongs to, and which layer slot it uses.

The block manager's groups hold equally many layers each (``docs/hybrid-groups.md``, "The
page-size design"): a block id names ``L`` layer slots' pages in every group, the engine
keeps one K/V tensor pair per slot, and layer ``j`` of group ``g`` reads and writes slot
``j`` through group ``g``'s block table and slot mapping.

**Attention kinds** (:func:`attention_layout`). A model mixing sliding-window and full
attention layers (Gemma 2 and 3, gpt-oss, Ministral, Qwen3, OLMo 3) gets one group per
kind and per ``L`` layers of it: with ``c_k`` layers of kind ``k``, ``L = min(c_k)``
(every layer of the rarest kind in one group, usually the full-attention layers), or
``max(c_k)`` when the kinds are nearly balanced (``max < 1.25 * min``: two groups with a
little padding instead of many small ones), as vLLM's hybrid allocator picks it. Kind
``k`` then has ``ceil(c_k / L)`` groups, full attention first; its ``m``-th layer is in
that kind's group ``m // L`` at slot ``m % L``; the last group's unused slots are padding
(allocated, never read). Gemma 3's 5:1 pattern of 6 layers is ``L = 1``: one full and
five window groups; gpt-oss's 1:1 is ``L = n / 2``: two groups. A model with one kind of
layer (all full, or one window everywhere) needs no layout: one group of every layer.
Llama 4's chunked local attention layers are a kind of their own (after the windows,
``chunked_local_attention(C)`` groups whose past chunks' blocks the manager frees); a
model whose every layer is chunked still gets a layout (one chunked group), so that
the manager frees them.

**Recurrent hybrids** (:func:`hybrid_layout`). A hybrid model (Bamba) has attention
layers, which keep KV, and recurrent mixers, which keep one state per sequence: with
``L`` attention layers, the engine makes one full attention group of all ``L`` (group 0:
the table and slot mapping the scheduler hands to every attention layer) and
``ceil(mixers / L)`` recurrent-state groups of ``L`` layer slots each, mixer ``m`` in
group ``1 + m // L`` at slot ``m % L`` (the last group's unused slots are padding). Each
state group caches its state every ``checkpoint_every_blocks`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks import GroupSpec
from kvblocks.engine.config import ModelConfig
from kvblocks.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_CHECKPOINT_TOKENS",
    "AttentionLayout",
    "HybridLayout",
    "attention_layout",
    "hybrid_layout",
]

#: Tokens between cached states when the caller names no interval: a prefix hit of a
#: recurrent model is a multiple of this (rounded to whole blocks).
DEFAULT_CHECKPOINT_TOKENS = 512

# The manager's limit on groups (kvblocks_core::MAX_GROUPS).
_MAX_GROUPS = 64


@dataclass(frozen=True)
class HybridLayout:
    """The KV cache groups of a hybrid model with ``num_mixers`` recurrent mixers and
    ``layers_per_group`` attention layers (see the module docstring)."""

    layers_per_group: int
    num_mixers: int
    checkpoint_every_blocks: int

    @property
    def num_state_groups(self) -> int:
        """Recurrent-state groups (the last may have padding slots)."""
        return -(-self.num_mixers // self.layers_per_group)

    def groups(self) -> list[GroupSpec]:
        """The manager's groups: full attention, then the state groups."""
        state = GroupSpec.recurrent(self.checkpoint_every_blocks)
        return [GroupSpec.full_attention()] + [state] * self.num_state_groups

    def state_group(self, mixer: int) -> int:
        """The manager group holding mixer ``mixer``'s states."""
        return 1 + mixer // self.layers_per_group

    def state_slot(self, mixer: int) -> int:
        """The layer slot of mixer ``mixer`` within its group (its state tensor)."""
        return mixer % self.layers_per_group


def hybrid_layout(
    config: ModelConfig, block_size: int, checkpoint_every_blocks: int | None = None
) -> HybridLayout | None:
    """The layout of a model with recurrent layers, ``None`` for an attention-only one.

    ``checkpoint_every_blocks`` defaults to :data:`DEFAULT_CHECKPOINT_TOKENS` worth of
    blocks.

    Raises:
        InvalidArgumentError: no attention layer (a purely recurrent model), more groups
            than the manager takes, or a bad interval.
    """
    mixers = len(config.recurrent_layers)
    if mixers == 0:
        return None
    attention = config.num_hidden_layers - mixers
    if attention == 0:
        raise InvalidArgumentError(
            "a model without attention layers is not supported (its state groups would "
            "have no attention group to size them)"
        )
    if checkpoint_every_blocks is None:
        checkpoint_every_blocks = max(1, DEFAULT_CHECKPOINT_TOKENS // block_size)
    if (
        isinstance(checkpoint_every_blocks, bool)
        or not isinstance(checkpoint_every_blocks, int)
        or checkpoint_every_blocks < 1
    ):
        raise InvalidArgumentError(
            f"state_checkpoint_blocks must be an int >= 1, got {checkpoint_every_blocks!r}"
        )
    layout = HybridLayout(attention, mixers, checkpoint_every_blocks)
    if 1 + layout.num_state_groups > _MAX_GROUPS:
        raise InvalidArgumentError(
            f"{mixers} recurrent layers in groups of {attention} make "
            f"{1 + layout.num_state_groups} KV cache groups; the manager takes {_MAX_GROUPS}"
        )
    return layout


# Kinds this close in count share one L (vLLM's rule): a few padding slots, fewer groups.
_BALANCED = 1.25


@dataclass(frozen=True)
class AttentionLayout:
    """The KV cache groups of a model mixing attention kinds (see the module docstring).

    ``group_windows[g]`` is group ``g``'s window (``None``: full attention, or chunked
    when ``group_chunks[g]`` is set: Llama 4's chunked local attention; an empty
    ``group_chunks`` means no group is chunked); ``layer_group[i]`` and
    ``layer_slot[i]`` place decoder layer ``i``.
    """

    layers_per_group: int
    group_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_chunks: tuple[int | None, ...] = ()

    @property
    def num_groups(self) -> int:
        """KV cache groups (one table per sequence each)."""
        return len(self.group_windows)

    @property
    def num_padding_slots(self) -> int:
        """Layer slots allocated in some group but used by no layer."""
        return self.num_groups * self.layers_per_group - len(self.layer_group)

    def groups(self) -> list[GroupSpec]:
        """The manager's groups, in order."""
        chunks = self.group_chunks or (None,) * self.num_groups
        specs = []
        for window, chunk in zip(self.group_windows, chunks, strict=True):
            if chunk is not None:
                specs.append(GroupSpec.chunked_local_attention(chunk))
            elif window is not None:
                specs.append(GroupSpec.sliding_window(window))
            else:
                specs.append(GroupSpec.full_attention())
        return specs


def attention_layout(config: ModelConfig) -> AttentionLayout | None:
    """One group per attention kind and ``L`` layers, ``None`` for a model whose layers
    are all one kind (or a recurrent hybrid: :func:`hybrid_layout`).

    Raises:
        InvalidArgumentError: more groups than the manager takes.
    """
    if config.recurrent_layers:
        return None
    windows = config.layer_sliding_windows()
    chunks = config.layer_attention_chunks()
    # A layer's kind: (0, 0) full, (1, W) a window, (2, C) a chunk; sorted, that is full
    # attention first, then the windows and the chunks in increasing size.
    layer_kinds = [
        (2, c) if c is not None else (0, 0) if w is None else (1, w)
        for w, c in zip(windows, chunks, strict=True)
    ]
    kinds = sorted(set(layer_kinds))
    if len(kinds) < 2 and kinds[0][0] != 2:
        return None
    members = {k: [i for i, lk in enumerate(layer_kinds) if lk == k] for k in kinds}
    counts = [len(m) for m in members.values()]
    per_group = min(counts)
    if max(counts) < _BALANCED * per_group:
        per_group = max(counts)
    group_windows: list[int | None] = []
    group_chunks: list[int | None] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    for kind in kinds:
        first = len(group_windows)
        layers = members[kind]
        count = -(-len(layers) // per_group)
        group_windows += [kind[1] if kind[0] == 1 else None] * count
        group_chunks += [kind[1] if kind[0] == 2 else None] * count
        for m, layer in enumerate(layers):
            layer_group[layer] = first + m // per_group
            layer_slot[layer] = m % per_group
    if len(group_windows) > _MAX_GROUPS:
        raise InvalidArgumentError(
            f"{len(windows)} attention layers in groups of {per_group} make "
            f"{len(group_windows)} KV cache groups; the manager takes {_MAX_GROUPS} "
            "(use kv_cache_groups=False)"
        )
    return AttentionLayout(
        per_group,
        tuple(group_windows),
        tuple(layer_group),
        tuple(layer_slot),
        tuple(group_chunks) if any(c is not None for c in group_chunks) else (),
    )
