"""The prefix index: store / remove / clear events per instance and tier, prefix matching."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.router import (
    AllBlocksClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    CacheAwareRouter,
    PrefixIndex,
    records_from_manager,
)

H = [bytes([i]) * 16 for i in range(8)]  # stand-in hashes: only identity matters here


def test_store_then_overlap_counts_leading_blocks_per_instance() -> None:
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:4])))
    idx.apply(BlockStoredRecord(1, tuple(H[:2])))
    assert idx.overlaps(H[:6]) == {0: 4, 1: 2}
    assert idx.instances(H[1]) == {0, 1}
    assert idx.instances(H[3]) == {0}
    assert idx.num_blocks(0) == 4 and idx.num_blocks(1) == 2
    assert len(idx) == 4


def test_match_stops_at_the_first_missing_block() -> None:
    idx = PrefixIndex()
    # Instance 0 lost block 1 but still holds 2 and 3: its probe would stop at 1.
    idx.apply(BlockStoredRecord(0, (H[0], H[2], H[3])))
    assert idx.overlaps(H[:4]) == {0: 1}
    assert idx.overlaps(H[1:4]) == {}
    # Instance 1 holds block 1 but not block 0: it matches nothing of this prompt.
    idx.apply(BlockStoredRecord(1, (H[1], H[2])))
    assert idx.overlaps(H[:4]) == {0: 1}
    assert idx.credited_overlaps(H[:4], lambda m: 1.0) == {0: 1.0}


def test_remove_affects_only_the_reporting_instance() -> None:
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:3])))
    idx.apply(BlockStoredRecord(1, tuple(H[:3])))
    idx.apply(BlockRemovedRecord(0, (H[2],)))
    assert idx.overlaps(H[:3]) == {0: 2, 1: 3}
    idx.apply(BlockRemovedRecord(1, tuple(H[:3])))
    assert idx.overlaps(H[:3]) == {0: 2}
    assert idx.instances(H[2]) == set()
    assert len(idx) == 2  # emptied hashes are dropped, not kept with no owner


def test_removing_unknown_hashes_is_ignored() -> None:
    idx = PrefixIndex()
    idx.apply(BlockRemovedRecord(3, (H[0],)))
    idx.apply(BlockStoredRecord(0, (H[0],)))
    idx.apply(BlockRemovedRecord(0, (H[5],)))
    idx.apply(BlockRemovedRecord(0, (H[0],), medium="CPU"))  # not held in that tier
    assert idx.overlaps(H[:1]) == {0: 1}


def test_all_blocks_cleared_drops_one_instance_in_every_tier() -> None:
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:3])))
    idx.apply(BlockStoredRecord(0, tuple(H[3:5]), H[2], medium="CPU"))
    idx.apply(BlockStoredRecord(1, tuple(H[:2])))
    idx.apply(AllBlocksClearedRecord(0))
    assert idx.overlaps(H[:5]) == {1: 2}
    assert idx.num_blocks(0) == 0
    assert len(idx) == 2


def test_a_removal_from_one_group_keeps_another_group_s_copy() -> None:
    """vLLM 0.33 events name their KV cache group: a sliding-window group dropping a block
    the full-attention group still holds must not erase it from the index (and the
    window group, a 4-token window over blocks of 4, serves a 3-block hit from its last
    block)."""
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:3]), group_idx=0))
    window = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4}
    idx.apply(BlockStoredRecord(0, tuple(H[:3]), group_idx=1, block_size=4, **window))
    idx.apply(BlockRemovedRecord(0, (H[0], H[1]), group_idx=1))
    assert idx.overlaps(H[:3]) == {0: 3}
    assert idx.num_blocks(0) == 3
    idx.apply(BlockRemovedRecord(0, (H[0],), group_idx=0))
    assert idx.overlaps(H[:3]) == {}
    assert idx.num_blocks(0) == 2
    idx.apply(BlockRemovedRecord(0, (H[2],), group_idx=5))  # a group that never held it
    assert idx.num_blocks(0) == 2


def test_tiers_are_separate_and_any_tier_matches_by_default() -> None:
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:2])))  # GPU
    idx.apply(BlockStoredRecord(0, tuple(H[2:4]), H[1], medium="CPU"))
    assert idx.overlaps(H[:4]) == {0: 4}
    assert idx.overlaps(H[:4], "GPU") == {0: 2}
    assert idx.overlaps(H[:4], "CPU") == {}  # block 0 is not in the CPU tier
    assert idx.num_blocks(0, "CPU") == 2
    credit = {"GPU": 1.0, "CPU": 0.25}
    assert idx.credited_overlaps(H[:4], credit.__getitem__) == {0: 2.5}
    # A block held in two tiers counts its best one.
    idx.apply(BlockStoredRecord(0, (H[2],), H[1]))
    assert idx.credited_overlaps(H[:4], credit.__getitem__) == {0: 3.25}


def test_bad_records_raise_and_change_nothing() -> None:
    idx = PrefixIndex()
    with pytest.raises(TypeError):
        idx.apply(BlockStoredRecord(0, ("not bytes",)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        idx.apply(("stored", 0, H[0]))  # type: ignore[arg-type]
    assert len(idx) == 0 and idx.overlaps(H[:1]) == {}


def test_bad_removals_and_tiers_raise_a_kvblocks_error_and_change_nothing() -> None:
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:3])))
    for bad in (
        # A good hash before a bad one: the good one must not be removed already.
        BlockRemovedRecord(0, (H[0], [1])),  # type: ignore[arg-type]
        BlockRemovedRecord(0, (H[0], 1.5)),  # type: ignore[arg-type]
        BlockRemovedRecord(0, (H[0],), medium=["GPU"]),  # type: ignore[arg-type]
        BlockRemovedRecord(0, (H[0],), group_idx="0"),  # type: ignore[arg-type]
        BlockStoredRecord(0, (H[3],), H[2], medium=["GPU"]),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError):
            idx.apply(bad)
        assert idx.overlaps(H[:4]) == {0: 3} and len(idx) == 3 and idx.num_blocks(0) == 3


def test_an_unhashable_instance_raises_a_kvblocks_error_and_changes_nothing() -> None:
    # Instances are any hashable ids: a list raised a bare TypeError from the dicts.
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:2])))
    for bad in (
        BlockStoredRecord([1], (H[2],), H[1]),  # type: ignore[arg-type]
        BlockRemovedRecord([1], (H[0],)),  # type: ignore[arg-type]
        AllBlocksClearedRecord([1]),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError, match="instance"):
            idx.apply(bad)
    assert idx.overlaps(H[:3]) == {0: 2} and len(idx) == 2


def test_queries_with_unhashable_hashes_raise_a_kvblocks_error() -> None:
    # A bare TypeError (unhashable type: 'list') from the index's dict lookups before.
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:2])))
    router = CacheAwareRouter(2, index=idx)
    for query in (
        lambda: idx.overlaps([H[0], [1]]),
        lambda: idx.credited_overlaps([H[0], [1]], lambda m: 1.0),
        lambda: idx.instances([1]),  # type: ignore[arg-type]
        lambda: router.overlaps([H[0], [1]]),
    ):
        with pytest.raises(InvalidArgumentError):
            query()
    assert idx.overlaps(H[:2]) == {0: 2}


def test_instance_arguments_that_are_unhashable_raise_a_kvblocks_error() -> None:
    # Bare TypeErrors (unhashable type: 'list') from the index's dicts before.
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:2])))
    spec = KVCacheManager(16, 4).groups
    before = idx.group_rules(0)
    for call in (
        lambda: idx.clear_instance([0]),
        lambda: idx.num_blocks([0]),
        lambda: idx.group_rules([0]),
        lambda: idx.set_group_specs([0], spec, 4),
    ):
        with pytest.raises(InvalidArgumentError, match="instance"):
            call()  # type: ignore[no-untyped-call]
    assert idx.overlaps(H[:2]) == {0: 2} and idx.group_rules(0) == before


def test_a_real_managers_events_keep_the_index_equal_to_its_cache() -> None:
    """Store, evict and reset on a real manager; the index follows exactly."""
    bs = 4
    m = KVCacheManager(6, bs)  # 5 usable blocks
    idx = PrefixIndex()
    a = np.arange(12)  # 3 full blocks
    m.add_sequence(1, a)
    m.allocate_slots(1, 12)
    m.commit(1, 12)
    stored = records_from_manager(7, m.take_events())
    assert [type(r) for r in stored] == [BlockStoredRecord]
    hashes = list(stored[0].block_hashes)
    assert len(hashes) == 3 and stored[0].instance == 7
    idx.apply_all(stored)
    assert idx.overlaps(hashes) == {7: 3}
    m.free(1)
    # A new 5-block sequence takes every free block, evicting the cached ones.
    m.add_sequence(2, np.arange(100, 120))
    m.allocate_slots(2, 20)
    removed = records_from_manager(7, m.take_events())
    assert removed and all(isinstance(r, BlockRemovedRecord) for r in removed)
    idx.apply_all(removed)
    assert idx.overlaps(hashes) == {}
    m.commit(2, 20)
    m.free(2)
    idx.apply_all(records_from_manager(7, m.take_events()))
    assert idx.num_blocks(7) == 5
    assert m.reset_prefix_cache()
    cleared = records_from_manager(7, m.take_events())
    assert any(isinstance(r, AllBlocksClearedRecord) for r in cleared)
    idx.apply_all(cleared)
    assert idx.num_blocks(7) == 0 and len(idx) == 0


def test_records_from_manager_rejects_foreign_objects() -> None:
    with pytest.raises(TypeError):
        records_from_manager(0, [object()])  # type: ignore[list-item]


def test_a_removed_copy_keeps_the_group_s_other_copies() -> None:
    """A prefix computed again while its first copy is cached gives a group two blocks of
    one hash, each stored and removed with its own event (vLLM's block pool publishes
    both): evicting one copy must not drop a hash the instance still holds."""
    idx = PrefixIndex()
    idx.apply(BlockStoredRecord(0, tuple(H[:3])))
    idx.apply(BlockStoredRecord(0, tuple(H[:3])))  # the copies
    idx.apply(BlockRemovedRecord(0, (H[2],)))
    assert idx.overlaps(H[:3]) == {0: 3}
    assert idx.num_blocks(0) == 3
    idx.apply(BlockRemovedRecord(0, (H[2],)))
    assert idx.overlaps(H[:3]) == {0: 2}
    idx.apply(BlockRemovedRecord(0, (H[2],)))  # no copy left: ignored
    idx.apply(BlockStoredRecord(0, (H[0],), group_idx=1))
    idx.apply(BlockRemovedRecord(0, (H[0],)))
    idx.apply(BlockRemovedRecord(0, (H[0],)))  # group 0's copies are gone, group 1's stays
    assert idx.instances(H[0]) == {0}
    assert idx.num_blocks(0) == 2
    idx.apply(BlockRemovedRecord(0, (H[0],), group_idx=1))
    assert idx.instances(H[0]) == set()
    assert idx.num_blocks(0) == 1


@pytest.mark.parametrize("value", [None, 3, 2.5, np.array(3)])
def test_what_is_no_sequence_is_refused(value: object) -> None:
    # apply_all and set_group_specs iterated it: a bare TypeError.
    index = PrefixIndex()
    with pytest.raises(InvalidArgumentError, match="records"):
        index.apply_all(value)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="groups"):
        index.set_group_specs(0, value, 4)  # type: ignore[arg-type]
    assert len(index) == 0 and index.group_rules(0) == {}


@pytest.mark.parametrize("medium", [[], np.array(["GPU"]), 2.5])
def test_num_blocks_refuses_a_tier_that_is_no_str(medium: object) -> None:
    # A list or an array was a bare TypeError (unhashable), a float counted 0 blocks.
    index = PrefixIndex()
    index.apply(BlockStoredRecord(0, (H[0],)))
    with pytest.raises(InvalidArgumentError, match="medium"):
        index.num_blocks(0, medium)  # type: ignore[arg-type]
