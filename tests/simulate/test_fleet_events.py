"""The router's view of a fleet with host tiers: what each instance's events say it holds
(per tier) is what its manager holds, and a lower tier never costs cache-aware routing hits.

Regression: every event of an in-process drain used to be recorded as medium ``"GPU"``, so a
host-tier eviction (``BlockRemoved``, medium ``"CPU"``) erased a block the GPU still held
from the router's index, and cache-aware routing sent conversations away from their history
(a write-through tier smaller than the pool: 46.6% hit rate against 51.5% without a tier).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks._core import KVCacheManager
from kvblocks.router import PrefixIndex, records_from_manager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.simulate.runner import _fake_model

from .test_fleet import _fleet

BS = 4


def _held(manager: KVCacheManager, seen: set[bytes]) -> tuple[set[bytes], set[bytes]]:
    """What the manager holds of ``seen``: hashes a probe hits (GPU prefix cache or a
    written tier slot), and hashes in host-tier slots."""
    hit = {h for h in seen if manager.num_cached_prefix_blocks([h]) == 1}
    slots = manager.tier_slot_hashes(np.arange(manager.host_cache_blocks))
    return hit, {h for h in slots if h is not None}


@pytest.mark.parametrize("offload", ["commit", "evict"])
def test_the_index_follows_a_real_scheduler_with_a_small_host_tier(offload: str) -> None:
    """A real scheduler over a 24-block pool and a 6-block tier (both evict all the time):
    after every step the index lists, per tier, exactly what the manager holds."""
    manager = KVCacheManager(
        24, BS, num_cpu_blocks=0, record_events=True, host_cache_blocks=6, host_offload=offload
    )
    sched = Scheduler(manager, SchedulerConfig(max_num_seqs=4), record_history=False)
    index = PrefixIndex()
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 500, size=n) for n in (12, 20, 28)]
    seen: set[bytes] = set()
    checked_cpu = checked_gpu_only = 0
    for i in range(40):
        p = prefixes[i % 3][: int(rng.integers(8, 29))]
        prompt = np.concatenate([p, rng.integers(1, 500, size=int(rng.integers(1, 9)))])
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
        if i % 2:
            continue
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update(out, _fake_model(out, rng, 500))
            records = records_from_manager(0, manager.take_events())
            for r in records:
                seen.update(getattr(r, "block_hashes", ()))
            index.apply_all(records)
            hit, tier = _held(manager, seen)
            gpu = {h for h in seen if index.instances(h, "GPU")}
            cpu = {h for h in seen if index.instances(h, "CPU")}
            # The index's host-tier blocks are the tier's written ones: slots still being
            # written (queued offloads, pinned) are announced when confirmed, hits then.
            pinned = manager.stats()["num_host_pinned_blocks"]
            assert cpu <= tier and len(tier - cpu) <= pinned, (len(cpu), len(tier), pinned)
            # A hit is on the GPU or in a written tier slot: the index holds exactly those.
            assert gpu | cpu == hit, ("lost", len(hit - gpu - cpu), "stale", len((gpu | cpu) - hit))
            checked_cpu += len(tier)
            checked_gpu_only += len(gpu - cpu)
    assert manager.stats()["host_evictions"] > 0 and checked_cpu > 0 and checked_gpu_only > 0


def test_a_write_through_host_tier_never_lowers_cache_aware_hits() -> None:
    """Same trace, 256-block pools, with and without a 64-block write-through host tier per
    instance (it evicts all the time): the GPU hits stay (the tier's evictions must not
    erase GPU blocks from the router's index) and the tier can only add."""
    base = _fleet("cache-aware")
    tiered = _fleet("cache-aware", host_cache_blocks=64, host_offload="commit")
    assert tiered.num_finished == base.num_finished == 60
    summary = tiered.summary()
    assert summary["gpu_hit_rate"] >= base.prefix_hit_rate - 1e-9, (
        summary["gpu_hit_rate"],
        base.prefix_hit_rate,
    )
    assert tiered.prefix_hit_rate >= base.prefix_hit_rate - 1e-9
