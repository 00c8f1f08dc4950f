"""The recurrent-state group API from Python: the spec, ``state_mapping``, events, and
the calls a manager with a state group refuses (unchanged after each)."""

from __future__ import annotations

import numpy as np
import pytest

import kvblocks
from kvblocks import GroupSpec, InvalidArgumentError, KVCacheManager


def test_the_spec_names_its_kind_and_interval() -> None:
    r = GroupSpec.recurrent(3)
    assert (r.kind, r.checkpoint_every_blocks, r.window, r.chunk) == ("mamba", 3, None, None)
    assert GroupSpec.full_attention().checkpoint_every_blocks is None
    assert repr(r) == "GroupSpec.recurrent(3)"
    assert r == GroupSpec.recurrent(3) and r != GroupSpec.recurrent(2)
    # A recurrent layer attends to no earlier position: its state summarises them.
    assert r.first_visible(7) == 7
    for bad in (0, -1, 1.5):
        with pytest.raises(InvalidArgumentError):
            GroupSpec.recurrent(bad)  # type: ignore[arg-type]


def _manager(**kwargs: object) -> KVCacheManager:
    groups = [GroupSpec.full_attention(), GroupSpec.recurrent(2)]
    return KVCacheManager(32, 4, watermark=0.0, groups=groups, **kwargs)  # type: ignore[arg-type]


def test_state_mapping_names_the_read_and_every_saved_state() -> None:
    m = _manager()
    m.add_sequence(1, list(range(21)))
    m.add_sequence(2, list(range(100, 103)))
    m.allocate_slots(1, 18)
    m.allocate_slots(2, 3)
    s = m.state_mapping(np.array([1, 2]), group=1)
    assert isinstance(s, kvblocks.StateMapping) and len(s) == 2
    assert s.read_blocks.tolist() == [-1, -1]
    assert s.write_indptr.tolist() == [0, 3, 4]
    # Checkpoints every 2 blocks of 4 tokens: after 8 and 16 tokens, then the step's end.
    assert s.write_positions.tolist() == [8, 16, 18, 3]
    t = m.block_table(1, group=1)
    assert s.write_blocks[:3].tolist() == [t[1], t[3], t[4]]
    assert (m.group_slot_mappings([1, 2], [18, 3])[1] == -1).all()
    m.commit_batch([1, 2], [18, 3])
    s = m.state_mapping([1, 2], group=1)
    # No step pending: nothing to write; the states are where the last steps left them.
    assert s.read_blocks.tolist() == [t[4], m.block_table(2, group=1)[0]]
    assert s.write_indptr.tolist() == [0, 0, 0]
    assert m.group_stats()["num_used_blocks"] == [6, 2]


def test_a_second_prompt_restores_the_cached_state_of_a_checkpoint() -> None:
    m = _manager(record_events=True)
    m.add_sequence(1, list(range(19)))
    m.allocate_slots(1, 19)
    m.commit(1, 19)
    kinds = {(e.group_idx, e.kv_cache_spec_kind) for e in m.take_events()}
    assert kinds == {(0, "full_attention"), (1, "mamba")}
    state_16 = m.state_mapping([1], group=1)  # not pending: only where it reads
    assert state_16.read_blocks[0] != 0
    # Sharing 18 tokens hits 16: the state after 16 tokens is cached, after 18 is not.
    assert m.add_sequence(2, [*range(18), 99]) == 16
    m.allocate_slots(2, 3)
    s = m.state_mapping([2], group=1)
    assert s.read_blocks[0] == m.block_table(2, group=1)[3] != 0
    assert s.write_positions.tolist() == [19]


def test_refused_calls_change_nothing() -> None:
    m = _manager()
    m.add_sequence(1, list(range(10)))
    with pytest.raises(InvalidArgumentError, match="lookahead"):
        m.allocate_slots(1, 4, num_lookahead_tokens=1)
    assert m.num_free_blocks() == 31
    m.allocate_slots(1, 6)
    before = m.block_table(1, group=1).tolist()
    with pytest.raises(InvalidArgumentError, match="recurrent"):
        m.commit(1, 2)
    with pytest.raises(InvalidArgumentError, match="not a recurrent"):
        m.state_mapping([1], group=0)
    with pytest.raises(InvalidArgumentError):
        m.state_mapping([1], group=5)
    with pytest.raises(kvblocks.UnknownSequenceError):
        m.state_mapping([7], group=1)
    assert m.block_table(1, group=1).tolist() == before
    m.commit(1, 6)
    m.check_invariants()


