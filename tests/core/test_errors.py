"""Every error path: the right ``KVBlocksError`` subclass, a useful message, and the
manager exactly as it was (tables, counts, stats, free-queue order, no new events)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvblocks import (
    DuplicateSequenceError,
    InvalidArgumentError,
    KVBlocksError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
)

from .core_state import expect_error
from .engine_round import Make

# Sequence ids of the busy fixture.
RUNNING, PENDING, SWAPPED, PARENT, CHILD, WAITING, UNKNOWN = 1, 2, 3, 4, 5, 6, 99


@pytest.fixture
def busy(make: Make) -> Any:
    """A manager with cached blocks and sequences in every state.

    1: running, committed; 2: allocated but not committed; 3: swapped out;
    4 and 5: a forked pair; 6: added, not yet allocated. A freed prompt leaves cached
    blocks in the free queue so that its order matters.
    """
    m = make(24, 4, num_cpu_blocks=4, watermark=0.0)
    m.add_sequence(10, list(range(100, 112)))
    m.allocate_slots(10, 12)
    m.commit(10, 12, [1])
    m.free(10)
    for sid in (RUNNING, PENDING, SWAPPED, PARENT):
        m.add_sequence(sid, list(range(sid * 10, sid * 10 + 6)))
        m.allocate_slots(sid, 6)
        m.commit(sid, 6, [7])
    m.allocate_slots(PENDING, 1)
    m.swap_out([SWAPPED])
    m.fork(PARENT, CHILD)
    m.add_sequence(WAITING, list(range(100, 109)))
    m.check_invariants()
    return m


# -- constructor -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, 4), {}),
        ((-5, 4), {}),
        ((8, 0), {}),
        ((8, -1), {}),
        ((8, 4), {"num_cpu_blocks": -1}),
        ((8, 4), {"watermark": 1.0}),
        ((8, 4), {"watermark": -0.1}),
        ((8, 4), {"watermark": float("nan")}),
        ((8, 4), {"hash_algo": "sha1"}),
        ((8, 4), {"sliding_window": 0}),
        ((2**26 + 1, 4), {}),
        ((8, 2**20 + 1), {}),
        ((8, 4), {"num_cpu_blocks": 2**26 + 1}),
        (("8", 4), {}),
        ((8.0, 4), {}),
        ((True, 4), {}),
        ((8, 4), {"enable_prefix_caching": 1}),
        ((8, 4), {"record_events": "yes"}),
        ((8, 4), {"hash_algo": 3}),
        ((8, 4), {"watermark": "0.1"}),
        ((8, 4), {"watermark": True}),
        ((8, 4), {"sliding_window": -4}),
    ],
)
def test_constructor_rejects_bad_config(make: Make, args: tuple, kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        make(*args, **kwargs)


def test_constructor_message_says_what_was_expected(make: Make) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        make(1, 4)
    with pytest.raises(ValueError, match="hash_algo"):  # InvalidArgumentError is a ValueError
        make(8, 4, hash_algo="md5")


# -- sequences ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (DuplicateSequenceError, lambda m: m.add_sequence(RUNNING, [1, 2])),
        (DuplicateSequenceError, lambda m: m.add_sequence(SWAPPED, [1, 2])),
        (InvalidArgumentError, lambda m: m.add_sequence(50, [1, -1])),
        (InvalidArgumentError, lambda m: m.add_sequence(50, [1, 2**32])),
        (InvalidArgumentError, lambda m: m.add_sequence(50, np.array([[1, 2]]))),
        (InvalidArgumentError, lambda m: m.add_sequence(50, np.array([1.5, 2.0]))),
        (InvalidArgumentError, lambda m: m.add_sequence(50, "abc")),
        (InvalidArgumentError, lambda m: m.add_sequence(50, 5)),
        (InvalidArgumentError, lambda m: m.add_sequence(50, [1, 2], cache_salt=5)),
        (InvalidArgumentError, lambda m: m.add_sequence(50, [1, 2], lora_id=-1)),
        (InvalidArgumentError, lambda m: m.add_sequence(-1, [1, 2])),
        (InvalidArgumentError, lambda m: m.add_sequence(2**63, [1, 2])),
        (InvalidArgumentError, lambda m: m.add_sequence(True, [1, 2])),
        (UnknownSequenceError, lambda m: m.num_tokens(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.num_computed_tokens(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.num_cached_tokens(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.token_ids(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.is_swapped(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.probe_prefixes([RUNNING, UNKNOWN])),
        (UnknownSequenceError, lambda m: m.refresh_prefixes([WAITING, UNKNOWN])),
        (SequenceStateError, lambda m: m.refresh_prefixes([WAITING, RUNNING])),
        (SequenceStateError, lambda m: m.refresh_prefixes([WAITING, PENDING])),
        (SequenceStateError, lambda m: m.refresh_prefixes([WAITING, SWAPPED])),
        (InvalidArgumentError, lambda m: m.refresh_prefixes([WAITING, -1])),
        (InvalidArgumentError, lambda m: m.refresh_prefixes(WAITING)),
        (UnknownSequenceError, lambda m: m.free(UNKNOWN)),
        (UnknownSequenceError, lambda m: m.fork(UNKNOWN, 50)),
        (DuplicateSequenceError, lambda m: m.fork(RUNNING, WAITING)),
        (DuplicateSequenceError, lambda m: m.fork(RUNNING, RUNNING)),
        (SequenceStateError, lambda m: m.fork(SWAPPED, 50)),
        (SequenceStateError, lambda m: m.fork(PENDING, 50)),
    ],
)
def test_sequence_errors(busy: Any, error: type[KVBlocksError], call: Any) -> None:
    expect_error(busy, error, call)


# -- allocation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (UnknownSequenceError, lambda m: m.can_allocate(UNKNOWN)),
        (SequenceStateError, lambda m: m.can_allocate(SWAPPED)),
        (SequenceStateError, lambda m: m.can_allocate(RUNNING)),
        (InvalidArgumentError, lambda m: m.can_allocate(WAITING, num_lookahead_tokens=-1)),
        (UnknownSequenceError, lambda m: m.allocate_slots(UNKNOWN, 1)),
        (SequenceStateError, lambda m: m.allocate_slots(SWAPPED, 1)),
        (InvalidArgumentError, lambda m: m.allocate_slots(RUNNING, 2)),  # 1 uncomputed token
        (InvalidArgumentError, lambda m: m.allocate_slots(WAITING, 100)),
        (InvalidArgumentError, lambda m: m.allocate_slots(RUNNING, -1)),
        (InvalidArgumentError, lambda m: m.allocate_slots(RUNNING, 1, num_lookahead_tokens=-2)),
        (UnknownSequenceError, lambda m: m.allocate_slots_batch([RUNNING, UNKNOWN], 1)),
        (InvalidArgumentError, lambda m: m.allocate_slots_batch([RUNNING, RUNNING], 1)),
        (InvalidArgumentError, lambda m: m.allocate_slots_batch([RUNNING, CHILD], [1])),
        (InvalidArgumentError, lambda m: m.allocate_slots_batch([RUNNING, CHILD], [1, 5])),
        (InvalidArgumentError, lambda m: m.allocate_slots_batch([RUNNING, CHILD], [1, -1])),
        (InvalidArgumentError, lambda m: m.allocate_slots_batch(np.array([[RUNNING]]), 1)),
        (SequenceStateError, lambda m: m.allocate_slots_batch([RUNNING, SWAPPED], 1)),
    ],
)
def test_allocation_errors(busy: Any, error: type[KVBlocksError], call: Any) -> None:
    expect_error(busy, error, call)


def test_refresh_error_leaves_a_growable_cap_unchanged(make: Make) -> None:
    m = make(16, 4)
    m.add_sequence(2, list(range(9)))
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 9)
    m.commit(1, 9)
    # seq 2 would grow from 0 to 8 tokens, but a later id is bad: nothing changes
    expect_error(m, UnknownSequenceError, lambda m: m.refresh_prefixes([2, UNKNOWN]))
    expect_error(m, SequenceStateError, lambda m: m.refresh_prefixes([2, 1]))
    assert m.num_computed_tokens(2) == 0


def test_allocate_none_leaves_state_unchanged(busy: Any) -> None:
    """A pool too short for a prefix claim + growth returns None and changes nothing."""
    from .core_state import assert_no_side_effects, drain, snapshot

    busy.add_sequence(60, list(range(100, 108)) + list(range(200)))  # hits 2 cached blocks
    drain(busy)
    before = snapshot(busy)
    assert busy.allocate_slots(60, busy.num_tokens(60) - busy.num_computed_tokens(60)) is None
    assert_no_side_effects(busy, before)
    assert busy.allocate_slots_batch([60], 200).num_served == 0
    assert_no_side_effects(busy, before)


# -- commit ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (UnknownSequenceError, lambda m: m.commit(UNKNOWN, 0)),
        (SequenceStateError, lambda m: m.commit(SWAPPED, 0, [1])),
        (InvalidArgumentError, lambda m: m.commit(RUNNING, 1)),  # nothing reserved
        (InvalidArgumentError, lambda m: m.commit(PENDING, 2)),  # 1 slot reserved
        (InvalidArgumentError, lambda m: m.commit(WAITING, 1)),
        (InvalidArgumentError, lambda m: m.commit(PENDING, -1)),
        (InvalidArgumentError, lambda m: m.commit(PENDING, 1, [2**32])),
        (InvalidArgumentError, lambda m: m.commit_batch([PENDING, RUNNING], [1, 1])),
        (InvalidArgumentError, lambda m: m.commit_batch([PENDING, PENDING], 1)),
        (InvalidArgumentError, lambda m: m.commit_batch([PENDING], [1, 1])),
        (InvalidArgumentError, lambda m: m.commit_batch([PENDING], 1, [1, 2])),
        (InvalidArgumentError, lambda m: m.commit_batch([PENDING], 1, [2**32])),
        (UnknownSequenceError, lambda m: m.commit_batch([PENDING, UNKNOWN], 0)),
        (SequenceStateError, lambda m: m.commit_batch([PENDING, SWAPPED], 0)),
    ],
)
def test_commit_errors(busy: Any, error: type[KVBlocksError], call: Any) -> None:
    expect_error(busy, error, call)


# -- swap --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (UnknownSequenceError, lambda m: m.swap_out([UNKNOWN])),
        (SequenceStateError, lambda m: m.swap_out([SWAPPED])),
        (SequenceStateError, lambda m: m.swap_out([RUNNING, PENDING])),
        (InvalidArgumentError, lambda m: m.swap_out([RUNNING, RUNNING])),
        (OutOfBlocksError, lambda m: m.swap_out([RUNNING, PARENT])),  # 4 blocks, 2 CPU free
        (UnknownSequenceError, lambda m: m.can_swap_out([UNKNOWN])),
        (SequenceStateError, lambda m: m.can_swap_out([PENDING])),
        (SequenceStateError, lambda m: m.swap_in([RUNNING])),
        (UnknownSequenceError, lambda m: m.swap_in([UNKNOWN])),
        (InvalidArgumentError, lambda m: m.swap_in([SWAPPED, SWAPPED])),
        (SequenceStateError, lambda m: m.can_swap_in([RUNNING])),
    ],
)
def test_swap_errors(busy: Any, error: type[KVBlocksError], call: Any) -> None:
    expect_error(busy, error, call)


def test_swap_in_out_of_gpu_blocks(make: Make) -> None:
    m = make(4, 2, num_cpu_blocks=4)  # 3 usable GPU blocks
    m.add_sequence(1, [1, 2, 3])
    m.allocate_slots(1, 3)
    m.commit(1, 3)
    m.swap_out([1])
    m.add_sequence(2, [7, 7, 7, 7, 7])
    assert m.allocate_slots(2, 5) is not None
    assert m.can_swap_in([1]) is False
    msg = expect_error(m, OutOfBlocksError, lambda m: m.swap_in([1]))
    assert "needs 2" in msg and "0 are free" in msg


def test_can_swap_out_reports_short_cpu_pool_without_raising(busy: Any) -> None:
    assert busy.can_swap_out([RUNNING, PARENT]) is False
    assert busy.can_swap_out([RUNNING]) is True


# -- step inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (UnknownSequenceError, lambda m: m.block_table(UNKNOWN)),
        (SequenceStateError, lambda m: m.block_table(SWAPPED)),
        (UnknownSequenceError, lambda m: m.block_tables([RUNNING, UNKNOWN])),
        (SequenceStateError, lambda m: m.block_tables([SWAPPED])),
        (InvalidArgumentError, lambda m: m.block_tables([RUNNING], max_blocks=1)),
        (InvalidArgumentError, lambda m: m.block_tables([RUNNING], max_blocks=-1)),
        (InvalidArgumentError, lambda m: m.block_tables(np.zeros((2, 2), dtype=np.int64))),
        # Only the pending reservation can be mapped (none for RUNNING: it committed).
        (SequenceStateError, lambda m: m.slot_mapping([RUNNING], [3])),
        (SequenceStateError, lambda m: m.slot_mapping([RUNNING], [1])),
        (SequenceStateError, lambda m: m.slot_mapping([PENDING], [9])),
        # max_blocks beyond num_blocks: no table can be that wide (2**61 used to panic).
        (InvalidArgumentError, lambda m: m.block_tables([RUNNING], max_blocks=10_000)),
        (InvalidArgumentError, lambda m: m.block_tables([RUNNING], max_blocks=2**61)),
        (InvalidArgumentError, lambda m: m.slot_mapping([PENDING], [1, 1])),
        (InvalidArgumentError, lambda m: m.slot_mapping([PENDING], -1)),
        (SequenceStateError, lambda m: m.slot_mapping([SWAPPED], 0)),
        (UnknownSequenceError, lambda m: m.slot_mapping([UNKNOWN])),
    ],
)
def test_step_input_errors(busy: Any, error: type[KVBlocksError], call: Any) -> None:
    expect_error(busy, error, call)


# -- messages ----------------------------------------------------------------------------


def test_messages_name_the_problem(busy: Any) -> None:
    assert str(UNKNOWN) in expect_error(busy, UnknownSequenceError, lambda m: m.free(UNKNOWN))
    msg = expect_error(busy, InvalidArgumentError, lambda m: m.allocate_slots(RUNNING, 5))
    assert "num_new_tokens" in msg or "known" in msg
    msg = expect_error(busy, SequenceStateError, lambda m: m.fork(PENDING, 50))
    assert "commit" in msg
    msg = expect_error(busy, SequenceStateError, lambda m: m.allocate_slots(SWAPPED, 1))
    assert "swap" in msg
    with pytest.raises(KeyError):  # UnknownSequenceError is also a KeyError
        busy.num_tokens(UNKNOWN)
