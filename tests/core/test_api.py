"""Every method of the manager API, on the Rust manager and on the reference model."""

from __future__ import annotations

import numpy as np
import pytest

import kvblocks
from kvblocks import AllocStatus

from .engine_round import Make, run


def test_configuration_properties(make: Make) -> None:
    m = make(
        16,
        8,
        num_cpu_blocks=4,
        enable_prefix_caching=False,
        hash_algo="xxh3_128",
        watermark=0.25,
        sliding_window=32,
    )
    assert (m.num_blocks, m.block_size, m.num_cpu_blocks) == (16, 8, 4)
    assert m.enable_prefix_caching is False
    assert m.hash_algo == "xxh3_128"
    assert m.watermark == 0.25
    assert m.sliding_window == 32
    assert m.null_block == 0


def test_defaults() -> None:
    m = kvblocks.KVCacheManager(8, 16)
    assert m.num_cpu_blocks == 0
    assert m.enable_prefix_caching is True
    assert m.hash_algo == "blake3"
    assert m.watermark == 0.01
    assert m.sliding_window is None
    assert m.record_events is True
    assert "KVCacheManager(" in repr(m)


def test_fresh_pool_reserves_the_null_block(make: Make) -> None:
    m = make(10, 4, num_cpu_blocks=3)
    assert m.num_free_blocks() == 9
    assert m.num_free_cpu_blocks() == 3
    assert m.usage() == 0.0
    assert len(m) == 0
    assert m.seq_ids().dtype == np.int64 and m.seq_ids().size == 0
    gpu, cpu = m._debug_free_queues()
    assert gpu.tolist() == list(range(1, 10))
    assert cpu.tolist() == [0, 1, 2]


def test_add_sequence_and_queries(make: Make) -> None:
    m = make(16, 4)
    assert m.add_sequence(7, [1, 2, 3, 4, 5]) == 0
    assert m.add_sequence(3, np.array([9, 9], dtype=np.uint16)) == 0
    assert len(m) == 2 and 7 in m and 3 in m and 4 not in m and -1 not in m and "x" not in m
    assert 7 in m and 8 not in m
    assert m.seq_ids().tolist() == [3, 7]
    assert m.num_tokens(7) == 5
    assert m.num_computed_tokens(7) == 0
    assert m.num_cached_tokens(7) == 0
    tokens = m.token_ids(7)
    assert tokens.dtype == np.uint32 and tokens.tolist() == [1, 2, 3, 4, 5]
    assert m.is_swapped(7) is False
    assert m.probe_prefixes(np.array([7, 3])).tolist() == [0, 0]
    assert m.probe_prefixes([]).dtype == np.int64


def test_allocate_commit_block_table_and_slots(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(6)))
    blocks = m.allocate_slots(1, 6)
    assert blocks.dtype == np.int32 and blocks.tolist() == [1, 2]
    slots = m.slot_mapping([1])
    assert slots.dtype == np.int64 and slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert m.slot_mapping([1], [2]).tolist() == [4, 5]
    m.commit(1, 6, [42])
    assert m.num_computed_tokens(1) == 6 and m.num_tokens(1) == 7
    assert m.token_ids(1).tolist()[-1] == 42
    # Decode: the new token lands in the existing second block.
    assert m.allocate_slots(1, 1).tolist() == []
    assert m.slot_mapping([1]).tolist() == [10]
    m.commit(1, 1, [43])
    table = m.block_table(1)
    assert table.dtype == np.int32 and table.tolist() == [1, 2]
    assert m.usage() == pytest.approx(2 / 15)


def test_lookahead_reserves_extra_blocks(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, [1, 2, 3])
    assert m.allocate_slots(1, 3, num_lookahead_tokens=2).tolist() == [1, 2]
    # Slots past the known tokens can be mapped for draft tokens.
    assert m.slot_mapping([1], [5]).tolist() == [4, 5, 6, 7, 8]


def test_block_tables_padding_and_max_blocks(make: Make) -> None:
    m = make(16, 2)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.add_sequence(2, [1])
    m.allocate_slots_batch([1, 2], [5, 1])
    tables = m.block_tables(np.array([2, 1], dtype=np.int64))
    assert tables.dtype == np.int32 and tables.shape == (2, 3)
    assert tables.tolist() == [[4, 0, 0], [1, 2, 3]]
    assert m.block_tables([1], max_blocks=5).tolist() == [[1, 2, 3, 0, 0]]
    assert m.block_tables([]).shape == (0, 0)


