"""The host-memory tier: a preallocated CPU tensor pool with a slot map and LRU eviction."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvblocks.errors import InvalidTypeError
from kvblocks.tiers.codec import Payload, as_payload_tensor, as_payload_view, check_block_hash
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.lru import RetentionLRU
from kvblocks.tiers.stats import TierStats
from kvblocks.tiers.store import put_each
from kvblocks.tiers.transfer import allocate_pool
from kvblocks.validation import check_int, check_iterable, check_priority

__all__ = ["HostTier"]


class HostTier:
    """Block payloads in one ``[capacity_blocks, payload_nbytes]`` uint8 CPU tensor.

    The pool is allocated once (page-locked when CUDA is available, so copies to and from a
    GPU are DMA) and never grows: a put into a full pool reuses the slot of the LRU block
    of the lowest retention priority. Payloads live in process memory only; the pool holds
    no header because nothing outside this process can alter it.
    """

    def __init__(
        self, layout: KVLayout, capacity_blocks: int, *, pin_memory: bool | None = None
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        capacity_blocks = check_int(
            capacity_blocks, "capacity_blocks", minimum=1, expected="a positive int"
        )
        self.layout = layout
        self._capacity = capacity_blocks
        self._pool = allocate_pool(capacity_blocks, layout.payload_nbytes, pin_memory, zeroed=False)
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._slots: RetentionLRU[int] = RetentionLRU()
        self._stats = TierStats()

    @property
    def capacity_blocks(self) -> int:
        """Blocks the pool holds."""
        return self._capacity

    @property
    def pool(self) -> torch.Tensor:
        """The pool tensor (read-only use: e.g. one DMA of several slots to a GPU)."""
        return self._pool

    @property
    def is_pinned(self) -> bool:
        """Whether the pool is page-locked."""
        return self._pool.is_pinned()

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, block_hash: bytes) -> int | None:
        """The pool row holding ``block_hash`` (no recency change), or None."""
        return self._slots.get(check_block_hash(block_hash))

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        victim = self._slots.victim()
        assert victim is not None  # capacity >= 1 and no free slot: the map is not empty
        self._stats.evictions += 1
        slot = self._slots.remove(victim)
        assert slot is not None
        return slot

    def put(self, block_hash: bytes, kv: Payload, *, priority: int = 0) -> bool:
        """Copy one block's payload into the pool (evicting the LRU block when full)."""
        block_hash = check_block_hash(block_hash)
        priority = check_priority(priority)
        if isinstance(kv, torch.Tensor):
            source: torch.Tensor | np.ndarray = as_payload_tensor(self.layout, kv)
        else:
            source = np.frombuffer(as_payload_view(self.layout, kv), dtype=np.uint8)
        slot = self._slots.get(block_hash)
        if slot is None:
            slot = self._take_slot()
        self._slots.insert(block_hash, slot, priority)
        if isinstance(source, torch.Tensor):
            self._pool[slot].copy_(source)
        else:
            self._pool[slot].numpy()[:] = source
        self._stats.puts += 1
        self._stats.bytes_in += self.layout.payload_nbytes
        return True

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        """Store several blocks; how many were stored (all of them)."""
        return put_each(self, block_hashes, kvs, priority)

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Copies of the stored payloads (one gather from the pool), None for misses."""
        hashes = [
            check_block_hash(h) for h in check_iterable(block_hashes, "block_hashes", "bytes")
        ]
        slots = [self._slots.touch(h) for h in hashes]
        hit_rows = [s for s in slots if s is not None]
        hits = len(hit_rows)
        self._stats.hits += hits
        self._stats.misses += len(hashes) - hits
        self._stats.bytes_out += hits * self.layout.payload_nbytes
        if not hits:
            return [None] * len(hashes)
        gathered = self._pool.index_select(0, torch.tensor(hit_rows, dtype=torch.long))
        rows = iter(gathered.unbind(0))
        return [None if s is None else next(rows) for s in slots]

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is in the pool."""
        hashes = check_iterable(block_hashes, "block_hashes", "bytes")
        return [check_block_hash(h) in self._slots for h in hashes]

    def evict(self, block_hash: bytes) -> bool:
        """Free one block's slot."""
        slot = self._slots.remove(check_block_hash(block_hash))
        if slot is None:
            return False
        self._free.append(slot)
        self._stats.evictions += 1
        return True

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        return self._stats.copy()

    def close(self) -> bool:
        """Forget every block (the pool memory goes with the object); True (no background
        work can outlive it)."""
        self._free = list(range(self._capacity - 1, -1, -1))
        self._slots = RetentionLRU()
        return True
