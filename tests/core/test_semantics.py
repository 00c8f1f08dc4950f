"""The block-manager semantics of the seed (cacheflow/vLLM) and SEMANTICS.md, on both
the Rust manager and the reference model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvblocks
from kvblocks import AllocStatus

from .engine_round import Make, run


def refcount_view(m: Any) -> dict[int, int]:
    """Block id -> number of table entries referencing it (resident sequences)."""
    counts: dict[int, int] = {}
    for sid in m.seq_ids().tolist():
        if not m.is_swapped(sid):
            for b in m.block_table(sid).tolist():
                if b:
                    counts[b] = counts.get(b, 0) + 1
    return counts


# -- fork and copy-on-write --------------------------------------------------------------


def test_fork_shares_every_block_and_bumps_refcounts(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(10)))
    run(m, 1, 10)
    free_before = m.num_free_blocks()
    m.fork(1, 2)
    m.fork(1, 3)
    assert m.num_free_blocks() == free_before  # sharing costs nothing
    tables = m.block_tables([1, 2, 3]).tolist()
    assert tables[0] == tables[1] == tables[2] == [1, 2, 3]
    assert refcount_view(m) == {1: 3, 2: 3, 3: 3}
    m.check_invariants()


def test_appending_to_shared_last_block_yields_exactly_one_cow_pair(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(6)))
    run(m, 1, 6)
    m.fork(1, 2)
    # Fork protocol: each sequence appends its own sampled token, then computes it.
    m.commit(1, 0, [100])
    m.commit(2, 0, [200])
    assert m.allocate_slots(2, 1).tolist() == [3]
    assert m.take_copy_on_writes().tolist() == [[2, 3]]
    # The original holder is now the only user of block 2: no copy for it.
    assert m.allocate_slots(1, 1).tolist() == []
    assert m.take_copy_on_writes().shape == (0, 2)
    assert m.block_table(1).tolist() == [1, 2] and m.block_table(2).tolist() == [1, 3]
    assert m.stats()["cow_copies"] == 1
    # The full shared block 1 is never copied.
    assert refcount_view(m)[1] == 2


def test_cow_not_needed_when_the_shared_block_is_full(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(8)))
    run(m, 1, 8)
    m.fork(1, 2)
    m.commit(2, 0, [5])
    assert m.allocate_slots(2, 1).tolist() == [3]  # a fresh block, not a copy
    assert m.take_copy_on_writes().shape == (0, 2)


def test_beam_search_many_forks_one_copy_each(make: Make) -> None:
    m = make(32, 4)
    m.add_sequence(0, list(range(5)))
    run(m, 0, 5)
    for child in range(1, 4):
        m.fork(0, child)
    for sid in range(4):
        m.commit(sid, 0, [sid])
    assert m.allocate_slots_batch(np.arange(4), 1).num_served == 4
    cows = m.take_copy_on_writes()
    # Three of the four sharers get a private copy of block 2; the last keeps it.
    assert cows.shape == (3, 2) and set(cows[:, 0].tolist()) == {2}
    assert len(set(cows[:, 1].tolist())) == 3
    m.check_invariants()


# -- swap --------------------------------------------------------------------------------


def test_swap_out_then_in_restores_tables_with_sharing_preserved(make: Make) -> None:
    m = make(32, 4, num_cpu_blocks=16)
    m.add_sequence(1, list(range(10)))
    run(m, 1, 10)
    m.fork(1, 2)
    m.commit(2, 0, [9])
    run(m, 2, 1)  # CoW of the last block: tables [1,2,3] and [1,2,4]
    out = m.swap_out([1, 2])
    assert out[:, 0].tolist() == [1, 2, 3, 4]  # first appearance order, shared mapped once
    assert m.num_free_cpu_blocks() == 12
    back = m.swap_in(np.array([2, 1]))
    cpu_to_gpu = dict(back.tolist())
    gpu_to_cpu = dict(out.tolist())
    t1, t2 = m.block_table(1).tolist(), m.block_table(2).tolist()
    assert t1[:2] == t2[:2]  # still shared after the round trip
    assert t1[2] != t2[2]
    # Each restored block holds the data of the block it replaced.
    for old, new in zip([1, 2, 3], t1, strict=True):
        assert cpu_to_gpu[gpu_to_cpu[old]] == new
    assert refcount_view(m)[t1[0]] == 2
    m.check_invariants()


def test_swapped_sequence_rejects_everything_but_swap_in_free_and_reads(make: Make) -> None:
    m = make(16, 4, num_cpu_blocks=8)
    m.add_sequence(1, list(range(5)))
    run(m, 1, 5)
    m.swap_out([1])
    assert m.num_tokens(1) == 5 and m.num_computed_tokens(1) == 5 and m.is_swapped(1)
    m.free(1)
    assert m.num_free_cpu_blocks() == 8 and m.num_free_blocks() == 15


# -- admission ---------------------------------------------------------------------------


def test_prompt_larger_than_pool_minus_watermark_is_never(make: Make) -> None:
    m = make(11, 4, watermark=0.1)  # 10 usable, watermark 1 block
    m.add_sequence(1, list(range(4 * 9)))
    m.add_sequence(2, list(range(4 * 9 + 1)))
    assert m.can_allocate(1) == AllocStatus.OK
    assert m.can_allocate(2) == AllocStatus.NEVER
    # NEVER regardless of what is running: it can never fit.
    m.add_sequence(3, [1, 2])
    run(m, 3, 2)
    assert m.can_allocate(2) == AllocStatus.NEVER
    assert m.can_allocate(1) == AllocStatus.LATER


def test_cached_prefix_in_use_costs_nothing_at_admission(make: Make) -> None:
    m = make(9, 4)  # 8 usable
    m.add_sequence(1, list(range(20)))
    run(m, 1, 20)  # 5 blocks in use
    m.add_sequence(2, [*range(20), 7, 7, 7])
    assert m.num_computed_tokens(2) == 20
    # Needs 6 blocks, 5 of them shared with sequence 1: one new block.
    assert m.can_allocate(2) == AllocStatus.OK
    m.add_sequence(3, list(range(50, 70)))
    assert m.can_allocate(3) == AllocStatus.LATER


# -- prefix caching ----------------------------------------------------------------------


def test_last_prompt_token_is_always_computed(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(8)))
    run(m, 1, 8)
    # An identical, block-aligned prompt: only the first block may hit.
    assert m.add_sequence(2, list(range(8))) == 4
    assert m.allocate_slots(2, 4) is not None
    assert m.slot_mapping([2]).size == 4
    # A prompt of exactly one block never hits.
    m.add_sequence(3, list(range(4)))
    assert m.add_sequence(4, list(range(4))) == 0


def test_prefix_hit_is_claimed_at_first_allocation(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)))
    run(m, 1, 9)
    assert m.add_sequence(2, [*range(9), 1, 2]) == 8
    assert m.num_computed_tokens(2) == 8 and m.num_cached_tokens(2) == 8
    blocks = m.allocate_slots(2, 3)
    assert blocks.tolist() == [4]  # only the new block comes from the free pool
    assert m.block_table(2).tolist() == [1, 2, 4]
    stats = m.stats()
    assert stats["prefix_cache_queries"] == 9 + 11 and stats["prefix_cache_hits"] == 8


def test_claim_shrinks_after_eviction_never_grows(make: Make) -> None:
    m = make(4, 2)  # 3 usable blocks
    m.add_sequence(1, [1, 2, 3])
    run(m, 1, 3)
    assert m.add_sequence(2, [1, 2, 3, 4, 5]) == 2  # [1, 2] cached, [3, 4] not yet
    run(m, 1, 0, [4])
    run(m, 1, 1)  # now [3, 4] is cached too
    assert m.num_computed_tokens(2) == 2  # never more than add_sequence reported
    m.free(1)  # queue: cached tail then head at the back
    m.add_sequence(3, [9] * 6)
    run(m, 3, 6)  # needs every block: evicts both cached blocks
    assert m.num_computed_tokens(2) == 0 and m.num_cached_tokens(2) == 0
    assert m.can_allocate(2) == AllocStatus.LATER


def test_refresh_prefixes_lets_a_waiting_claim_grow_without_claiming(make: Make) -> None:
    m = make(16, 4)
    assert m.add_sequence(2, [*range(9), 1, 2]) == 0  # waits while seq 1 prefills
    assert m.add_sequence(3, list(range(8))) == 0  # whole-prompt hits stay capped
    m.add_sequence(1, list(range(9)))
    run(m, 1, 9)
    assert m.num_computed_tokens(2) == 0  # the add-time cap holds without a refresh
    free_before, stats_before = m.num_free_blocks(), m.stats()
    counts = m.refresh_prefixes(np.array([2, 3, 2]))
    assert counts.dtype == np.int64 and counts.tolist() == [8, 4, 8]
    assert m.num_free_blocks() == free_before and m.stats() == stats_before  # no claim
    assert m.num_computed_tokens(2) == 8 and m.num_cached_tokens(2) == 8
    assert m.probe_prefixes([2, 3]).tolist() == [8, 4]
    assert m.allocate_slots(2, 3).tolist() == [4]  # claims blocks 1 and 2
    assert m.block_table(2).tolist() == [1, 2, 4]
    assert m.refresh_prefixes([]).tolist() == []
    m.check_invariants()


def test_refreshed_cap_still_shrinks_through_eviction(make: Make) -> None:
    m = make(4, 2)  # 3 usable blocks
    m.add_sequence(2, [1, 2, 3, 4, 5])
    m.add_sequence(1, [1, 2, 3, 4, 5])
    run(m, 1, 5)
    m.free(1)
    assert m.refresh_prefixes([2]).tolist() == [4]
    m.add_sequence(3, [9] * 6)
    run(m, 3, 6)  # needs every block: evicts the cached ones
    assert m.num_computed_tokens(2) == 0
    assert m.refresh_prefixes([2]).tolist() == [0]


def test_refresh_prefixes_without_caching_is_zero(make: Make) -> None:
    m = make(16, 4, enable_prefix_caching=False)
    m.add_sequence(1, list(range(9)))
    run(m, 1, 9)
    m.add_sequence(2, list(range(9)))
    assert m.refresh_prefixes([2]).tolist() == [0]


@pytest.mark.parametrize(
    ("salt_a", "lora_a", "salt_b", "lora_b"),
    [
        (b"a", None, b"b", None),
        (None, None, b"", None),
        (b"a", None, b"a", 1),
        (None, None, None, 0),
        (None, 1, None, 2),
    ],
)
def test_salts_and_lora_ids_isolate(
    make: Make, salt_a: Any, lora_a: Any, salt_b: Any, lora_b: Any
) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)), cache_salt=salt_a, lora_id=lora_a)
    run(m, 1, 9)
    assert m.add_sequence(2, list(range(9)), cache_salt=salt_b, lora_id=lora_b) == 0
    assert m.add_sequence(3, list(range(9)), cache_salt=salt_a, lora_id=lora_a) == 8


def test_str_salt_equals_its_utf8_bytes(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)), cache_salt="tenant-é")
    run(m, 1, 9)
    assert m.add_sequence(2, list(range(9)), cache_salt="tenant-é".encode()) == 8


def test_duplicate_content_is_cached_as_another_copy(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(5)))
    m.add_sequence(2, list(range(5)))  # probed before 1 cached anything: no claim
    run(m, 1, 5)
    run(m, 2, 5)  # same content as 1's first block: a second cached copy
    m.add_sequence(3, [7] * 5)
    m.add_sequence(4, [7] * 5)
    assert m.allocate_slots_batch([3, 4], 5).num_served == 2  # neither is cached yet
    m.commit_batch([3, 4], 5)
    events = m.take_events()
    stored = [e for e in events if type(e).__name__.endswith("BlockStored")]
    # Every copy is stored and published, as vLLM's block pool does.
    assert [e.token_ids for e in stored] == [[0, 1, 2, 3]] * 2 + [[7, 7, 7, 7]] * 2
    assert m.stats()["num_cached_blocks"] == 4
    m.add_sequence(5, [7] * 5)
    m.allocate_slots(5, 1)
    assert m.block_table(5).tolist()[0] == m.block_table(3).tolist()[0]
    m.check_invariants()


def test_a_hash_stays_cached_while_any_copy_lives(make: Make) -> None:
    """A prefix computed again is a second copy of its blocks: evicting the first copy must
    not drop the hashes while another sequence holds identical blocks (the cache indexed
    the first copy only, so the hit shrank to the blocks before the evicted one)."""
    m = make(10, 4)
    a = list(range(100, 112))
    b = [*a, 7]
    m.add_sequence(1, a)
    m.add_sequence(2, b)  # probed before 1 committed: no hit
    m.allocate_slots(1, 12)
    m.commit(1, 12, [])
    m.allocate_slots(2, 13)
    m.commit(2, 13, [])
    m.free(1)  # its blocks wait at the back of the free queue, 3 first
    m.add_sequence(3, list(range(500, 520)))
    m.allocate_slots(3, 12)  # the 2 never used, then 1's last block
    assert m.stats()["evictions"] == 1
    # Sequence 2 still holds all three blocks.
    assert m.add_sequence(4, b) == 12
    free = m.num_free_blocks()
    m.allocate_slots(4, 1)
    # The claim shares sequence 2's copies instead of taking 1's free ones from the queue.
    assert m.block_table(4).tolist()[:3] == m.block_table(2).tolist()[:3]
    assert m.num_free_blocks() == free - 1
    m.check_invariants()


def test_the_cached_prefix_keeps_a_hash_a_live_copy_holds() -> None:
    """The defect as reported, through the hash API of the core."""
    m = kvblocks.KVCacheManager(10, 4, watermark=0.0)
    a = list(range(100, 112))
    b = [*a, 7]
    m.add_sequence(1, a)
    m.add_sequence(2, b)
    m.allocate_slots(1, 12)
    m.commit(1, 12, [])
    m.allocate_slots(2, 13)
    m.commit(2, 13, [])
    hashes = m.block_hasher().block_hashes(b)
    assert m.num_cached_prefix_blocks(hashes) == 3
    m.free(1)
    m.add_sequence(3, list(range(500, 520)))
    m.allocate_slots(3, 12)
    assert m.num_cached_prefix_blocks(hashes) == 3


def test_eviction_order_tail_first_and_unhashed_reused_first(make: Make) -> None:
    m = make(8, 2)  # 7 usable blocks
    m.add_sequence(1, [1, 2, 3, 4, 5, 6, 7])  # blocks 1,2,3 cached, 4 partial (unhashed)
    run(m, 1, 7)
    m.free(1)
    gpu, _ = m._debug_free_queues()
    # Unhashed block 4 to the front; cached blocks to the back, last block first.
    assert gpu.tolist() == [4, 5, 6, 7, 3, 2, 1]
    m.add_sequence(2, list(range(100, 112)))  # 6 blocks: takes 4,5,6,7 then evicts 3, 2
    run(m, 2, 12)
    assert m.block_table(2).tolist() == [4, 5, 6, 7, 3, 2]
    assert m.add_sequence(3, [1, 2, 3, 4, 5, 6, 7]) == 2  # the head survived


def test_unhashed_blocks_freed_last_first_go_to_front_in_table_order(make: Make) -> None:
    m = make(8, 4, enable_prefix_caching=False)
    m.add_sequence(1, list(range(12)))
    run(m, 1, 12)
    m.free(1)
    gpu, _ = m._debug_free_queues()
    assert gpu.tolist()[:3] == [1, 2, 3]


# -- sliding window ----------------------------------------------------------------------


def test_sliding_window_releases_blocks_to_the_null_block(make: Make) -> None:
    m = make(16, 4, sliding_window=6)
    m.add_sequence(1, list(range(8)))
    run(m, 1, 8, [0])
    # computed 8: blocks i with (i + 1) * 4 <= 8 - 6 + 1 = 3: none yet.
    assert m.block_table(1).tolist() == [1, 2]
    for _ in range(3):
        run(m, 1, 1, [0])
    # computed 11: (i + 1) * 4 <= 6 -> block 0 released.
    table = m.block_table(1).tolist()
    assert table[0] == m.null_block == 0 and table[1:] == [2, 3]
    assert m.num_free_blocks() == 15 - 2
    # The released block is back in the pool; padding and released entries are block 0.
    assert m.block_tables([1], max_blocks=4).tolist() == [[0, 2, 3, 0]]
    m.check_invariants()
    m.free(1)
    assert m.num_free_blocks() == 15


def test_sliding_window_with_swap_keeps_released_entries_null(make: Make) -> None:
    m = make(16, 2, sliding_window=3, num_cpu_blocks=8)
    m.add_sequence(1, list(range(8)))
    run(m, 1, 8)
    # computed 8: blocks i with (i + 1) * 2 <= 8 - 3 + 1 are released: 0, 1 and 2.
    assert m.block_table(1).tolist()[:3] == [0, 0, 0]
    out = m.swap_out([1])
    assert out.shape == (1, 2)
    m.swap_in([1])
    assert m.block_table(1).tolist()[:3] == [0, 0, 0]
    m.check_invariants()
    m.free(1)
    assert m.num_free_cpu_blocks() == 8 and m.num_free_blocks() == 15


# -- events ------------------------------------------------------------------------------


def test_block_stored_events_chain_parents(make: Make) -> None:
    m = make(16, 2)
    m.add_sequence(1, [1, 2, 3])
    run(m, 1, 3, [4])
    (first,) = m.take_events()
    run(m, 1, 1, [5])
    (second,) = m.take_events()
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == [3, 4]


# -- what a write may touch (issue 7, defects 1 and 2) -----------------------------------


def test_fork_after_lookahead_never_lets_two_sequences_write_one_slot(make: Make) -> None:
    """The issue's repro: spare blocks from lookahead used to stay shared after ``fork``."""
    m = make(16, 4)
    m.add_sequence(1, list(range(12)))
    m.allocate_slots(1, 4, num_lookahead_tokens=8)
    m.commit(1, 4)
    m.fork(1, 2)
    assert m.allocate_slots(1, 8) is not None
    assert m.allocate_slots(2, 8) is not None
    one, two = set(m.slot_mapping([1]).tolist()), set(m.slot_mapping([2]).tolist())
    assert len(one) == len(two) == 8
    assert not one & two
    m.check_invariants()


def test_slot_mapping_covers_only_the_reservation(make: Make) -> None:
    """After ``fork`` + ``commit(child, 0, [t])`` without ``allocate_slots`` the parent and
    the child used to map the same slot of their shared block."""
    m = make(16, 4)
    m.add_sequence(1, list(range(6)))
    run(m, 1, 6, [9])
    m.fork(1, 2)
    m.commit(2, 0, [7])
    for sid in (1, 2):
        with pytest.raises(kvblocks.SequenceStateError):
            m.slot_mapping([sid])
    m.allocate_slots(1, 1, num_lookahead_tokens=2)
    with pytest.raises(kvblocks.SequenceStateError):
        m.slot_mapping([1], [4])  # one token + two lookahead slots reserved
    assert len(m.slot_mapping([1], [3])) == 3
