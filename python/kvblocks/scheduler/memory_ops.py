"""The block moves of one step, in the order the block manager issued them
(:class:`MemoryOpJournal`).

A step that preempts can free blocks, reuse them as copy-on-write destinations and swap
those out again, so the engine must apply the moves in issue order
(``SchedulerOutput.memory_ops``). Every swap goes through the journal, which first
records the copies issued before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MemoryOpJournal", "StepMemoryOps", "stack_pairs"]

Pairs = npt.NDArray[np.int64]


@dataclass
class StepMemoryOps:
    """A step's moves: the ordered groups and, derived from them, the three pair arrays."""

    memory_ops: list[tuple[str, Any]]
    blocks_to_swap_out: Pairs
    blocks_to_swap_in: Pairs
    blocks_to_copy: Pairs


class MemoryOpJournal:
    """The moves of the step being scheduled (one journal per ``schedule()``).

    Args:
        manager: the block manager.
        tiered: the manager has a host tier: it queues every move (offloads and loads
            included) in one list, drained by ``take_memory_ops``.
    """

    def __init__(self, manager: Any, tiered: bool) -> None:
        self._manager = manager
        self._tiered = tiered
        self._groups: list[tuple[str, Any]] = []
        self._swap_out: list[Pairs] = []
        self._swap_in: list[Any] = []

    def drain(self) -> Pairs | None:
        """Record the copy-on-writes issued so far (with a host tier, every queued op);
        without a tier, return the (possibly empty) pairs taken."""
        if self._tiered:
            for kind, ops in self._manager.take_memory_ops():
                self._groups.append((kind, np.asarray(ops, dtype=np.int64)))
            return None
        pairs = np.asarray(self._manager.take_copy_on_writes(), dtype=np.int64).reshape(-1, 2)
        if len(pairs):
            self._groups.append(("copy", pairs))
        return pairs

    def swap_out(self, seq_ids: Sequence[int]) -> None:
        """Swap the sequences' blocks out to the CPU pool (``can_swap_out`` said yes)."""
        self.drain()
        pairs = np.asarray(self._manager.swap_out(seq_ids), dtype=np.int64)
        self._swap_out.append(pairs)
        self._after_swap("swap_out", pairs)

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        """Bring the sequences' blocks back from the CPU pool (``can_swap_in`` said yes)."""
        self.drain()
        pairs = self._manager.swap_in(seq_ids)
        self._swap_in.append(pairs)
        self._after_swap("swap_in", pairs)

    def _after_swap(self, kind: str, pairs: Any) -> None:
        if self._tiered:
            self.drain()  # the manager queued the swap with its ops
        else:
            self._groups.append((kind, pairs))

    def finish(self) -> StepMemoryOps:
        """Allocation is over: drain what is left and return the step's moves."""
        last = self.drain()
        if not self._groups:  # the usual step: no move at all
            empty = last if last is not None else np.zeros((0, 2), dtype=np.int64)
            return StepMemoryOps([], stack_pairs([]), stack_pairs([]), empty)
        copies = [pairs for kind, pairs in self._groups if kind == "copy"]
        return StepMemoryOps(
            self._groups,
            stack_pairs(self._swap_out),
            stack_pairs(self._swap_in),
            stack_pairs(copies),
        )


def stack_pairs(maps: list[Any]) -> Pairs:
    """Concatenate ``[n, 2]`` block mappings (an empty ``[0, 2]`` array for none)."""
    if not maps:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate([np.asarray(m, dtype=np.int64).reshape(-1, 2) for m in maps])