def test_tier_loads_count_the_state_groups_blocks() -> None:
    """A hit served by the host tier loads each group's own blocks: ``num_tier_loads``
    counts the attention blocks and the checkpoint's state block, ``num_tier_tokens``
    the positions (what a scheduler bounding each step's loads must not confuse)."""
    m = _manager(host_cache_blocks=32)
    prompt = list(range(19))
    m.add_sequence(1, prompt)
    m.allocate_slots(1, 19)
    m.commit(1, 19)
    m.free(1)
    # Other prompts push every cached block of the first out of the GPU, into the tier.
    for sid in range(2, 8):
        m.add_sequence(sid, [1000 * sid + t for t in range(16)])
        m.allocate_slots(sid, 16)
        m.commit(sid, 16)
        m.free(sid)
    m.take_memory_ops()
    m.confirm_memory_ops()
    assert m.add_sequence(9, prompt) == 16
    # Four attention blocks and the state after 16 tokens (entry 3): five loads.
    assert (m.num_tier_tokens(9), m.num_tier_loads(9)) == (16, 5)
    m.allocate_slots(9, 3)
    loads = [p for kind, p in m.take_memory_ops() if kind == "load"]
    assert sum(len(p) for p in loads) == 5
    m.check_invariants()


def test_a_step_check_counts_the_states_a_step_writes_not_every_entry() -> None:
    """``can_allocate(num_new_tokens=n)`` counted a recurrent group like full attention
    (a block per table entry of the step), so it said NEVER for steps its
    ``allocate_slots`` takes in an empty pool: here 8 tokens in blocks of 1 write the
    states after 3 and 6 and 8, 3 blocks of the 7 usable, not 8."""
    m = KVCacheManager(8, 1, watermark=0.0, groups=[GroupSpec.recurrent(3)])
    m.add_sequence(1, list(range(13)))
    for n in range(1, 14):
        assert m.can_allocate(1, num_new_tokens=n) == kvblocks.AllocStatus.OK, n
    assert m.allocate_slots(1, 13) is not None
    assert len(m.state_mapping([1], group=0).write_blocks) == 5  # 3, 6, 9, 12 and 13
    # With attention beside it the full group's blocks still count: 5 + 2 of 7.
    m = KVCacheManager(
        8, 1, watermark=0.0, groups=[GroupSpec.full_attention(), GroupSpec.recurrent(3)]
    )
    m.add_sequence(1, list(range(5)))
    assert m.can_allocate(1, num_new_tokens=5) == kvblocks.AllocStatus.OK
    assert m.allocate_slots(1, 5) is not None


def test_a_decode_step_of_a_lone_state_group_maps_no_kv_slot() -> None:
    """The one-table decode calls read each token's slot from the synced row: for a
    manager whose one group is a recurrent state group they gave ``block * block_size +
    offset`` inside the state block, where ``slot_mapping`` (and so every prefill step of
    a scheduler) gives -1: the group keeps no per-token KV."""
    m = KVCacheManager(32, 4, watermark=0.0, groups=[GroupSpec.recurrent(2)])
    for sid in (1, 2):
        m.add_sequence(sid, list(range(10 * sid, 10 * sid + 6)))
        m.allocate_slots(sid, 6)
        m.commit(sid, 6, [7])
    table = np.zeros((2, 8), dtype=np.int32)
    ids = np.array([2, 1])
    for _ in range(5):
        positions = np.array([m.num_tokens(int(s)) - 1 for s in ids])
        served, synced = m.allocate_decode_step(table, ids, [0, 1], positions)
        assert served == 2 and synced is not None
        assert synced[1].tolist() == m.slot_mapping(ids, 1).tolist() == [-1, -1]
        _, slots = m.update_decode_block_table(table, ids, [0, 1], positions)
        assert slots.tolist() == [-1, -1]
        m.commit_batch(ids, 1, np.array([7, 8]))
