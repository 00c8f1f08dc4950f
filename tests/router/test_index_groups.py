"""The prefix index with KV cache groups: an instance's hit is what it can serve under
the core's hit rule (docs/hybrid-groups.md), checked against real managers' own hits."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import GroupSpec, InvalidArgumentError, KVCacheManager
from kvblocks.router import (
    BlockRemovedRecord,
    BlockStoredRecord,
    CacheAwareRouter,
    PrefixIndex,
    records_from_manager,
)

H = [bytes([i]) * 8 for i in range(32)]
FULL = GroupSpec.full_attention()


def _stored(inst: int, hashes, group: int, kind: str | None, window: int | None = None):
    return BlockStoredRecord(inst, tuple(hashes), None, "GPU", group, kind, window, 4)


def _hybrid_index() -> PrefixIndex:
    """Instance 0: full attention + an 8-token window (blocks of 4), ten blocks stored in
    both groups."""
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:10], 0, "full_attention"))
    idx.apply(_stored(0, H[:10], 1, "sliding_window", 8))
    return idx


def test_a_window_group_that_evicted_old_blocks_still_serves_the_hit() -> None:
    idx = _hybrid_index()
    # The window group evicted its first seven blocks: a query at position 40 sees
    # 33..40, blocks 8 and 9 only.
    idx.apply(BlockRemovedRecord(0, tuple(H[:7]), "GPU", 1))
    assert idx.overlaps(H[:10]) == {0: 10}
    # A window-only instance (one group) that evicted its old blocks serves the same;
    # the leading-blocks count saw no hit at all.
    idx.apply(_stored(1, H[:10], 0, "sliding_window", 8))
    idx.apply(BlockRemovedRecord(1, tuple(H[:7]), "GPU", 0))
    assert idx.overlaps(H[:10]) == {0: 10, 1: 10}
    assert CacheAwareRouter(2, index=idx).overlaps(H[:10]) == [10.0, 10.0]


def test_an_instance_missing_the_window_groups_last_blocks_reports_a_shorter_hit() -> None:
    idx = _hybrid_index()
    # Window group lost block 9: a hit of 10 needs blocks 8..9, of 9 blocks 7..8.
    idx.apply(BlockRemovedRecord(0, (H[9],), "GPU", 1))
    assert idx.overlaps(H[:10]) == {0: 9}
    # Blocks 8 and 7 gone too: 9 needs 7..8, 8 needs 6..7, 7 needs 5..6: served.
    idx.apply(BlockRemovedRecord(0, (H[8], H[7]), "GPU", 1))
    assert idx.overlaps(H[:10]) == {0: 7}
    # The full group's gap cuts every hit past it whatever the window holds.
    idx.apply(BlockRemovedRecord(0, (H[3],), "GPU", 0))
    assert idx.overlaps(H[:10]) == {0: 3}


def test_a_window_hit_is_a_fixed_point_not_a_leading_count() -> None:
    """A window group may serve k and not k - 1: the index finds the longest k every
    group serves, as the manager's fixed point does."""
    idx = PrefixIndex()
    # Window of 4 tokens, blocks of 4: a hit of k needs block k - 1 only.
    idx.apply(_stored(0, [H[0], H[2], H[4], H[5]], 0, "sliding_window", 4))
    assert idx.overlaps(H[:6]) == {0: 6}
    assert idx.overlaps(H[:4]) == {0: 3}
    assert idx.overlaps(H[:2]) == {0: 1}


def test_a_recurrent_group_needs_the_state_at_the_hit_boundary() -> None:
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:8], 0, "full_attention"))
    idx.apply(_stored(0, [H[3], H[7]], 1, "mamba"))  # states after 4 and 8 blocks
    assert idx.overlaps(H[:8]) == {0: 8}
    assert idx.overlaps(H[:7]) == {0: 4}
    idx.apply(BlockRemovedRecord(0, (H[3],), "GPU", 1))
    assert idx.overlaps(H[:7]) == {}


def test_a_group_below_a_known_one_serves_nothing_until_it_stores() -> None:
    """Group 1 stored blocks, group 0 (a recurrent group, say) nothing yet: the instance
    serves no hit, and the index says so."""
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:4], 1, "full_attention"))
    assert idx.overlaps(H[:4]) == {}
    idx.apply(_stored(0, [H[1]], 0, "mamba"))
    assert idx.overlaps(H[:4]) == {0: 2}


def test_a_chunked_group_is_served_by_its_chunk_once_told_the_chunk_size() -> None:
    """Events name no chunk size: until told, a chunked group needs every block (a
    shorter hit, never a longer one)."""
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:6], 0, "chunked_local_attention"))
    idx.apply(BlockRemovedRecord(0, (H[0], H[1]), "GPU", 0))
    assert idx.overlaps(H[:6]) == {}
    idx.set_group_specs(0, [GroupSpec.chunked_local_attention(8)], block_size=4)
    # A query at 24 starts a chunk (needs nothing), at 20 sees 16..20 (block 4).
    assert idx.overlaps(H[:6]) == {0: 6}
    assert idx.overlaps(H[:5]) == {0: 5}
    assert idx.overlaps(H[:3]) == {0: 3}
    # Without block 2: a query at 12 sees 8..12 (block 2), one at 8 starts a chunk.
    idx.apply(BlockRemovedRecord(0, (H[2],), "GPU", 0))
    assert idx.overlaps(H[:3]) == {0: 2}
    assert idx.overlaps(H[:6]) == {0: 6}


