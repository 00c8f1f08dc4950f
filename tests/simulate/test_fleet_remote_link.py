"""The shared remote tier's one link carries the fleet's writes as well as its reads: a
write-back occupies it (reads asked later wait behind it), a written block can be read only
once it has crossed, and an instance's write queue is bounded like the engine's."""

from __future__ import annotations

import pytest

from kvblocks._core import KVCacheManager
from kvblocks.simulate import CostModel
from kvblocks.simulate.fleet_remote import SharedRemoteTier

from .test_fleet import _tiered

BS = 8
COST = CostModel(remote_bandwidth_bytes_per_s=1e9)
PER_BLOCK = COST.remote_transfer_time(1, BS)  # 4 MiB blocks: 4.2 ms each


def _hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]  # 32 bytes: BLAKE3's digest length


def _manager() -> KVCacheManager:
    return KVCacheManager(16, BS, num_cpu_blocks=0, host_cache_blocks=64, record_events=True)


def test_reads_wait_behind_writes_and_see_a_block_once_it_landed() -> None:
    tier = SharedRemoteTier(1024)
    written = _hashes(10)
    assert tier.write(0, written, 0.0, COST, BS) == 10
    assert tier.totals.write_s == pytest.approx(10 * PER_BLOCK)
    # Nothing has crossed yet: another instance finds none of it.
    m = _manager()
    assert tier.lookup(m, written, 5 * PER_BLOCK) == []
    # A read asked now waits for the ten blocks ahead of it on the link.
    done = tier.read_done(5 * PER_BLOCK, 2, COST, BS)
    assert done == pytest.approx(12 * PER_BLOCK)
    assert tier.totals.transfer_s == pytest.approx(2 * PER_BLOCK)
    # Once the write has crossed, every block is there.
    assert tier.lookup(m, written, 10 * PER_BLOCK) == written
    assert len(tier) == 10


def test_an_instance_write_queue_is_bounded_and_drains_as_the_link_sends() -> None:
    tier = SharedRemoteTier(1024, max_pending_write_blocks=8)
    assert tier.write(0, _hashes(6, 1), 0.0, COST, BS) == 6
    assert tier.write(0, _hashes(6, 2), 0.0, COST, BS) == 2  # 4 dropped
    assert tier.write(1, _hashes(3, 3), 0.0, COST, BS) == 3  # another instance's queue
    assert tier.totals.dropped_writes == 4 and tier.totals.blocks_published == 11
    # Instance 0's first write has crossed by then: its queue has room for 6 again.
    assert tier.write(0, _hashes(9, 4), 6 * PER_BLOCK, COST, BS) == 6
    assert tier.totals.dropped_writes == 7
    assert tier.totals.write_s == pytest.approx(17 * PER_BLOCK)


def test_write_through_traffic_saturates_a_slow_link() -> None:
    """At 100 MB/s (42 ms a block) the fleet offloads faster than the link writes: queues
    fill and drop, nothing lands in time to be read, and the link is busy past the run."""
    slow = _tiered(
        "round-robin",
        4096,
        cost_model=CostModel(remote_bandwidth_bytes_per_s=1e8),
        remote_fetch_wait_s=1e9,
        remote_max_pending_write_blocks=32,
    )
    remote = slow.remote
    assert remote.dropped_writes > 0
    assert remote.blocks_published + remote.dropped_writes == slow.tier.blocks_offloaded
    assert remote.blocks_imported == 0
    summary = slow.summary()
    assert summary["remote_write_s"] == pytest.approx(remote.write_s)
    assert remote.write_s > slow.simulated_time_s
    assert summary["remote_link_busy"] > 1.0
    assert summary["remote_dropped_writes"] == remote.dropped_writes
