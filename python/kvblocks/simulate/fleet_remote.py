"""A remote tier shared by every instance of a simulated fleet (one Valkey, modelled).

The store holds block hashes only (the simulation moves no bytes), least recently used
evicted first, like a Valkey server with ``maxmemory-policy allkeys-lru``. It is used the
way ``LLM(remote_tier=...)`` uses a real store (:mod:`kvblocks.tiers.remote_link`):

- **writes**: every block an instance offloads to its host tier is written to the store
  under its hash (``host_offload="commit"`` makes every computed block reach it), as the
  engine's background writer does: queued when the step that copies it to the host tier
  starts, never delaying a step. An instance's queue holds at most
  ``max_pending_write_blocks`` blocks not yet written (the engine's
  ``RemoteTierOptions.max_pending_write_blocks``, 256); a write that does not fit is
  dropped (``dropped_writes``). A written block can be read once its bytes have crossed
  the link.
- **reads**: when a request is routed to an instance, the blocks of its prompt past what
  the instance holds (GPU prefix cache + host tier, at most the host tier's size) are
  looked up; the leading run of hits is imported into host-tier slots
  (``KVCacheManager.import_tier_blocks``), which the request's admission then loads like
  offloaded blocks. The request joins its instance's queue when its bytes have arrived
  and are imported (the engine holds a prefetching request back the same way, while the
  others run), unless they would arrive later than ``remote_fetch_wait_s`` after it was
  routed: then it joins at once and computes them, as the engine does after
  ``RemoteTierOptions.fetch_wait_s`` (the link still carries the read, like the engine's
  background thread). The host-tier loads that follow are charged like any other load.
- **the link**: the server's one link carries every read and every write of the fleet,
  first come first served, at the cost model's ``remote_bandwidth_bytes_per_s``: reads
  queue behind the writes sent before them. Both directions share it (a conservative
  model: a full-duplex link would carry them apart, but one Valkey thread serves every
  command), so its busy time is the fleet's whole remote traffic.

An instance's reads of its own writes still in flight are not answered from its queue as
the engine's are: such blocks are still in its host tier, where the lookup stops first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
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
        blocks_published: offloaded blocks sent to the store (rewrites included).
        dropped_writes: offloaded blocks dropped because their instance's write queue
            was full (never sent).
        write_s: seconds the link spent on writes.
        blocks_read: blocks sent over the server's link (hits of every read).
        blocks_imported: read blocks imported into an instance's host tier.
        blocks_stranded: imported blocks whose request cannot claim them: its instance
            lost a block before them while the read was in flight (so the longer reads
            wait on the link, the more of them).
        lookups, hits: blocks looked up at routing / found.
        fetch_timeouts: reads that would arrive later than the fleet's
            ``remote_fetch_wait_s``: the request went ahead without them (recompute),
            while the link still carried them, as the engine's background read does.
        evictions: blocks the store dropped to stay within its capacity.
        transfer_s: seconds the link spent on reads (their requests waited for them).
    """

    blocks_published: int = 0
    dropped_writes: int = 0
    write_s: float = 0.0
    blocks_read: int = 0
    blocks_imported: int = 0
    blocks_stranded: int = 0
    fetch_timeouts: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    transfer_s: float = 0.0

    def summary(
        self, block_bytes: int, block_size: int, prompt_tokens: int, simulated_time_s: float
    ) -> dict[str, Any]:
        """JSON-ready numbers; ``remote_hit_rate``: imported tokens over prompt tokens;
        ``remote_link_busy``: the link's read + write time over the simulated time."""
        return {
            "remote_blocks_published": self.blocks_published,
            "remote_dropped_writes": self.dropped_writes,
            "remote_write_bytes": self.blocks_published * block_bytes,
            "remote_write_s": self.write_s,
            "remote_blocks_read": self.blocks_read,
            "remote_blocks_imported": self.blocks_imported,
            "remote_blocks_stranded": self.blocks_stranded,
            "remote_fetch_timeouts": self.fetch_timeouts,
            "remote_lookups": self.lookups,
            "remote_hits": self.hits,
            "remote_evictions": self.evictions,
            "remote_transfer_bytes": self.blocks_read * block_bytes,
            "remote_transfer_s": self.transfer_s,
            "remote_hit_rate": self.blocks_imported * block_size / max(prompt_tokens, 1),
            "remote_link_busy": (self.transfer_s + self.write_s) / max(simulated_time_s, 1e-12),
        }


