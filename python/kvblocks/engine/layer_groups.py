"""Which KV cache group each layer of a hybrid recurrent model belongs to.

A hybrid model (Bamba) has attention layers, which keep KV, and recurrent mixers, which
keep one state per sequence. The block manager's groups hold equally many layers each
(``docs/hybrid-groups.md``): with ``L`` attention layers, the engine makes one full
attention group of all ``L`` (group 0: the table and slot mapping the scheduler hands to
every attention layer) and ``ceil(mixers / L)`` recurrent-state groups of ``L`` layer
slots each, mixer ``m`` in group ``1 + m // L`` at slot ``m % L`` (the last group's
unused slots are padding). Each state group caches its state every
``checkpoint_every_blocks`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks import GroupSpec
from kvblocks.engine.config import ModelConfig
from kvblocks.errors import InvalidArgumentError

__all__ = ["DEFAULT_CHECKPOINT_TOKENS", "HybridLayout", "hybrid_layout"]

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
