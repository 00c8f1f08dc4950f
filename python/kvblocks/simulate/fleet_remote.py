"""A remote tier shared by every instance of a simulated fleet (one Valkey, modelled).

The store holds block hashes only (the simulation moves no bytes), least recently used
evicted first, like a Valkey server with ``maxmemory-policy allkeys-lru``. It is used the
way ``LLM(remote_tier=...)`` uses a real store (:mod:`kvblocks.engine.remote_tier`):

- **writes**: every block an instance offloads to its host tier is written to the store
  under its hash (``host_offload="commit"`` makes every computed block reach it). The
  engine writes on a background thread, so writes cost the step nothing here.
- **reads**: when a request is routed to an instance, the blocks of its prompt past what
  the instance holds (GPU prefix cache + host tier, at most the host tier's size) are
  looked up; the leading run of hits is imported into host-tier slots
  (``KVCacheManager.import_tier_blocks``), which the request's admission then loads like
  offloaded blocks. Their bytes cross the network at the cost model's
  ``remote_bandwidth_bytes_per_s``, the bandwidth of the one server's link, which serves
  the whole fleet's reads one at a time; the request joins its instance's queue when its
  bytes have arrived and are imported (the engine holds a prefetching request back the
  same way, while the others run), unless they would arrive later than
  ``remote_fetch_wait_s`` after it was routed: then it joins at once and computes them, as
  the engine does after ``RemoteTierOptions.fetch_wait_s`` (the link still carries the
  read, like the engine's background thread). The host-tier loads that follow are
  charged like any other load. Writes are not charged: they leave each instance off its
  step path, in the other direction of the (full-duplex) links.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvblocks._core import KVCacheManager
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.simulate.cost_model import CostModel

__all__ = ["RemoteTotals", "SharedRemoteTier"]


@dataclass
class RemoteTotals:
    """What the fleet did with its shared remote tier.

    Attributes:
        blocks_published: offloaded blocks written to the store (rewrites included).
        blocks_read: blocks sent over the server's link (hits of every read).
        blocks_imported: read blocks imported into an instance's host tier.
        lookups, hits: blocks looked up at routing / found.
        fetch_timeouts: reads that would arrive later than the fleet's
            ``remote_fetch_wait_s``: the request went ahead without them (recompute),
            while the link still carried them, as the engine's background read does.
        evictions: blocks the store dropped to stay within its capacity.
        transfer_s: seconds the imported blocks took over the network (their requests
            waited for them).
    """

    blocks_published: int = 0
    blocks_read: int = 0
    blocks_imported: int = 0
    fetch_timeouts: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    transfer_s: float = 0.0

    def summary(self, block_bytes: int, block_size: int, prompt_tokens: int) -> dict[str, Any]:
        """JSON-ready numbers; ``remote_hit_rate``: imported tokens over prompt tokens."""
        return {
            "remote_blocks_published": self.blocks_published,
            "remote_blocks_read": self.blocks_read,
            "remote_blocks_imported": self.blocks_imported,
            "remote_fetch_timeouts": self.fetch_timeouts,
            "remote_lookups": self.lookups,
            "remote_hits": self.hits,
            "remote_evictions": self.evictions,
            "remote_transfer_bytes": self.blocks_read * block_bytes,
            "remote_transfer_s": self.transfer_s,
            "remote_hit_rate": self.blocks_imported * block_size / max(prompt_tokens, 1),
        }


class SharedRemoteTier:
    """The store: ``capacity_blocks`` block hashes, LRU, shared by all instances."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.totals = RemoteTotals()
        self.link_free = 0.0  # when the server's link has sent every read asked so far

    def read_done(self, now: float, num_blocks: int, cost: CostModel, block_size: int) -> float:
        """When a read of ``num_blocks`` asked at ``now`` has arrived: reads share the
        server's link, first come first served."""
        transfer = cost.remote_transfer_time(num_blocks, block_size)
        self.totals.blocks_read += num_blocks
        self.totals.transfer_s += transfer
        self.link_free = max(now, self.link_free) + transfer
        return self.link_free

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def publish(self, manager: KVCacheManager, output: SchedulerOutput) -> int:
        """Write the blocks ``output``'s ``"offload"`` ops copy to the host tier; how many.

        Call after ``schedule()`` and before ``update()``: the offloaded slots are pinned
        until then, so each still holds the hash it was offloaded under.
        """
        slots = [
            np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 1]
            for kind, pairs in output.memory_ops
            if kind == "offload"
        ]
        if not slots:
            return 0
        written = 0
        for block_hash in manager.tier_slot_hashes(np.concatenate(slots)):
            if block_hash is None:
                continue
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
            written += 1
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.totals.evictions += 1
        self.totals.blocks_published += written
        return written

    def lookup(self, manager: KVCacheManager, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The leading run of a prompt's blocks past the instance's own hit (its full
        blocks but the last token's, ``block_hashes``; at most the host tier's size) that
        the store holds: what a read brings back."""
        start = manager.num_cached_prefix_blocks(list(block_hashes))
        wanted = list(block_hashes[start : start + manager.host_cache_blocks])
        self.totals.lookups += len(wanted)
        found = 0
        while found < len(wanted) and wanted[found] in self._blocks:
            self._blocks.move_to_end(wanted[found])
            found += 1
        self.totals.hits += found
        return wanted[:found]

    def import_blocks(self, manager: KVCacheManager, block_hashes: Sequence[bytes]) -> int:
        """Import read blocks into the instance's host tier (between steps); how many got
        a slot (none for blocks it holds by now)."""
        if not block_hashes:
            return 0
        slots = manager.import_tier_blocks(list(block_hashes))
        # Nothing is written in a simulation: the reserved slots are ready at once.
        manager.confirm_memory_ops()
        imported = int((np.asarray(slots) >= 0).sum())
        self.totals.blocks_imported += imported
        return imported
