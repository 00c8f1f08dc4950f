"""The fast CPU cache write: a step's slot rows computed once, one ``index_copy_`` per layer.

:func:`kvblocks.ops.reference.reshape_and_cache` states the semantics (the tests compare
against it); :class:`CpuCacheSlots` is what the CPU dispatch of
:func:`kvblocks.ops.reshape_and_cache` runs. With the cache viewed as rows of
``head_size`` elements, token ``t`` of head ``h`` goes to row ``(block * Hkv + h) *
block_size + offset``; every layer of a step writes the same rows, so an engine builds
the rows once per step and each layer is two ``index_copy_`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvblocks.errors import InvalidArgumentError

__all__ = ["CpuCacheSlots"]


@dataclass(frozen=True)
class CpuCacheSlots:
    """The cache rows a step's new tokens go to (slot ``-1`` skips a token)."""

    rows: Tensor  # int64 [kept * Hkv]: (token, head)-major rows of the [-1, D] cache view
    kept: Tensor | None  # int64 token indices written, None when every token is
    num_tokens: int

    @classmethod
    def build(
        cls, slot_mapping: Tensor, *, num_blocks: int, num_kv_heads: int, block_size: int
    ) -> CpuCacheSlots:
        """Rows for ``slot_mapping`` (int64 ``[num_tokens]``, ``block * block_size + offset``).

        Raises:
            InvalidArgumentError: a slot outside ``[-1, num_blocks * block_size)``.
        """
        # numpy on the host copy: a step's few thousand slots take a handful of array
        # ops, without the per-call cost of a dozen small torch ops.
        slots = slot_mapping.to("cpu", torch.int64).numpy()
        low = int(slots.min()) if slots.size else 0
        high = int(slots.max()) if slots.size else 0
        if low < -1 or high >= num_blocks * block_size:
            raise InvalidArgumentError(
                f"slot_mapping entries must be -1 (skip) or in [0, {num_blocks * block_size}) "
                f"(num_blocks * block_size), got range [{low}, {high}]"
            )
        kept = None
        if low < 0:
            kept_ids = np.flatnonzero(slots >= 0)
            slots = slots[kept_ids]
            kept = torch.from_numpy(kept_ids)
        blocks, offsets = np.divmod(slots, block_size)
        heads = np.arange(num_kv_heads, dtype=np.int64)
        rows = ((blocks[:, None] * num_kv_heads + heads[None, :]) * block_size) + offsets[:, None]
        return cls(
            rows=torch.from_numpy(rows.reshape(-1)), kept=kept, num_tokens=slot_mapping.shape[0]
        )

    def write(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, Hkv, D]`` into their slots, in place.

        The caches must have the shape the rows were built for (the front-end in
        :mod:`kvblocks.ops` checks it).
        """
        head_size = key_cache.shape[3]
        for new, cache in ((key, key_cache), (value, value_cache)):
            if self.kept is not None:
                new = new.index_select(0, self.kept)
            cache.view(-1, head_size).index_copy_(
                0, self.rows, new.reshape(-1, head_size).to(cache.dtype)
            )
