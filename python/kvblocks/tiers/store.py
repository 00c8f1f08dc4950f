"""Helpers for storage tiers (the protocol, :class:`~kvblocks.protocols.TierStore`, lives
in :mod:`kvblocks.protocols`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import TierStore
from kvblocks.tiers.codec import Payload

__all__ = ["TierStore", "put_each"]


def put_each(
    store: TierStore, block_hashes: Sequence[bytes], kvs: Sequence[Payload], priority: int
) -> int:
    """``put_many`` for a backend without a batched write: ``put`` each block in order;
    how many were stored."""
    if len(block_hashes) != len(kvs):
        raise InvalidArgumentError(f"{len(block_hashes)} block hashes but {len(kvs)} payloads")
    return sum(store.put(h, kv, priority=priority) for h, kv in zip(block_hashes, kvs, strict=True))
