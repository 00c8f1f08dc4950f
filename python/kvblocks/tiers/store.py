"""Helpers for storage tiers (the protocol, :class:`~kvblocks.protocols.TierStore`, lives
in :mod:`kvblocks.protocols`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import TierStore
from kvblocks.tiers.codec import Payload, check_block_hash, check_payload
from kvblocks.validation import check_iterable, check_priority

__all__ = ["TierStore", "put_each"]


def put_each(
    store: TierStore, block_hashes: Sequence[bytes], kvs: Sequence[Payload], priority: int
) -> int:
    """``put_many`` for a backend without a batched write: ``put`` each block in order;
    how many were stored. Every argument is checked before the first put, so a batch with
    one bad entry raises and stores nothing."""
    block_hashes = list(check_iterable(block_hashes, "block_hashes", "bytes"))
    kvs = list(check_iterable(kvs, "kvs", "payloads"))
    if len(block_hashes) != len(kvs):
        raise InvalidArgumentError(f"{len(block_hashes)} block hashes but {len(kvs)} payloads")
    check_priority(priority)
    for h, kv in zip(block_hashes, kvs, strict=True):
        check_block_hash(h)
        check_payload(store.layout, kv)
    return sum(store.put(h, kv, priority=priority) for h, kv in zip(block_hashes, kvs, strict=True))
