"""Level (a) of the content oracle: the block manager drives an emulated KV memory
(the machine, :class:`core.content_oracle.ContentOracle`, and what it checks are described
in :mod:`core.content_oracle`).

At least ``MIN_OPERATIONS`` random operations with every content effect reached, fixed
examples of the effects a derandomized run may not draw (a flood with prefix caching, a
duplicate), and the oracle's own checks: managers with a fault injected fail it.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import Phase
from hypothesis.stateful import run_state_machine_as_test

import kvblocks
from oracle.kv_memory import ContentError

from . import content_oracle
from .content_oracle import ContentOracle
from .content_oracle_settings import COVERAGE, DEFAULT_PRIORITY, MIN_OPERATIONS, _oracle_settings


def _forced_flood() -> None:
    """One fixed example with prefix caching: a flood over a fresh pool (11 free blocks:
    ``A`` takes 5, ``B`` the 6 never used, ``C`` must evict 6 cached ones), whatever
    configurations the random examples drew."""
    machine = ContentOracle()
    machine.setup(
        num_blocks=12, block_size=2, num_cpu_blocks=0, caching=True, hash_algo="blake3", window=None
    )
    machine.flood(high=90, low=10)
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def _forced_duplicate() -> None:
    """One fixed example of the duplicate rule: two sequences compute one 10-token prompt
    at once, the first to commit is freed and a prompt over the free pool evicts its
    copies; the other's copies must keep the prompt a whole hit."""
    machine = ContentOracle()
    machine.setup(
        num_blocks=12, block_size=2, num_cpu_blocks=0, caching=True, hash_algo="blake3", window=None
    )
    machine.duplicate(free_first=True)
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def test_every_sequence_reads_its_own_kv() -> None:
    """At least ``MIN_OPERATIONS`` random operations, every content effect reached."""
    COVERAGE.clear()
    _forced_flood()
    _forced_duplicate()
    # Hypothesis decides how long each run is: repeat until the budget is spent.
    for attempt in range(10):
        run_state_machine_as_test(
            ContentOracle,
            settings=_oracle_settings(attempt=attempt),
        )
        if COVERAGE["ops"] >= MIN_OPERATIONS:
            break
    assert COVERAGE["ops"] >= MIN_OPERATIONS, COVERAGE
    reached = (
        "copy_on_write",
        "prefix_hit",
        "eviction",
        "swap_out",
        "swap_in",
        "fork",
        "lookahead",
        "partial_commit",
        "window_release",
        "cache_reset",
        "table_incremental",
        "table_rewrite",
        "table_row_reused",
        "in_flight",
        "retention_priority",
        "priority_kept",
        "duplicate_kept",
    )
    assert all(COVERAGE[what] > 0 for what in reached), COVERAGE


class _FaultyManager:
    """A real manager with one fault injected, for the oracle's own checks: it drops the
    copy-on-write copies (``"copy_on_write"``) or ignores retention priorities while
    reporting them as set (``"priority"``)."""

    def __init__(self, fault: str, *args: object, **kwargs: object) -> None:
        self._m = kvblocks.KVCacheManager(*args, **kwargs)  # content_oracle's name is patched
        self._fault = fault
        self._priority: dict[int, int] = {}

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):  # not set yet (or a protocol probe): not the manager's
            raise AttributeError(name)
        return getattr(self._m, name)

    def take_copy_on_writes(self):
        pairs = self._m.take_copy_on_writes()
        return pairs[:0] if self._fault == "copy_on_write" else pairs

    def set_retention_priority(self, seq_id: int, priority: int) -> None:
        if self._fault != "priority":
            self._m.set_retention_priority(seq_id, priority)
            return
        if not 0 <= priority <= 100:
            raise kvblocks.InvalidArgumentError(f"priority {priority} out of range")
        self._priority[seq_id] = priority

    def retention_priority(self, seq_id: int) -> int:
        if self._fault != "priority":
            return self._m.retention_priority(seq_id)
        return self._priority.get(seq_id, DEFAULT_PRIORITY)


def test_oracle_catches_dropped_copy_on_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager whose copy-on-write copies never happen fails the read check."""
    monkeypatch.setattr(
        content_oracle, "KVCacheManager", functools.partial(_FaultyManager, "copy_on_write")
    )
    with pytest.raises(ContentError):
        run_state_machine_as_test(
            ContentOracle,
            settings=_oracle_settings(database=None, phases=[Phase.generate]),
        )


def test_forced_flood_needs_priority_ordered_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed flood keeps its high-priority prefix on the real manager and loses it on
    one that evicts least recently used first, whatever the priorities: the coverage
    requirement ``priority_kept`` cannot be met by a manager that ignores them."""
    COVERAGE.clear()
    _forced_flood()
    assert COVERAGE["priority_kept"] == 1 and COVERAGE["eviction"] > 0, COVERAGE
    monkeypatch.setattr(
        content_oracle, "KVCacheManager", functools.partial(_FaultyManager, "priority")
    )
    COVERAGE.clear()
    _forced_flood()
    assert COVERAGE["priority_kept"] == 0 and COVERAGE["eviction"] > 0, COVERAGE