def test_credit_counts_the_tier_every_group_needing_a_block_reads() -> None:
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:4], 0, "full_attention"))
    idx.apply(_stored(0, H[2:4], 1, "sliding_window", 8))
    idx.apply(BlockStoredRecord(0, (H[3],), None, "CPU", 1, "sliding_window", 8, 4))
    idx.apply(BlockRemovedRecord(0, (H[3],), "GPU", 1))
    credit = {"GPU": 1.0, "CPU": 0.5}.__getitem__
    # Blocks 0..2 from the GPU, block 3's window copy from the CPU tier.
    assert idx.credited_overlaps(H[:4], credit) == {0: 3.5}


def test_a_single_group_fleet_is_indexed_as_before() -> None:
    """One full-attention group (kind given or not): the leading blocks held."""
    idx = PrefixIndex()
    idx.apply(_stored(0, H[:5], 0, "full_attention"))
    idx.apply(BlockStoredRecord(1, tuple(H[:3])))
    idx.apply(BlockRemovedRecord(0, (H[2],)))
    assert idx.overlaps(H[:5]) == {0: 2, 1: 3}
    assert idx.group_rules(0) == idx.group_rules(1)


def test_bad_group_specs_raise_and_change_nothing() -> None:
    idx = _hybrid_index()
    before = idx.group_rules(0)
    for groups, bs in (([object()], 4), ([], 4), ([FULL], 0), ([FULL], True)):
        with pytest.raises(InvalidArgumentError):
            idx.set_group_specs(0, groups, bs)
    assert idx.group_rules(0) == before


def _random_groups(rng: np.random.Generator) -> list[GroupSpec]:
    groups = [FULL] if rng.random() < 0.7 else []
    for _ in range(int(rng.integers(1, 3))):
        kind = int(rng.integers(0, 4))
        if kind == 0:
            groups.append(GroupSpec.sliding_window(int(rng.integers(2, 20))))
        elif kind == 1:
            groups.append(GroupSpec.chunked_local_attention(int(rng.integers(2, 20))))
        elif kind == 2:
            groups.append(GroupSpec.recurrent(int(rng.integers(1, 3))))
        else:
            groups.append(FULL)
    if all(g.kind == "mamba" for g in groups):
        groups.insert(0, FULL)
    return groups


@pytest.mark.parametrize("seed", range(16))
def test_the_index_predicts_a_real_managers_hit_on_random_streams(seed: int) -> None:
    """Drive a real manager with groups through random prompts sharing prefixes in a pool
    small enough to evict; feed its events to the index; before every new request the
    index's hit for the prompt equals the hit the manager gives that request."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([2, 3, 4]))
    groups = _random_groups(rng)
    tier = int(rng.choice([0, 0, 16]))  # a host tier (offload at eviction) in a third
    m = KVCacheManager(int(rng.integers(24, 60)), bs, groups=groups, host_cache_blocks=tier)
    idx = PrefixIndex()
    told = any(g.kind == "chunked_local_attention" for g in groups) or rng.random() < 0.5
    if told:
        idx.set_group_specs(5, groups, bs)
    hasher = m.block_hasher()
    bases = [rng.integers(1, 50, 60).tolist() for _ in range(3)]
    checked = hits = 0
    for sid in range(80):
        base = bases[int(rng.integers(0, len(bases)))]
        cut = int(rng.integers(1, len(base)))
        prompt = base[:cut] + rng.integers(50, 99, int(rng.integers(0, 8))).tolist()
        m.add_sequence(sid, prompt)
        cap = (len(prompt) - 1) // bs
        hashes = hasher.block_hashes(prompt)[:cap]
        want = m.num_cached_tokens(sid)
        got = idx.overlaps(hashes).get(5, 0) * bs
        # Untold, the index knows a group once it (or a later one) stored a block.
        if told or len(idx.group_rules(5)) == len(groups):
            assert got == want, (sid, groups, bs, got, want)
            checked += 1
        hits += want > 0
        if m.allocate_slots(sid, len(prompt) - want) is not None:
            m.commit(sid, len(prompt) - want, [int(rng.integers(1, 99))])
            for _ in range(int(rng.integers(0, 2 * bs))):
                if m.allocate_slots(sid, 1) is None:
                    break
                m.commit(sid, 1, [int(rng.integers(1, 99))])
        m.free(sid)
        # The engine copies the step's tier blocks before the next one (confirmed).
        m.take_memory_ops()
        m.confirm_memory_ops()
        idx.apply_all(records_from_manager(5, m.take_events()))
    assert checked >= 60 and hits > 0


def test_bad_stored_records_raise_and_change_nothing() -> None:
    idx = _hybrid_index()
    before = (idx.overlaps(H[:10]), idx.group_rules(0), len(idx))
    for bad in (
        BlockStoredRecord(0, (H[20],), None, "GPU", 1, "sliding_window", 0, 4),
        BlockStoredRecord(0, (H[20],), None, "GPU", 1, "sliding_window", 8, -4),
        BlockStoredRecord(0, (H[20],), None, "GPU", 10**9, "full_attention", None, 4),
        BlockStoredRecord(0, (H[20],), None, "GPU", -1, "full_attention", None, 4),
    ):
        with pytest.raises(InvalidArgumentError):
            idx.apply(bad)
    assert (idx.overlaps(H[:10]), idx.group_rules(0), len(idx)) == before
