"""Storage tiers below the GPU KV pool: host memory, local disk, and Valkey/Redis.

This package moves and stores the bytes of full KV blocks; deciding which block goes where
is the core's job. One concept per module:

- :mod:`~kvblocks.tiers.layout`: :class:`KVLayout`, a block payload's byte layout and the
  weights/layout fingerprint that keys stored blocks; :mod:`~kvblocks.tiers.weights` the
  digest of the weights it names (cached per checkpoint).
- :mod:`~kvblocks.tiers.codec`: the self-checking record (magic, version, fingerprint,
  block hash, length, CRC-32, optional MAC) every persistent tier stores;
  :mod:`~kvblocks.tiers.mac` the key (argument or ``$KVBLOCKS_TIER_KEY``) that signs it.
- :mod:`~kvblocks.tiers.store`: the :class:`TierStore` protocol; :mod:`~kvblocks.tiers.stats`
  its counters; :mod:`~kvblocks.tiers.lru` LRU order with retention priorities.
- :class:`HostTier` (a preallocated, pinned when CUDA is available, CPU pool),
  :class:`DiskTier` (one file per block, survives restarts) and :class:`ValkeyTier`
  (shared between instances; needs ``pip install 'kvblocks[tiers]'``).
- :mod:`~kvblocks.tiers.transfer`: :func:`gather_blocks` / :func:`scatter_blocks` between a
  paged cache and payloads; :func:`offload_blocks` / :func:`load_blocks` apply the core's
  slot-addressed ``"offload"`` / ``"load"`` op runs to an :func:`allocate_host_pool` pool.
- A remote tier below an engine's host tier: :mod:`~kvblocks.tiers.remote_link`
  (:class:`RemoteTierLink`, :class:`RemoteTierOptions`: writes offloaded blocks, reads and
  imports a sequence's missing ones), :mod:`~kvblocks.tiers.remote_worker` (its background
  thread) and :mod:`~kvblocks.tiers.remote_admission` (which requests wait for their reads,
  which preempted sequences are read again).

Needs torch (``pip install 'kvblocks[torch]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvblocks._extras import raise_missing_extra

try:
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:
    raise_missing_extra(_exc, "kvblocks.tiers", "torch", ["torch"])

from kvblocks.tiers.codec import decode_block, encode_block
from kvblocks.tiers.disk import DiskTier
from kvblocks.tiers.errors import CorruptBlockError, UnauthenticatedBlockError
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.mac import RecordKey
from kvblocks.tiers.remote_link import RemoteTierLink, RemoteTierOptions
from kvblocks.tiers.stats import TierStats
from kvblocks.tiers.store import TierStore
from kvblocks.tiers.transfer import (
    allocate_host_pool,
    gather_blocks,
    load_blocks,
    offload_blocks,
    scatter_blocks,
)

if TYPE_CHECKING:
    from kvblocks.tiers.valkey_tier import ValkeyTier

__all__ = [
    "CorruptBlockError",
    "DiskTier",
    "HostTier",
    "KVLayout",
    "RecordKey",
    "RemoteTierLink",
    "RemoteTierOptions",
    "TierStats",
    "TierStore",
    "UnauthenticatedBlockError",
    "ValkeyTier",
    "allocate_host_pool",
    "decode_block",
    "encode_block",
    "gather_blocks",
    "load_blocks",
    "offload_blocks",
    "scatter_blocks",
]


def __getattr__(name: str) -> Any:
    # The valkey client is an optional extra: import it only when the remote tier is used.
    if name == "ValkeyTier":
        from kvblocks.tiers.valkey_tier import ValkeyTier

        return ValkeyTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
