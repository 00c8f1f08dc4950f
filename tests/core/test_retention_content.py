"""Retention priorities in the host tier, judged by what the emulated KV memory holds: a
high-priority prefix survives a flood of low-priority prompts in the tier and loads back
with its own KV; with equal priorities the same flood pushes it out (LRU)."""

from __future__ import annotations

import pytest

import kvblocks
from kvblocks import KVCacheManager
from oracle.kv_memory import KVMemory, PrefixIds

BLOCK = 4
GPU_BLOCKS = 9  # 8 usable: one flood prompt fills the pool
TIER = 8


class Engine:
    """A manager with a host tier and an emulated KV memory, driven one prompt at a time
    like an engine: ops applied before the step's writes, tier copies confirmed after."""

    def __init__(self, offload: str) -> None:
        self.m = KVCacheManager(
            GPU_BLOCKS, BLOCK, watermark=0.0, host_cache_blocks=TIER, host_offload=offload
        )
        self.mem = KVMemory(GPU_BLOCKS, 0, BLOCK, TIER)
        self.ids = PrefixIds()
        self.next_id = 0

    def run(self, tokens: list[int], priority: int | None) -> tuple[int, int]:
        """Prefill ``tokens`` at ``priority``, check every position's KV, free it;
        return the cached tokens the claim found and how many of them were loaded."""
        m, sid = self.m, self.next_id
        self.next_id += 1
        m.add_sequence(sid, tokens, retention_priority=priority)
        cached = m.num_computed_tokens(sid)
        new = len(tokens) - cached
        assert m.allocate_slots(sid, new) is not None
        loaded = m.num_tier_tokens(sid)
        self.mem.apply_memory_ops(m.take_memory_ops())
        expected = self.ids.ids(tokens)
        table = m.block_table(sid)
        # The claimed prefix, loads included, already holds this prompt's KV.
        self.mem.check(sid, table, expected, cached)
        self.mem.write_step([(sid, m.slot_mapping([sid], [new]), expected[cached:])])
        self.mem.check(sid, table, expected, len(tokens))
        m.commit(sid, new)
        self.mem.apply_memory_ops(m.take_memory_ops())  # write-through offloads
        m.free(sid)
        self.mem.confirm()
        m.confirm_memory_ops()
        m.check_invariants()
        return cached, loaded


def flood(engine: Engine, priority: int | None) -> None:
    for r in range(6):
        engine.run([100 + 37 * r + i for i in range(8 * BLOCK)], priority)


PREFIX = list(range(1, 3 * BLOCK + 1))  # three full blocks


@pytest.mark.parametrize("offload", ["evict", "commit"])
def test_a_high_priority_prefix_survives_a_low_priority_flood(offload: str) -> None:
    engine = Engine(offload)
    engine.run([*PREFIX, 99], 90)
    flood(engine, 10)
    assert engine.m.stats()["host_evictions"] > 0, "the flood evicted nothing from the tier"
    # A new prompt on the prefix: its three blocks come back from the tier, with their KV.
    assert engine.run([*PREFIX, 98, 97], 10) == (3 * BLOCK, 3 * BLOCK)


@pytest.mark.parametrize("offload", ["evict", "commit"])
def test_with_equal_priorities_the_flood_pushes_the_prefix_out(offload: str) -> None:
    engine = Engine(offload)
    engine.run([*PREFIX, 99], None)
    flood(engine, None)
    assert engine.run([*PREFIX, 98, 97], None) == (0, 0)


def test_set_retention_priority_rejects_bad_values_and_changes_nothing() -> None:
    m = KVCacheManager(8, BLOCK, host_cache_blocks=4)
    with pytest.raises(kvblocks.InvalidArgumentError, match=r"\[0, 100\]"):
        m.add_sequence(1, [1, 2, 3], retention_priority=101)
    assert 1 not in m
    m.add_sequence(1, [1, 2, 3], retention_priority=70)
    assert m.retention_priority(1) == 70
    for bad in (-1, 101, 2**70, True, 3.0, "5"):
        with pytest.raises(kvblocks.InvalidArgumentError):
            m.set_retention_priority(1, bad)  # type: ignore[arg-type]
        assert m.retention_priority(1) == 70
    with pytest.raises(kvblocks.UnknownSequenceError):
        m.set_retention_priority(9, 1)
    m.set_retention_priority(1, 0)
    assert m.retention_priority(1) == 0
    m.check_invariants()


class GpuEngine(Engine):
    """The same driver over a manager without a host tier: only the GPU prefix cache."""

    def __init__(self) -> None:
        self.m = KVCacheManager(GPU_BLOCKS, BLOCK, watermark=0.0)
        self.mem = KVMemory(GPU_BLOCKS, 0, BLOCK)
        self.ids = PrefixIds()
        self.next_id = 0


def small_flood(engine: Engine, priority: int | None) -> None:
    # Five blocks each: room for them beside a three-block prefix in the 8-block pool.
    for r in range(4):
        engine.run([300 + 41 * r + i for i in range(5 * BLOCK)], priority)


def test_the_gpu_cache_evicts_lower_priorities_first() -> None:
    engine = GpuEngine()
    engine.run([*PREFIX, 99], 90)
    small_flood(engine, 10)
    assert engine.m.stats()["evictions"] > 0
    # Hit in the GPU cache itself (no tier): the three blocks were never evicted.
    assert engine.run([*PREFIX, 98, 97], 10) == (3 * BLOCK, 0)


def test_with_equal_priorities_the_gpu_cache_is_lru() -> None:
    engine = GpuEngine()
    engine.run([*PREFIX, 99], None)
    small_flood(engine, None)
    assert engine.run([*PREFIX, 98, 97], None) == (0, 0)