def test_batch_calls(make: Make) -> None:
    m = make(16, 4)
    for sid in range(3):
        m.add_sequence(sid, [sid] * 5)
    assert m.allocate_slots_batch(np.arange(3), 5).num_served == 3
    m.commit_batch(np.arange(3), np.array([5, 5, 5]), np.array([7, -1, 8]))
    assert [m.num_tokens(s) for s in range(3)] == [6, 5, 6]
    assert [m.num_computed_tokens(s) for s in range(3)] == [5, 5, 5]
    assert m.allocate_slots_batch([0, 2], 1).num_served == 2
    m.commit_batch([0, 2], 1)
    assert [m.num_computed_tokens(s) for s in range(3)] == [6, 5, 6]


def test_allocate_batch_stops_at_first_unserved(make: Make) -> None:
    m = make(5, 4)  # 4 usable blocks
    for sid in range(3):
        m.add_sequence(sid, list(range(6)))  # 2 blocks each
    assert m.allocate_slots_batch([0, 1, 2], 6).num_served == 2
    assert m.num_free_blocks() == 0
    assert m.num_computed_tokens(2) == 0
    assert m.block_tables([0, 1]).tolist() == [[1, 2], [3, 4]]


def test_allocate_returns_none_when_short(make: Make) -> None:
    m = make(3, 4)
    m.add_sequence(1, list(range(12)))
    assert m.allocate_slots(1, 12) is None
    assert m.num_free_blocks() == 2 and m.block_table(1).size == 0


def test_fork_take_copy_on_writes_free(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(6)))
    run(m, 1, 6)
    m.fork(1, 2)
    assert m.block_table(2).tolist() == m.block_table(1).tolist() == [1, 2]
    assert m.num_tokens(2) == 6 and m.num_computed_tokens(2) == 6
    m.commit(1, 0, [100])
    m.commit(2, 0, [200])
    assert m.allocate_slots(2, 1).tolist() == [3]
    cow = m.take_copy_on_writes()
    assert cow.dtype == np.int64 and cow.tolist() == [[2, 3]]
    assert m.take_copy_on_writes().shape == (0, 2)
    m.free(2)
    m.free(1)
    assert len(m) == 0 and m.num_free_blocks() == 15


def test_swap_out_in_roundtrip(make: Make) -> None:
    m = make(16, 4, num_cpu_blocks=8)
    m.add_sequence(1, list(range(6)))
    run(m, 1, 6)
    assert m.can_swap_out([1]) is True
    out = m.swap_out([1])
    assert out.dtype == np.int64 and out.tolist() == [[1, 0], [2, 1]]
    assert m.is_swapped(1) and m.num_free_cpu_blocks() == 6
    assert m.can_swap_in([1]) is True
    back = m.swap_in([1])
    assert back[:, 0].tolist() == [0, 1]
    assert m.block_table(1).tolist() == back[:, 1].tolist()
    assert not m.is_swapped(1) and m.num_free_cpu_blocks() == 8
    stats = m.stats()
    assert stats["blocks_swapped_out"] == 2 and stats["blocks_swapped_in"] == 2


def test_can_allocate_statuses(make: Make) -> None:
    m = make(11, 4, watermark=0.2)  # 10 usable, watermark 2 blocks
    m.add_sequence(1, list(range(32)))  # 8 blocks: fits 10 - 2
    m.add_sequence(2, list(range(33)))  # 9 blocks: never
    assert m.can_allocate(1) == AllocStatus.OK
    assert m.can_allocate(1, num_lookahead_tokens=1) == AllocStatus.NEVER
    assert m.can_allocate(2) == AllocStatus.NEVER
    m.add_sequence(3, [1])
    run(m, 3, 1)
    assert m.can_allocate(1) == AllocStatus.LATER
    m.free(3)
    assert m.can_allocate(1) == AllocStatus.OK


