"""The protocol every storage tier implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers.codec import Payload
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.stats import TierStats

__all__ = ["TierStore", "put_each"]


@runtime_checkable
class TierStore(Protocol):
    """A store of KV block payloads keyed by block hash, below the GPU pool.

    Every tier holds payloads of one :class:`~kvblocks.tiers.layout.KVLayout`, stores each
    with a self-checking header (:mod:`kvblocks.tiers.codec`), evicts in LRU order within a
    retention priority when full, and never fails a caller because of its medium: a full
    tier evicts, a value that fails validation reads as a miss (counted in
    ``stats().rejected``), an unreachable backend reads as misses and drops puts. Only bad
    arguments raise (TypeError / :class:`~kvblocks.errors.InvalidArgumentError`), and a
    call that raises changes nothing. A tier is not thread-safe: one per engine thread.
    """

    layout: KVLayout

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks the tier holds at most (None: bounded by the backend, e.g. Valkey's
        ``maxmemory`` with an LRU ``maxmemory-policy``)."""
        ...

    def __len__(self) -> int:
        """Blocks stored now (as far as this client knows)."""
        ...

    def put(self, block_hash: bytes, kv: Payload, *, priority: int = 0) -> bool:
        """Store one block; True if stored. Evicts to make room; never raises for a full
        or failed medium."""
        ...

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        """Store several blocks (pipelined where the backend allows); how many were stored."""
        ...

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each block's payload as a CPU uint8 ``[payload_nbytes]`` tensor, or None on a miss.

        Reads are batched (one gather, one MGET); a hit marks the block recently used.
        """
        ...

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is stored (no payload transfer, no recency change)."""
        ...

    def evict(self, block_hash: bytes) -> bool:
        """Remove one block; True if it was stored."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""
        ...

    def close(self) -> None:
        """Release the tier's resources (files, connections); contents persist where the
        medium does."""
        ...


def put_each(
    store: TierStore, block_hashes: Sequence[bytes], kvs: Sequence[Payload], priority: int
) -> int:
    """``put_many`` for a backend without a batched write: ``put`` each block in order;
    how many were stored."""
    if len(block_hashes) != len(kvs):
        raise InvalidArgumentError(f"{len(block_hashes)} block hashes but {len(kvs)} payloads")
    return sum(store.put(h, kv, priority=priority) for h, kv in zip(block_hashes, kvs, strict=True))
