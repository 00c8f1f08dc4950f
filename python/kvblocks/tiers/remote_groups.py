"""A remote tier's blocks by KV cache group: store keys, what to read, what to import.

With several KV cache groups (:doc:`hybrid-groups`) the same tokens have one block per
group, each holding that group's layers' KV (or a recurrent group's states), so a store
keys a block by its group as well as its hash: the key is a tag naming the group's index
and spec, then the block hash. A manager with one group keys by the hash alone (the key
every single-group instance has always used). The layout fingerprint the store adds
names the weights and the page shape (``L`` layer slots), so an instance with another
layer mix never reads these bytes.

What to read follows the core's hit rule: past the local hit of ``start`` blocks, a hit of
``k`` blocks needs, in each group, the blocks a query at ``k * block_size`` sees (full
attention: all of ``[start, k)``; a window or chunk: the blocks of its last window or
chunk; a recurrent-state group: block ``k - 1``, only where ``k`` is a checkpoint). The
read asks for every block some ``k`` could need; once it comes back, the longest ``k``
that every group serves from what was found is imported, each group's needed blocks
under its own group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvblocks._core import GroupSpec

__all__ = ["FetchPlan", "group_tags", "plan_fetch"]


def group_tags(groups: Sequence[GroupSpec]) -> list[bytes]:
    """Each group's store-key prefix: empty for a single group, else 8 bytes naming the
    group's index and spec."""
    if len(groups) <= 1:
        return [b""] * len(groups)
    tags = []
    for index, spec in enumerate(groups):
        fields = [
            "kvblocks-group-v1",
            index,
            spec.kind,
            spec.window,
            spec.chunk,
            spec.checkpoint_every_blocks,
        ]
        text = json.dumps(fields, separators=(",", ":")).encode()
        tags.append(hashlib.blake2b(text, digest_size=8).digest())
    return tags


def _first_needed(spec: GroupSpec, k: int, block_size: int) -> int:
    """The first block a hit of ``k`` blocks needs in ``spec``'s group."""
    if spec.checkpoint_every_blocks is not None:
        return k - 1
    return spec.first_visible(k * block_size) // block_size


def _serves(spec: GroupSpec, k: int) -> bool:
    """Whether a hit may end at ``k`` blocks in ``spec``'s group (a recurrent group:
    only on a checkpoint)."""
    every = spec.checkpoint_every_blocks
    return every is None or k % every == 0


@dataclass(frozen=True)
class FetchPlan:
    """A read of one sequence's blocks ``[start, limit)`` past its local hit of
    ``start`` blocks: ``entries[i] = (group, block index)`` is read under ``keys[i]``
    (``hashes`` are the sequence's block hashes from block 0)."""

    groups: tuple[GroupSpec, ...]
    block_size: int
    hashes: tuple[bytes, ...]
    start: int
    limit: int
    entries: tuple[tuple[int, int], ...]
    keys: tuple[bytes, ...]

    def hit(self, found: Sequence[bool]) -> int:
        """The longest hit (``start`` when none is longer) that every group serves from
        the entries ``found`` (one flag per entry)."""
        have = {e for e, ok in zip(self.entries, found, strict=True) if ok}
        for k in range(self.limit, self.start, -1):
            if all(
                _serves(spec, k)
                and all(
                    (g, j) in have
                    for j in range(max(self.start, _first_needed(spec, k, self.block_size)), k)
                )
                for g, spec in enumerate(self.groups)
            ):
                return k
        return self.start

    def imports(self, k: int) -> list[list[int]]:
        """Per group, the entry indices a hit of ``k`` blocks imports (ascending)."""
        out: list[list[int]] = [[] for _ in self.groups]
        for i, (g, j) in enumerate(self.entries):
            first = max(self.start, _first_needed(self.groups[g], k, self.block_size))
            if first <= j < k:
                out[g].append(i)
        return out


def plan_fetch(
    groups: Sequence[GroupSpec],
    tags: Sequence[bytes],
    block_size: int,
    hashes: Sequence[bytes],
    start: int,
    cap: int,
) -> FetchPlan:
    """What to read past a local hit of ``start`` of ``len(hashes)`` blocks: every
    block some hit could need, in block order, at most ``cap`` of them (the host tier's
    slots; a hit needs a leading run, so the cut falls at its end)."""
    limit = len(hashes)
    entries: list[tuple[int, int]] = []
    if start < limit:
        for j in range(start, limit):
            for g, spec in enumerate(groups):
                # The earliest block any hit past ``start`` needs in this group.
                if j < _first_needed(spec, start + 1, block_size):
                    continue
                if spec.checkpoint_every_blocks is not None and not _serves(spec, j + 1):
                    continue
                entries.append((g, j))
    entries = entries[:cap]
    if entries:
        limit = min(limit, entries[-1][1] + 1)
    keys = tuple(tags[g] + hashes[j] for g, j in entries)
    return FetchPlan(tuple(groups), block_size, tuple(hashes), start, limit, tuple(entries), keys)
