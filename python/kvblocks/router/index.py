"""The router's prefix index: which instances hold which block hashes, per tier."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from kvblocks.errors import InvalidTypeError
from kvblocks.router.events import (
    AllBlocksClearedRecord,
    BlockHash,
    BlockRemovedRecord,
    BlockStoredRecord,
    EventRecord,
)

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Block hash -> instances holding it, per tier (``medium``), fed by KV event records.

    An instance's blocks are kept per tier, so ``AllBlocksCleared`` drops one instance's
    entries only. A block is held while any of the instance's KV cache groups
    (``group_idx``) holds a copy of it in that tier: a removal from one group keeps
    another group's copy, and a group may hold several copies (a prefix computed again
    while the first copy was cached: each copy is stored and removed with its own event,
    as vLLM's block pool publishes them), so one group's removal keeps its other copies.
    A ``BlockRemoved`` for a hash the instance never reported is ignored (streams may start
    mid-way); an event must be applied once (a replay of batches already seen would count
    their copies twice). Memory is one dict entry per distinct (hash, tier) plus one entry
    per (hash, tier, instance, group).
    """

    def __init__(self) -> None:
        # medium -> hash -> instances
        self._owners: dict[str, dict[BlockHash, set[Hashable]]] = {}
        # instance -> medium -> hash -> group -> copies the group holds (for removals per
        # group and copy, AllBlocksCleared and stats)
        self._held: dict[Hashable, dict[str, dict[BlockHash, dict[int, int]]]] = {}

    def apply(self, record: EventRecord) -> None:
        """Apply one event record.

        Raises:
            TypeError: not a record, or a block hash that is not ``bytes`` or ``int``.
        """
        if isinstance(record, BlockStoredRecord):
            self._store(record.instance, record.medium, record.group_idx, record.block_hashes)
        elif isinstance(record, BlockRemovedRecord):
            self._remove(record.instance, record.medium, record.group_idx, record.block_hashes)
        elif isinstance(record, AllBlocksClearedRecord):
            self.clear_instance(record.instance)
        else:
            raise InvalidTypeError(f"not an event record: {type(record).__name__}")

    def apply_all(self, records: Iterable[EventRecord]) -> None:
        """Apply records in stream order."""
        for r in records:
            self.apply(r)

    def _store(
        self, instance: Hashable, medium: str, group: int, hashes: Sequence[BlockHash]
    ) -> None:
        for h in hashes:
            if isinstance(h, bool) or not isinstance(h, (bytes, int)):
                raise InvalidTypeError(f"block hashes must be bytes or int, got {type(h).__name__}")
        owners = self._owners.setdefault(medium, {})
        held = self._held.setdefault(instance, {}).setdefault(medium, {})
        for h in hashes:
            owners.setdefault(h, set()).add(instance)
            copies = held.setdefault(h, {})
            copies[group] = copies.get(group, 0) + 1

    def _remove(
        self, instance: Hashable, medium: str, group: int, hashes: Sequence[BlockHash]
    ) -> None:
        held = self._held.get(instance, {}).get(medium)
        owners = self._owners.get(medium)
        if not held or owners is None:
            return
        for h in hashes:
            groups = held.get(h)
            if groups is not None and group in groups:
                if groups[group] > 1:
                    groups[group] -= 1  # the group still holds another copy
                    continue
                del groups[group]
                if groups:
                    continue  # another group still holds the block
                del held[h]
                who = owners[h]
                who.discard(instance)
                if not who:
                    del owners[h]

    def clear_instance(self, instance: Hashable) -> None:
        """Forget every block of ``instance`` in every tier (``AllBlocksCleared``)."""
        for medium, held in self._held.pop(instance, {}).items():
            owners = self._owners[medium]
            for h in held:
                who = owners[h]
                who.discard(instance)
                if not who:
                    del owners[h]

    def instances(self, block_hash: BlockHash, medium: str | None = None) -> set[Hashable]:
        """Instances holding ``block_hash`` (in ``medium``, or in any tier)."""
        media = [medium] if medium is not None else list(self._owners)
        found: set[Hashable] = set()
        for m in media:
            found |= self._owners.get(m, {}).get(block_hash, set())
        return found

    def num_blocks(self, instance: Hashable, medium: str | None = None) -> int:
        """Distinct blocks ``instance`` holds (in ``medium``, or summed over tiers)."""
        tiers = self._held.get(instance, {})
        if medium is not None:
            return len(tiers.get(medium, ()))
        return sum(len(s) for s in tiers.values())

    def __len__(self) -> int:
        """Distinct (hash, tier) entries."""
        return sum(len(o) for o in self._owners.values())

    def overlaps(
        self, block_hashes: Sequence[BlockHash], medium: str | None = None
    ) -> dict[Hashable, int]:
        """Leading blocks of ``block_hashes`` each instance holds (its matched prefix).

        An instance's match stops at its first missing block, as its own prefix probe
        does. Instances with no match are absent. ``medium=None`` counts a block held in
        any tier.
        """
        media = [medium] if medium is not None else list(self._owners)
        tables = [self._owners[m] for m in media if m in self._owners]
        matched: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for depth, h in enumerate(block_hashes):
            here: set[Hashable] = set()
            for t in tables:
                here |= t.get(h, set())
            alive = here if alive is None else alive & here
            if not alive:
                break
            for inst in alive:
                matched[inst] = depth + 1
        return matched

    def credited_overlaps(
        self, block_hashes: Sequence[BlockHash], credit: Callable[[str], float]
    ) -> dict[Hashable, float]:
        """Like :meth:`overlaps` over all tiers, but each matched block counts
        ``credit(medium)`` of the best tier the instance holds it in."""
        tables = list(self._owners.items())
        total: dict[Hashable, float] = {}
        alive: set[Hashable] | None = None
        for h in block_hashes:
            best: dict[Hashable, float] = {}
            for medium, owners in tables:
                who = owners.get(h)
                if not who:
                    continue
                c = credit(medium)
                for inst in who if alive is None else who & alive:
                    if c > best.get(inst, -1.0):
                        best[inst] = c
            if not best:
                break
            alive = set(best)
            for inst, c in best.items():
                total[inst] = total.get(inst, 0.0) + c
        return total