def test_alloc_status_enum() -> None:
    assert AllocStatus.OK != AllocStatus.LATER
    assert [int(s) for s in (AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER)] == [0, 1, 2]
    assert len({AllocStatus.OK, AllocStatus.OK, AllocStatus.NEVER}) == 2
    assert AllocStatus.OK == 0


def test_events_and_reset_prefix_cache(make: Make) -> None:
    m = make(8, 2)
    m.add_sequence(1, [1, 2, 3, 4, 5], lora_id=3)
    run(m, 1, 5)
    (stored,) = m.take_events()
    assert type(stored).__name__.endswith("BlockStored")
    assert len(stored.block_hashes) == 2 and all(isinstance(h, bytes) for h in stored.block_hashes)
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2 and stored.lora_id == 3
    assert m.take_events() == []
    assert m.reset_prefix_cache() is False  # blocks in use
    m.free(1)
    assert m.reset_prefix_cache() is True
    (cleared,) = m.take_events()
    assert type(cleared).__name__.endswith("AllBlocksCleared")
    m.add_sequence(2, [1, 2, 3, 4, 5])
    assert m.num_computed_tokens(2) == 0  # nothing cached any more


def test_block_removed_event_on_eviction(make: Make) -> None:
    m = make(3, 2)  # 2 usable blocks
    m.add_sequence(1, [1, 2, 3, 4])
    run(m, 1, 4)
    stored_hashes = m.take_events()[0].block_hashes
    m.free(1)
    m.add_sequence(2, [9, 9, 9])
    run(m, 2, 3)
    events = m.take_events()
    removed = [e for e in events if type(e).__name__.endswith("BlockRemoved")]
    # Tail first: the last block of the freed prompt is evicted before its head.
    assert [e.block_hashes for e in removed] == [[stored_hashes[1]], [stored_hashes[0]]]
    assert m.stats()["evictions"] == 2


def test_record_events_off_keeps_caching_but_queues_nothing(make: Make) -> None:
    m = make(8, 2, record_events=False)
    assert m.record_events is False
    m.add_sequence(1, [1, 2, 3, 4, 5])
    run(m, 1, 5)
    m.free(1)
    assert m.add_sequence(2, [1, 2, 3, 4, 5]) == 4  # the cache still works
    m.free(2)
    m.add_sequence(3, list(range(50, 64)))
    run(m, 3, 14)  # evicts the cached blocks
    assert m.stats()["evictions"] == 2
    assert m.reset_prefix_cache() is False
    m.free(3)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == []


def test_no_events_without_caching(make: Make) -> None:
    m = make(8, 2, enable_prefix_caching=False)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    run(m, 1, 5)
    m.free(1)
    assert m.take_events() == []
    assert m.add_sequence(2, [1, 2, 3, 4, 5]) == 0
    assert m.reset_prefix_cache() is True
    assert m.take_events() == []


def test_stats_keys_and_values(make: Make) -> None:
    m = make(9, 2, num_cpu_blocks=2)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    run(m, 1, 5)
    assert m.add_sequence(2, [1, 2, 3, 4, 5]) == 4
    run(m, 2, 1)
    stats = m.stats()
    assert stats == {
        "num_blocks": 9,
        "num_free_blocks": 4,
        "num_used_blocks": 4,
        "usage": pytest.approx(4 / 8),
        "num_cpu_blocks": 2,
        "num_free_cpu_blocks": 2,
        "num_sequences": 2,
        "num_swapped_sequences": 0,
        "num_cached_blocks": 2,
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 4,
        "prefix_cache_hit_rate": pytest.approx(0.4),
        "evictions": 0,
        "cow_copies": 0,
        "blocks_swapped_out": 0,
        "blocks_swapped_in": 0,
    }


def test_check_invariants_passes_on_busy_manager(make: Make) -> None:
    m = make(32, 4, num_cpu_blocks=8, sliding_window=8)
    for sid in range(4):
        m.add_sequence(sid, list(range(sid, sid + 10)))
        run(m, sid, 10, [1])
    m.fork(0, 10)
    m.swap_out([1])
    for _ in range(6):
        for sid in (0, 2, 3, 10):
            run(m, sid, 1, [5])
    m.check_invariants()


def test_version() -> None:
    assert isinstance(kvblocks.__version__, str) and kvblocks.__version__.count(".") == 2
