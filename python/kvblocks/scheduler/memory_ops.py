"""The one memory-op protocol of a step: block moves in the order the block manager
issued them.

The manager journals every move it decides (swaps, copy-on-write copies, host-tier
offloads and loads) in one list, with or without a host tier; the scheduler drains it
once per step (``take_memory_ops``) into ``SchedulerOutput.memory_ops``, and the engine
applies it in that order. A step that preempts can free blocks, reuse them as
copy-on-write destinations and swap those out again, so only issue order is always
correct. The per-kind arrays (``blocks_to_swap_out`` ...) are views of the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["KINDS", "MemoryOps", "pairs_of", "stack_pairs"]

Pairs = npt.NDArray[np.int64]
MemoryOps = list[tuple[str, Any]]
"""``[(kind, pairs int64 [n, 2]), ...]`` in issue order."""

KINDS = ("swap_out", "swap_in", "copy", "offload", "load")
"""``"swap_out"`` (gpu, cpu), ``"swap_in"`` (cpu, gpu), ``"copy"`` (src, dst GPU blocks),
``"offload"`` (gpu block, tier slot), ``"load"`` (tier slot, gpu block)."""


def pairs_of(memory_ops: Sequence[tuple[str, Any]], kind: str) -> Pairs:
    """The pairs of every ``kind`` run of ``memory_ops``, in order, as one ``[n, 2]``
    array."""
    return stack_pairs([pairs for k, pairs in memory_ops if k == kind])


def stack_pairs(maps: Sequence[Any]) -> Pairs:
    """Concatenate ``[n, 2]`` block mappings (an empty ``[0, 2]`` array for none)."""
    if not maps:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate([np.asarray(m, dtype=np.int64).reshape(-1, 2) for m in maps])
