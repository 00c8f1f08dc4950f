"""A shared remote tier (e.g. :class:`~kvblocks.tiers.valkey_tier.ValkeyTier`) below the
engine's host tier.

The core decides, this module moves bytes. Every block the core offloads to the host tier
is also written to the remote store, keyed by its block hash, once the step's ops have
copied it into the host pool (write-through, ``host_offload="commit"``, makes every
computed block reach the store). Before a request is queued, the blocks of its prompt past
what the instance holds (GPU prefix cache + host tier) are read from the store; the leading
run of hits is imported into host-tier slots (``KVCacheManager.import_tier_blocks``), their
payloads written into the host pool and confirmed, so the scheduler's claim loads them
instead of recomputing them.

The store never fails the engine: an unreachable server reads as misses (the store warns
once) and a value that fails its checks is rejected and read as a miss; both mean
recompute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvblocks._core import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.router.hasher import PromptHasher
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.store import TierStore

__all__ = ["RemoteTierLink", "RemoteTierStats"]


@dataclass
class RemoteTierStats:
    """What the engine did with the remote tier: ``imported_blocks`` were read and loaded
    into the host tier, ``published_blocks`` offered to the store (``put_many``)."""

    imported_blocks: int = 0
    published_blocks: int = 0


class RemoteTierLink:
    """Connects one engine's host tier (manager + host pool) to a shared store.

    Args:
        store: a :class:`~kvblocks.tiers.store.TierStore` whose layout has the host pool's
            shape and dtype (its ``model_id`` names the weights: only engines with the same
            one share blocks).
        manager: the engine's manager (with a host tier).
        host_pool: the runner's uint8 ``[slots, payload_nbytes]`` host pool.
        layout: the host pool's layout.
    """

    def __init__(
        self, store: Any, manager: KVCacheManager, host_pool: torch.Tensor | None, layout: KVLayout
    ) -> None:
        if not isinstance(store, TierStore):
            raise InvalidArgumentError(
                f"remote_tier must be a TierStore (e.g. ValkeyTier), got {type(store).__name__}"
            )
        if host_pool is None or manager.host_cache_blocks == 0:
            raise InvalidArgumentError("remote_tier needs a host tier (host_cache_blocks > 0)")
        if dataclasses.replace(store.layout, model_id="") != layout:
            raise InvalidArgumentError(
                f"remote_tier's layout {store.layout} does not match the engine's KV cache "
                f"{layout} (layers, KV heads, block size, head size, dtype)"
            )
        self.store = store
        self.manager = manager
        self.host_pool = host_pool
        self.hasher = PromptHasher(manager.block_size, manager.hash_algo)
        self.stats = RemoteTierStats()

    def publish(self, memory_ops: Sequence[tuple[str, object]]) -> None:
        """Write the rows the applied ``"offload"`` ops filled to the store.

        Call after the ops were applied and before ``confirm_memory_ops`` (their slots are
        pinned until then, so each still holds the hash it was offloaded under).
        """
        slots = [
            np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 1]
            for kind, pairs in memory_ops
            if kind == "offload"
        ]
        if not slots:
            return
        ids = np.concatenate(slots)
        if not ids.size:
            return
        hashes = self.manager.tier_slot_hashes(ids)
        keep = [i for i, h in enumerate(hashes) if h is not None]
        if not keep:
            return
        rows = self.host_pool[torch.as_tensor(ids[keep], dtype=torch.long)]
        self.store.put_many([hashes[i] for i in keep], list(rows.unbind(0)))
        self.stats.published_blocks += len(keep)

    def fetch(self, prompt_token_ids: Sequence[int]) -> int:
        """Import the prompt's blocks past the local hit from the store; blocks imported.

        Call between steps with no op in flight: the imported slots are confirmed here.
        """
        block_size = self.manager.block_size
        # A claim never covers the whole prompt: its last token is always computed.
        limit = (len(prompt_token_ids) - 1) // block_size
        if limit <= 0:
            return 0
        hashes = self.hasher.block_hashes(np.asarray(prompt_token_ids, dtype=np.int64))[:limit]
        start = self.manager.num_cached_prefix_blocks(hashes)
        wanted = hashes[start : start + self.manager.host_cache_blocks]
        if not wanted:
            return 0
        payloads = self.store.get_many(wanted)
        found = 0
        while found < len(payloads) and payloads[found] is not None:
            found += 1
        if not found:
            return 0
        slots = self.manager.import_tier_blocks(wanted[:found])
        rows = [i for i in range(found) if slots[i] >= 0]
        try:
            if rows:
                data = torch.stack([payloads[i] for i in rows])  # type: ignore[misc]
                self.host_pool[torch.as_tensor(slots[rows], dtype=torch.long)] = data
        except BaseException:
            # Nothing reserved may become a hit with unwritten bytes: drop the tier's
            # unpinned blocks once the reservations are released.
            self.manager.confirm_memory_ops()
            self.manager.reset_prefix_cache()
            raise
        self.manager.confirm_memory_ops()
        self.stats.imported_blocks += len(rows)
        return len(rows)
