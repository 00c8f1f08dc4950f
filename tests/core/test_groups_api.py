"""The KV cache group API: specs, per-group and all-group accessors, events, errors, and
the examples of ``docs/hybrid-groups.md`` (which run as written)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvblocks
from kvblocks import GroupSpec, InvalidArgumentError, KVCacheManager

from .core_state import expect_error

DOC = Path(__file__).resolve().parents[2] / "docs" / "hybrid-groups.md"
_DOC_BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("index", range(len(_DOC_BLOCKS)))
def test_doc_example_runs(index: int) -> None:
    exec(compile(_DOC_BLOCKS[index], f"hybrid-groups.md[{index}]", "exec"), {})


def test_specs_name_their_rule() -> None:
    full, w, c = (
        GroupSpec.full_attention(),
        GroupSpec.sliding_window(5),
        GroupSpec.chunked_local_attention(8),
    )
    assert (full.kind, w.kind, c.kind) == (
        "full_attention",
        "sliding_window",
        "chunked_local_attention",
    )
    assert (full.window, w.window, c.window, c.chunk, w.chunk) == (None, 5, None, 8, None)
    assert [w.first_visible(p) for p in (0, 4, 5, 9)] == [0, 0, 1, 5]
    assert [c.first_visible(p) for p in (7, 8, 15, 16)] == [0, 8, 8, 16]
    assert full.first_visible(10**6) == 0
    assert w == GroupSpec.sliding_window(5) and w != GroupSpec.sliding_window(6)
    assert len({w, GroupSpec.sliding_window(5), full}) == 2
    assert repr(c) == "GroupSpec.chunked_local_attention(8)"


@pytest.mark.parametrize(
    "build",
    [
        lambda: GroupSpec.sliding_window(0),
        lambda: GroupSpec.chunked_local_attention(0),
        lambda: GroupSpec.sliding_window(-1),
        lambda: GroupSpec.sliding_window(2.5),
        lambda: KVCacheManager(8, 4, groups=[]),
        lambda: KVCacheManager(8, 4, groups=GroupSpec.full_attention()),
        lambda: KVCacheManager(8, 4, groups=["full"]),
        lambda: KVCacheManager(8, 4, groups=[GroupSpec.full_attention()] * 65),
        lambda: KVCacheManager(8, 4, groups=[GroupSpec.full_attention()], sliding_window=4),
    ],
)
def test_bad_specs_and_group_lists_are_refused(build: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        build()


def _two_groups() -> KVCacheManager:
    m = KVCacheManager(
        32,
        4,
        groups=[GroupSpec.full_attention(), GroupSpec.sliding_window(4)],
        num_cpu_blocks=8,
        watermark=0.0,
    )
    m.add_sequence(1, list(range(10)))
    assert m.allocate_slots(1, 10) is not None
    return m


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.block_table(1, group=2),
        lambda m: m.block_table(1, group=-1),
        lambda m: m.block_tables([1], group=2),
        lambda m: m.slot_mapping([1], group=5),
        lambda m: m.update_block_table(np.zeros((2, 8), np.int32), [1], [0], group=2),
        lambda m: m.block_table_delta([1], [0], max_rows=2, max_blocks=8, group=2),
        lambda m: m.update_group_block_tables(np.zeros((3, 2, 8), np.int32), [1], [0]),
        lambda m: m.update_group_block_tables(np.zeros((2, 8), np.int32), [1], [0]),
        lambda m: m.update_group_block_tables(np.zeros((2, 2, 8), np.int64), [1], [0]),
        lambda m: m.update_group_block_tables(np.zeros((2, 2, 2), np.int32), [1], [0]),
        lambda m: m.update_group_block_tables(np.zeros((2, 2, 8), np.int32)[:, :, ::2], [1], [0]),
        lambda m: m.group_block_table_deltas([1], [4], max_rows=2, max_blocks=8),
    ],
)
def test_bad_group_calls_change_nothing(call: Any) -> None:
    expect_error(_two_groups(), InvalidArgumentError, call)


def test_all_group_accessors_agree_with_the_per_group_ones() -> None:
    m = _two_groups()
    m.add_sequence(2, list(range(50, 57)))
    assert m.allocate_slots(2, 7) is not None
    ids = [1, 2]
    tables = m.group_block_tables(ids)
    slots = m.group_slot_mappings(ids, [10, 7])
    assert tables.shape == (2, 2, 3) and tables.dtype == np.int32
    assert slots.shape == (2, 17) and slots.dtype == np.int64
    for g in range(2):
        np.testing.assert_array_equal(tables[g], m.block_tables(ids, group=g))
        np.testing.assert_array_equal(slots[g], m.slot_mapping(ids, [10, 7], group=g))
    np.testing.assert_array_equal(tables[0], m.block_tables(ids))
    # A group's blocks are its own: no block id appears in both groups' tables.
    assert not set(tables[0].ravel()) & set(tables[1].ravel()) - {0}
    m.commit(1, 10, [3])
    m.commit(2, 7)
    deltas = m.group_block_table_deltas(ids, [0, 1], max_rows=2, max_blocks=4)
    assert len(deltas) == 2 and all(d.reset.all() for d in deltas)
    persistent = np.zeros((2, 2, 4), np.int32)
    written = m.update_group_block_tables(persistent, ids, [0, 1], full=True)
    for g in range(2):
        assert written[g].reset.all()
        np.testing.assert_array_equal(persistent[g, :, :3], m.group_block_tables(ids)[g])
    # Window 4 at 10 computed tokens: the next query sees 7..10, block 0 is released.
    assert m.block_table(1, group=1)[0] == 0 and m.block_table(1)[0] != 0
    assert m.group_stats() == {"num_used_blocks": [5, 3], "num_cached_blocks": [3, 3]}
    m.check_invariants()


def test_events_carry_the_group_and_one_group_says_zero() -> None:
    m = _two_groups()
    m.commit(1, 10)
    stored = [e for e in m.take_events() if isinstance(e, kvblocks.BlockStored)]
    assert [(e.group_idx, len(e.block_hashes)) for e in stored] == [(0, 2), (1, 2)]
    assert stored[0].block_hashes == stored[1].block_hashes
    single = KVCacheManager(8, 4)
    single.add_sequence(1, list(range(5)))
    single.allocate_slots(1, 5)
    single.commit(1, 5)
    assert [e.group_idx for e in single.take_events()] == [0]


def test_host_tier_slots_say_their_group() -> None:
    m = KVCacheManager(
        9,
        2,
        groups=[GroupSpec.full_attention(), GroupSpec.sliding_window(3)],
        host_cache_blocks=8,
        watermark=0.0,
    )
    m.add_sequence(1, list(range(4)))
    m.allocate_slots(1, 4)
    m.commit(1, 4)
    m.free(1)
    # 4 blocks per group take the whole pool: every cached block is offloaded.
    m.add_sequence(2, list(range(100, 108)))
    assert m.allocate_slots(2, 8) is not None
    ops = dict(m.take_memory_ops())
    slots = ops["offload"][:, 1]
    assert sorted(g for g in m.tier_slot_groups(slots) if g is not None) == [0, 0, 1, 1]
    assert m.tier_slot_groups([99]) == [None]
    with pytest.raises(InvalidArgumentError):
        m.import_tier_blocks([b"\0" * 32], group=2)
