"""``probe_in_flight`` through the binding (and the reference model): results, errors that
change nothing, and hostile arguments. The bookkeeping across every operation is tested
in ``rust/kvblocks-core/tests/in_flight.rs``; what the reported blocks hold, by the
content oracle (``test_content_oracle.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from kvblocks import InvalidArgumentError, SequenceStateError, UnknownSequenceError

from .core_state import expect_error

PROMPT = list(range(1, 19))  # 4 full blocks of 4 and 2 tokens


def _in_flight(make: Any) -> Any:
    """Seq 1 computes PROMPT in one reservation; 2 and 3 wait with the same prompt (3 with a
    salt); 4 waits with the first 9 tokens; 5 is swapped out."""
    m = make(32, 4, num_cpu_blocks=8)
    m.add_sequence(5, [90, 91, 92, 93, 94])
    m.allocate_slots(5, 5)
    m.commit(5, 5)
    m.swap_out([5])
    m.add_sequence(1, PROMPT)
    m.allocate_slots(1, len(PROMPT))
    m.add_sequence(2, PROMPT)
    m.add_sequence(3, PROMPT, cache_salt="tenant")
    m.add_sequence(4, PROMPT[:9])
    return m


def test_counts_follow_the_reservation_and_end_at_commit(make: Any) -> None:
    m = _in_flight(make)
    got = m.probe_in_flight(np.array([2, 3, 4, 2], dtype=np.int64))
    assert got.dtype == np.int64 and got.tolist() == [16, 0, 8, 16]
    assert m.probe_in_flight([]).tolist() == []
    m.commit(1, len(PROMPT), [7])
    assert m.probe_in_flight([2, 4]).tolist() == [0, 0]
    assert m.refresh_prefixes([2, 4]).tolist() == [16, 8]
    m.check_invariants()


def test_a_short_commit_leaves_only_what_was_written(make: Any) -> None:
    m = _in_flight(make)
    m.commit(1, 5)
    assert m.probe_in_flight([2]).tolist() == [0]
    assert m.refresh_prefixes([2]).tolist() == [4]


def test_prefix_caching_off_reports_nothing(make: Any) -> None:
    m = make(32, 4, enable_prefix_caching=False)
    m.add_sequence(1, PROMPT)
    m.allocate_slots(1, len(PROMPT))
    m.add_sequence(2, PROMPT)
    assert m.probe_in_flight([2]).tolist() == [0]


@pytest.mark.parametrize(
    ("error", "ids"),
    [
        (UnknownSequenceError, [2, 77]),
        (SequenceStateError, [2, 1]),  # allocated, reservation pending
        (SequenceStateError, [5]),  # swapped out
        (InvalidArgumentError, [2, -1]),
        (InvalidArgumentError, [2**64]),
        (InvalidArgumentError, 2),
        (InvalidArgumentError, np.array([[2]])),
        (InvalidArgumentError, np.array([2.0])),
        (InvalidArgumentError, "2"),
    ],
)
def test_errors_change_nothing(make: Any, error: type, ids: Any) -> None:
    expect_error(_in_flight(make), error, lambda m: m.probe_in_flight(ids))


FUZZ = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    import kvblocks
    m = kvblocks.KVCacheManager(16, 4, num_cpu_blocks=4)
    m.add_sequence(1, list(range(12)))
    m.allocate_slots(1, 12)
    m.add_sequence(2, list(range(12)))
    class Lying:
        def __index__(self): return 2**70
        def __len__(self): return sys.maxsize
        def __iter__(self): return iter([2, 2, 2])
    values = [-1, 0, 1, 2, 2**63, 2**64, -2**63, 10**30, 1.5, float("nan"), True, None, "x",
              b"x", [], [2], [2, 2], [-1], [2**40], [[2]], np.array([2, 1]),
              np.array([[2]]), np.array([1.5]), np.array([2**62]), np.uint64(2**64 - 1),
              np.array([2], dtype=np.uint64), np.array([2], dtype=np.int8), Lying(),
              range(3), (2,), {2: 2}]
    rng = random.Random(3)
    for _ in range(3000):
        try:
            m.probe_in_flight(rng.choice(values))
        except (kvblocks.KVBlocksError, TypeError, ValueError, OverflowError):
            pass
    m.check_invariants()
    assert m.probe_in_flight([2]).tolist() == [8]
    print("survived")
    """
)


def test_hostile_arguments_never_escape() -> None:
    done = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "survived" in done.stdout, (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"
    )
