"""The router's prefix index: which instances hold which block hashes, per tier and KV
cache group, and the prefix hit each instance can serve."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.router.events import (
    DEFAULT_MEDIUM,
    AllBlocksClearedRecord,
    BlockHash,
    BlockRemovedRecord,
    BlockStoredRecord,
    EventRecord,
)
from kvblocks.router.group_hit import GroupRule, longest_hit, needed_groups
from kvblocks.validation import check_block_hashes, check_int, check_iterable

__all__ = ["MAX_GROUPS", "PrefixIndex"]

_FULL = GroupRule()

MAX_GROUPS = 4096
"""Groups an instance may have (``group_idx`` below it): the index keeps a rule per group
up to the highest one seen."""


class PrefixIndex:
    """Block hash -> instances holding it, per tier (``medium``) and KV cache group,
    fed by KV event records.

    An instance's blocks are kept per tier, so ``AllBlocksCleared`` drops one instance's
    entries only, and per group (``group_idx``): a removal from one group keeps another
    group's copy. A group may hold several copies of a block (a prefix computed again
    while the first copy was cached: each copy is stored and removed with its own event,
    as vLLM's block pool publishes them), so copies are counted and a group holds the
    block until its last copy's removal. A ``BlockRemoved`` for a hash the instance never
    reported is ignored (streams may start mid-way); an event must be applied once (a
    replay of batches already seen would count their copies twice). Memory is one dict
    entry per distinct (hash, tier) plus one entry per (hash, tier, instance, group).

    An instance's hit (:meth:`overlaps`) is what it can serve: with one full-attention
    group (every instance of a single-group fleet), the leading blocks it holds; with KV
    cache groups, the longest prefix every group serves under the core's hit rule
    (:mod:`kvblocks.router.group_hit`: a window group needs only the blocks of its last
    window, so an instance whose window group evicted old blocks still serves the whole
    prefix). Each group's rule comes from its ``BlockStored`` events (kind, window, block
    size) or from :meth:`set_group_specs`. A group below a known one that has stored
    nothing yet needs every block (it serves no hit until it stores); a group above every
    known one that never stored a block and was not given is unknown to the index and
    not required.
    """

    def __init__(self) -> None:
        # medium -> hash -> instances
        self._owners: dict[str, dict[BlockHash, set[Hashable]]] = {}
        # instance -> medium -> hash -> group -> copies the group holds (for removals per
        # group and copy, AllBlocksCleared, stats and the group hit rule)
        self._held: dict[Hashable, dict[str, dict[BlockHash, dict[int, int]]]] = {}
        # instance -> group -> its hit rule, learned from events or given
        self._rules: dict[Hashable, dict[int, GroupRule]] = {}
        self._given: dict[Hashable, set[int]] = {}
        self._block_size: dict[Hashable, int] = {}
        # Instances whose hit is not "leading blocks held": several groups, or one that
        # is not full attention.
        self._grouped: set[Hashable] = set()

    def set_group_specs(self, instance: Hashable, groups: Sequence[Any], block_size: int) -> None:
        """Tell the index ``instance``'s KV cache groups (``kvblocks.GroupSpec`` objects,
        the manager's ``groups``, in group order) and block size, for what events do not
        say: a chunked group's chunk size, a recurrent group's checkpoint interval, a
        group that has not stored a block yet. Events do not override given groups.

        Raises:
            InvalidArgumentError: not group specs, or a bad ``block_size``.
        """
        _check_instance(instance)
        block_size = check_int(block_size, "block_size", minimum=1)
        rules = {}
        for g, spec in enumerate(check_iterable(groups, "groups", "GroupSpec")):
            kind = getattr(spec, "kind", None)
            if not isinstance(kind, str):
                raise InvalidArgumentError(f"groups[{g}] is not a GroupSpec: {spec!r}")
            rules[g] = GroupRule(
                kind,
                window=getattr(spec, "window", None),
                chunk=getattr(spec, "chunk", None),
                checkpoint_every_blocks=getattr(spec, "checkpoint_every_blocks", None),
            )
        if not rules:
            raise InvalidArgumentError("groups must name at least one group")
        self._rules[instance] = rules
        self._given[instance] = set(rules)
        self._block_size[instance] = block_size
        self._classify(instance)

    def group_rules(self, instance: Hashable) -> dict[int, GroupRule]:
        """``instance``'s groups as the index knows them (group -> rule)."""
        _check_instance(instance)
        return dict(self._rules.get(instance, {}))

    @staticmethod
    def _rule_of(record: BlockStoredRecord) -> GroupRule:
        """The record's group rule; checks what the index computes with, before any
        change."""
        check_int(record.group_idx, "group_idx", minimum=0, maximum=MAX_GROUPS - 1)
        if record.block_size is not None:
            # 0: not said (host-tier events of blocks offloaded at eviction carry none).
            check_int(record.block_size, "block_size", minimum=0)
        kind = record.kv_cache_spec_kind
        if kind == "sliding_window" and record.kv_cache_spec_sliding_window is not None:
            window = check_int(record.kv_cache_spec_sliding_window, "sliding window", minimum=1)
            return GroupRule(kind, window=window)
        if kind in ("chunked_local_attention", "mamba"):
            return GroupRule(kind)
        # Full attention, no kind (older events), or one the index does not know: every
        # block of the prefix is needed (never over-reports).
        return _FULL

    def _learn(self, record: BlockStoredRecord, rule: GroupRule) -> None:
        inst = record.instance
        if record.block_size:
            self._block_size.setdefault(inst, record.block_size)
        rules = self._rules.setdefault(inst, {})
        g = record.group_idx
        if g in self._given.get(inst, ()):
            return
        changed = rules.get(g) != rule
        rules[g] = rule
        for earlier in range(g):
            # Groups are numbered from 0: an earlier group exists even if it has stored
            # nothing yet (it serves nothing then); until its events name its kind, it
            # needs every block, which never over-reports.
            if earlier not in rules:
                rules[earlier] = _FULL
                changed = True
        if changed:
            self._classify(inst)

    def _classify(self, instance: Hashable) -> None:
        rules = self._rules.get(instance, {})
        if any(g != 0 or r.kind != "full_attention" for g, r in rules.items()):
            self._grouped.add(instance)
        else:
            self._grouped.discard(instance)

    def apply(self, record: EventRecord) -> None:
        """Apply one event record.

        Raises:
            InvalidTypeError: not a record, an unhashable instance, a tier that is not a
                string, or a block hash that is not ``bytes`` or ``int``.
            InvalidArgumentError: a group (``>= MAX_GROUPS``), or a stored record's block
                size or window, out of range. Nothing changes.
        """
        if isinstance(record, (BlockStoredRecord, BlockRemovedRecord, AllBlocksClearedRecord)):
            _check_instance(record.instance)
        if isinstance(record, BlockStoredRecord):
            rule = self._rule_of(record)
            self._check_blocks(record)
            self._store(record.instance, record.medium, record.group_idx, record.block_hashes)
            self._learn(record, rule)
        elif isinstance(record, BlockRemovedRecord):
            check_int(record.group_idx, "group_idx", minimum=0, maximum=MAX_GROUPS - 1)
            # Checked whole before the first removal: a bad hash half-way must not leave
            # the blocks before it removed.
            self._check_blocks(record)
            self._remove(record.instance, record.medium, record.group_idx, record.block_hashes)
        elif isinstance(record, AllBlocksClearedRecord):
            self.clear_instance(record.instance)
        else:
            raise InvalidTypeError(f"not an event record: {type(record).__name__}")

    @staticmethod
    def _check_blocks(record: BlockStoredRecord | BlockRemovedRecord) -> None:
        """Raise unless the record's tier is a string and its hashes a sequence of block
        hashes."""
        if not isinstance(record.medium, str):
            raise InvalidTypeError(f"medium must be a string, got {type(record.medium).__name__}")
        _check_hash_sequence(record.block_hashes, "block hashes", numpy=False)

    def apply_all(self, records: Iterable[EventRecord]) -> None:
        """Apply records in stream order.

        Raises:
            InvalidTypeError: ``records`` is not a sequence of records (and the errors of
                :meth:`apply`: the records before a bad one stay applied, as a stream's).
        """
        for r in check_iterable(records, "records", "event records"):
            self.apply(r)

    def _store(
        self, instance: Hashable, medium: str, group: int, hashes: Sequence[BlockHash]
    ) -> None:
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
        _check_instance(instance)
        for medium, held in self._held.pop(instance, {}).items():
            owners = self._owners[medium]
            for h in held:
                who = owners[h]
                who.discard(instance)
                if not who:
                    del owners[h]

    def instances(self, block_hash: BlockHash, medium: str | None = None) -> set[Hashable]:
        """Instances holding ``block_hash`` (in ``medium``, or in any tier)."""
        _check_query([block_hash], medium)
        media = [medium] if medium is not None else list(self._owners)
        found: set[Hashable] = set()
        for m in media:
            found |= self._owners.get(m, {}).get(block_hash, set())
        return found

    def num_blocks(self, instance: Hashable, medium: str | None = None) -> int:
        """Distinct blocks ``instance`` holds (in ``medium``, or summed over tiers)."""
        _check_instance(instance)
        if medium is not None and not isinstance(medium, str):
            _check_query((), medium)
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
        does; with KV cache groups it is the longest prefix every group serves (see the
        class docs). Instances with no match are absent. ``medium=None`` counts a block
        held in any tier.

        Raises:
            InvalidTypeError: a hash that is not ``bytes`` or ``int``, or a tier that is
                not a string.
        """
        if medium is not None and not isinstance(medium, str):
            _check_query((), medium)
        try:
            return self._overlaps(block_hashes, medium)
        except TypeError:
            _check_query(block_hashes, medium)  # names the bad hash; else not ours
            raise

    def _overlaps(
        self, block_hashes: Sequence[BlockHash], medium: str | None
    ) -> dict[Hashable, int]:
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
        for inst in self._grouped:
            k = self._grouped_hit(inst, block_hashes, medium)
            if k:
                matched[inst] = k
            else:
                matched.pop(inst, None)
        return matched

    def _holds(
        self, instance: Hashable, block_hashes: Sequence[BlockHash], medium: str | None
    ) -> Callable[[int, int], bool]:
        held = self._held.get(instance, {})
        tables = [held[m] for m in ([medium] if medium is not None else held) if m in held]
        return lambda g, i: any(g in t.get(block_hashes[i], ()) for t in tables)

    def _rules_of(self, instance: Hashable) -> tuple[dict[int, GroupRule], int]:
        rules = self._rules[instance]
        bs = self._block_size.get(instance)
        if bs is None:
            # Without a block size a window or chunk cannot be placed: need every block.
            rules = {g: _FULL if r.kind != "mamba" else r for g, r in rules.items()}
            bs = 1
        return rules, bs

    def _grouped_hit(
        self, instance: Hashable, block_hashes: Sequence[BlockHash], medium: str | None
    ) -> int:
        rules, bs = self._rules_of(instance)
        return longest_hit(
            rules, self._holds(instance, block_hashes, medium), len(block_hashes), bs
        )

    def _grouped_credit(
        self,
        instance: Hashable,
        block_hashes: Sequence[BlockHash],
        k: int,
        credit: Callable[[str], float],
    ) -> float:
        """Each block of a hit of ``k`` counts the credit of the worst tier some group
        needing it must read it from (each group reading its best tier)."""
        rules, bs = self._rules_of(instance)
        held = self._held.get(instance, {})
        needed = needed_groups(rules, k, bs)
        total = 0.0
        for i in range(k):
            h = block_hashes[i]
            worst: float | None = None
            for g, blocks in needed:
                if i not in blocks:
                    continue
                best = max((credit(m) for m, t in held.items() if g in t.get(h, ())), default=0.0)
                worst = best if worst is None else min(worst, best)
            total += credit(DEFAULT_MEDIUM) if worst is None else worst
        return total

    def credited_overlaps(
        self, block_hashes: Sequence[BlockHash], credit: Callable[[str], float]
    ) -> dict[Hashable, float]:
        """Like :meth:`overlaps` over all tiers, but each matched block counts
        ``credit(medium)`` of the best tier the instance holds it in (with KV cache
        groups: the worst, over the groups the hit needs that block from, of each
        group's best tier; a block no group needs counts ``credit(DEFAULT_MEDIUM)``).

        Raises:
            InvalidTypeError: a hash that is not ``bytes`` or ``int``.
        """
        try:
            return self._credited_overlaps(block_hashes, credit)
        except TypeError:
            _check_query(block_hashes, None)  # names the bad hash; else not ours
            raise

    def _credited_overlaps(
        self, block_hashes: Sequence[BlockHash], credit: Callable[[str], float]
    ) -> dict[Hashable, float]:
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
        for inst in self._grouped:
            k = self._grouped_hit(inst, block_hashes, None)
            if k:
                total[inst] = self._grouped_credit(inst, block_hashes, k, credit)
            else:
                total.pop(inst, None)
        return total


def _check_query(block_hashes: object, medium: object) -> None:
    """Raise :class:`InvalidTypeError` unless a query's hashes are a sequence of block
    hashes and its tier a string or None. Queries check only after a lookup failed:
    :meth:`CacheAwareRouter.route` checked its prompt already, and this is its hot path."""
    if medium is not None and not isinstance(medium, str):
        raise InvalidTypeError(f"medium must be a string or None, got {type(medium).__name__}")
    _check_hash_sequence(block_hashes, "block_hashes", numpy=True)


def _check_hash_sequence(hashes: object, name: str, *, numpy: bool) -> None:
    """Raise unless ``hashes`` is a sequence of block hashes (bytes would iterate as ints,
    a generator would be used up by the check)."""
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Sequence):
        raise InvalidTypeError(
            f"block_hashes must be a sequence of block hashes, got {type(hashes).__name__}"
        )
    check_block_hashes(hashes, name, numpy=numpy)


def _check_instance(instance: object) -> None:
    """Raise :class:`InvalidTypeError` unless ``instance`` can key the index's dicts."""
    try:
        hash(instance)
    except TypeError:
        raise InvalidTypeError(
            f"instance must be hashable, got {type(instance).__name__}"
        ) from None
