"""Routers' choices on hand-built fleets, and the cache-aware cost formula."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import (
    BlockStoredRecord,
    CacheAwareRouter,
    InstanceLoad,
    LeastLoadedRouter,
    PromptHasher,
    RoundRobinRouter,
    make_router,
    records_from_manager,
)

H = tuple(bytes([i]) * 16 for i in range(10))


def test_round_robin_cycles_whatever_the_load() -> None:
    r = RoundRobinRouter(3)
    r.set_load(0, InstanceLoad(active_blocks=10_000))
    assert [r.route(H, 10) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_the_lowest_load_and_ignores_the_cache() -> None:
    r = LeastLoadedRouter(3)
    r.apply_events([BlockStoredRecord(0, H)])  # ignored: no index
    r.set_load(0, InstanceLoad(active_blocks=50))
    r.set_load(1, InstanceLoad(active_blocks=10, queued_prefill_blocks=30))
    r.set_load(2, InstanceLoad(active_blocks=30))
    # costs: 0: 10 + 50 = 60; 1: 10 + 30 + 10 = 50; 2: 10 + 30 = 40
    assert r.costs(H, 10) == [60.0, 50.0, 40.0]
    assert r.route(H, 10) == 2


def test_cache_aware_cost_formula_by_hand() -> None:
    r = CacheAwareRouter(3, prefill_weight=2.0)
    r.apply_events([BlockStoredRecord(1, H[:6]), BlockStoredRecord(2, H[:2])])
    r.set_load(0, InstanceLoad(active_blocks=5))
    r.set_load(1, InstanceLoad(active_blocks=4, queued_prefill_blocks=1))
    r.set_load(2, InstanceLoad(active_blocks=0))
    # cost = 2 * (P - overlap + queued) + active, P = 10 prompt blocks
    assert r.overlaps(H) == [0.0, 6.0, 2.0]
    assert r.costs(H, 10) == [25.0, 14.0, 16.0]
    assert r.route(H, 10) == 1
    # Load outweighs the cached prefix once the holder is busy enough.
    r.set_load(1, InstanceLoad(active_blocks=7, queued_prefill_blocks=1))
    assert r.costs(H, 10)[1] == 17.0
    assert r.route(H, 10) == 2


def test_cache_aware_follows_the_longest_prefix_when_loads_are_equal() -> None:
    r = CacheAwareRouter(4)
    r.apply_events(
        [BlockStoredRecord(0, H[:3]), BlockStoredRecord(2, H[:8]), BlockStoredRecord(3, H[:5])]
    )
    assert r.route(H, 10) == 2
    # Instances 2 and 3 both hold all 4 blocks: a tie, broken by rotation.
    assert r.overlaps(H[:4]) == [3.0, 0.0, 4.0, 4.0]
    assert r.route(H[:4], 4) == 3  # the first tied one after the last pick (2)
    other = tuple(bytes([100 + i]) * 16 for i in range(4))
    assert r.overlaps(other) == [0.0, 0.0, 0.0, 0.0]


def test_lower_tiers_credit_less_than_the_gpu() -> None:
    r = CacheAwareRouter(2, tier_credit={"CPU": 0.25})
    r.apply_events([BlockStoredRecord(0, H[:4]), BlockStoredRecord(1, H[:4], medium="CPU")])
    assert r.overlaps(H[:4]) == [4.0, 1.0]
    assert r.route(H[:4], 4) == 0
    r2 = CacheAwareRouter(1)
    r2.apply_events([BlockStoredRecord(0, H[:2], medium="DISK")])
    assert r2.overlaps(H[:2]) == [1.0]  # unlisted tiers: half a block each


def test_ties_rotate_instead_of_piling_on_instance_zero() -> None:
    for r in (CacheAwareRouter(3), LeastLoadedRouter(3)):
        assert [r.route((), 1) for _ in range(4)] == [0, 1, 2, 0]


def test_events_for_unknown_instances_do_not_break_routing() -> None:
    r = CacheAwareRouter(2)
    r.apply_events([BlockStoredRecord(9, H[:3])])
    assert r.overlaps(H[:3]) == [0.0, 0.0]
    assert r.route(H[:3], 3) in (0, 1)


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="router must be one of"):
        make_router("random", 2)
    with pytest.raises(InvalidArgumentError):
        make_router("cache-aware", 0)
    with pytest.raises(InvalidArgumentError):
        CacheAwareRouter(2, prefill_weight=-1.0)
    r = RoundRobinRouter(2)
    with pytest.raises(InvalidArgumentError):
        r.set_load(2, InstanceLoad())
    assert isinstance(make_router("least-loaded", 2), LeastLoadedRouter)


def test_a_block_aligned_prompt_s_last_block_is_not_credited() -> None:
    """A claim never covers a prompt's last token, so an instance holding every block of
    a block-aligned prompt serves one block less than it holds: the router credits what
    the manager then gives, not the blocks held."""
    prompt = list(range(1, 9))  # two full blocks of 4
    managers = [KVCacheManager(16, 4), KVCacheManager(16, 4)]
    for m, tokens in zip(managers, (prompt, [*prompt[:4], 90, 91, 92, 93]), strict=True):
        m.add_sequence(0, tokens)
        m.allocate_slots(0, 8)
        m.commit(0, 8)
        m.free(0)
    r = CacheAwareRouter(2)
    for i, m in enumerate(managers):
        r.apply_events(records_from_manager(i, m.take_events()))
    hashes = PromptHasher(4).block_hashes(prompt)
    assert len(hashes) == 2 and r.index.overlaps(hashes) == {0: 2, 1: 1}  # blocks held
    for m in managers:
        assert m.add_sequence(1, prompt) == 4  # ... but each serves one block
    r.set_load(0, InstanceLoad(active_blocks=1))
    # cost = 8 * (2 - 1) + active: instance 1, less loaded, for the same hit.
    assert r.costs(hashes, 2) == [9.0, 8.0]
    assert r.route(hashes, 2) == 1


@pytest.mark.parametrize("seed", range(3))
def test_the_cost_credits_the_hit_a_real_manager_gives(seed: int) -> None:
    """Random prompts over one shared text, block-aligned ones included, on a real manager
    whose events feed the router: the cost of every new prompt credits exactly the hit
    the manager then gives it."""
    rng = np.random.default_rng(seed)
    bs = 4
    m = KVCacheManager(24, bs)  # small enough to evict
    r = CacheAwareRouter(1, prefill_weight=1.0)  # cost = P - credit at no load
    hasher = PromptHasher.from_manager(m)
    text = rng.integers(1, 50, 48).tolist()
    whole = 0  # block-aligned prompts the manager held whole
    for sid in range(60):
        prompt = text[: int(rng.integers(1, len(text) + 1))]
        if rng.random() < 0.3:
            prompt += rng.integers(50, 99, int(rng.integers(1, 6))).tolist()
        m.add_sequence(sid, prompt)
        p = -(-len(prompt) // bs)
        hashes = hasher.block_hashes(prompt)
        hit = m.num_cached_tokens(sid) // bs
        assert r.costs(hashes, p) == [float(p - hit)], (sid, len(prompt), hit)
        whole += len(hashes) == p and m.num_cached_prefix_blocks(hashes) == p
        if m.allocate_slots(sid, len(prompt) - hit * bs) is not None:
            m.commit(sid, len(prompt) - hit * bs)
        m.free(sid)
        r.apply_events(records_from_manager(0, m.take_events()))
    assert whole > 0