class SharedRemoteTier:
    """The store: ``capacity_blocks`` block hashes, LRU, shared by all instances, behind
    one link that carries every read and write in turn."""

    def __init__(self, capacity_blocks: int, max_pending_write_blocks: int = 256) -> None:
        self.capacity_blocks = capacity_blocks
        self.max_pending_write_blocks = max_pending_write_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.totals = RemoteTotals()
        self.link_free = 0.0  # when the server's link has sent everything asked so far
        # writes on the link: (lands at, order, hashes); visible once landed
        self._landing: list[tuple[float, int, list[bytes]]] = []
        self._sent = 0
        # per instance: (lands at, blocks) of its writes not landed yet (its queue)
        self._queues: dict[int, deque[tuple[float, int]]] = {}

    def _send(self, now: float, num_blocks: int, cost: CostModel, block_size: int) -> float:
        """Put ``num_blocks`` on the link at ``now``, after what it carries; when they
        have crossed it."""
        self.link_free = max(now, self.link_free) + cost.remote_transfer_time(
            num_blocks, block_size
        )
        return self.link_free

    def read_done(self, now: float, num_blocks: int, cost: CostModel, block_size: int) -> float:
        """When a read of ``num_blocks`` asked at ``now`` has arrived: it waits for what
        the link was asked to carry before it (reads and writes)."""
        self.totals.blocks_read += num_blocks
        self.totals.transfer_s += cost.remote_transfer_time(num_blocks, block_size)
        return self._send(now, num_blocks, cost, block_size)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def land(self, now: float) -> None:
        """Store the writes whose bytes have crossed the link by ``now`` (LRU order)."""
        while self._landing and self._landing[0][0] <= now:
            _, _, hashes = heapq.heappop(self._landing)
            for block_hash in hashes:
                self._blocks[block_hash] = None
                self._blocks.move_to_end(block_hash)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
                self.totals.evictions += 1

    @staticmethod
    def offloaded(manager: KVCacheManager, output: SchedulerOutput) -> list[bytes]:
        """The hashes of the blocks ``output``'s ``"offload"`` ops copy to the host tier.

        Call after ``schedule()`` and before ``update()``: the offloaded slots are pinned
        until then, so each still holds the hash it was offloaded under.
        """
        slots = [
            np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 1]
            for kind, pairs in output.memory_ops
            if kind == "offload"
        ]
        if not slots:
            return []
        return [h for h in manager.tier_slot_hashes(np.concatenate(slots)) if h is not None]

    def write(
        self,
        instance: int,
        block_hashes: Sequence[bytes],
        now: float,
        cost: CostModel,
        block_size: int,
    ) -> int:
        """Queue ``instance``'s write-back of ``block_hashes`` at ``now``; how many were
        sent (the rest did not fit its queue and are dropped)."""
        if not block_hashes:
            return 0
        queue = self._queues.setdefault(instance, deque())
        while queue and queue[0][0] <= now:
            queue.popleft()
        room = self.max_pending_write_blocks - sum(n for _, n in queue)
        keep = list(block_hashes[: max(room, 0)])
        self.totals.dropped_writes += len(block_hashes) - len(keep)
        if not keep:
            return 0
        self.totals.write_s += cost.remote_transfer_time(len(keep), block_size)
        done = self._send(now, len(keep), cost, block_size)
        heapq.heappush(self._landing, (done, self._sent, keep))
        self._sent += 1
        queue.append((done, len(keep)))
        self.totals.blocks_published += len(keep)
        return len(keep)

    def publish(
        self,
        instance: int,
        manager: KVCacheManager,
        output: SchedulerOutput,
        now: float,
        cost: CostModel,
        block_size: int,
    ) -> int:
        """Queue the write-back of what ``output`` offloads (:meth:`offloaded`, then
        :meth:`write`), when its step starts at ``now``; how many blocks were sent."""
        return self.write(instance, self.offloaded(manager, output), now, cost, block_size)

    def lookup(
        self, manager: KVCacheManager, block_hashes: Sequence[bytes], now: float
    ) -> list[bytes]:
        """The leading run of a prompt's blocks past the instance's own hit (its full
        blocks but the last token's, ``block_hashes``; at most the host tier's size) that
        the store holds at ``now``: what a read brings back."""
        self.land(now)
        start = manager.num_cached_prefix_blocks(list(block_hashes))
        wanted = list(block_hashes[start : start + manager.host_cache_blocks])
        self.totals.lookups += len(wanted)
        found = 0
        while found < len(wanted) and wanted[found] in self._blocks:
            self._blocks.move_to_end(wanted[found])
            found += 1
        self.totals.hits += found
        return wanted[:found]

    def import_blocks(
        self,
        manager: KVCacheManager,
        block_hashes: Sequence[bytes],
        prefix: Sequence[bytes] = (),
    ) -> int:
        """Import read blocks into the instance's host tier (between steps); how many got
        a slot (none for blocks it holds by now). ``prefix``: the prompt's blocks before
        them, which the instance held when the read was asked; if it lost one while the
        read was in flight, the imports are counted ``blocks_stranded`` (imported as the
        engine does, but its request's claim stops at the lost block)."""
        if not block_hashes:
            return 0
        stranded = manager.num_cached_prefix_blocks(list(prefix)) < len(prefix)
        slots = manager.import_tier_blocks(list(block_hashes))
        # Nothing is written in a simulation: the reserved slots are ready at once.
        manager.confirm_memory_ops()
        imported = int((np.asarray(slots) >= 0).sum())
        self.totals.blocks_imported += imported
        if stranded:
            self.totals.blocks_stranded += imported
        return imported
