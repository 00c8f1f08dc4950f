"""Level (a) of the content oracle with several KV cache groups over one pool.

The machines of ``content_oracle.py`` and ``content_oracle_tiered.py`` run over managers
built with ``groups=``: mixes of full attention, sliding windows and chunked local
attention, with window and chunk sizes that are and are not multiples of the block size.
Every group of every sequence writes its own KV (its own prefix ids, see
``tests/oracle/kv_memory.py``) through its own slot mapping, and after every operation
each group must read exactly the KV of the tokens its queries may attend to through its
own table (the one-call accessors ``group_block_tables``, ``group_slot_mappings`` and
``update_group_block_tables``, checked against the per-group ones), while holding no
block a future query cannot see: a window or chunked group's footprint is what its next
query attends to plus the step's tokens. Prefix hits are judged the same way: a claim
that skips a window group's blocks before its window reads nothing there, and a claimed
block of the wrong group reads another group's ids.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test

import kvblocks
from kvblocks import GroupSpec
from oracle.kv_memory import Attention, ContentError, KVMemory

from .content_oracle import ContentOracle
from .content_oracle_settings import COVERAGE, MIN_OPERATIONS, ORACLE_EXAMPLES, _oracle_settings
from .content_oracle_tiered import TIER_COVERAGE, TieredContentOracle

#: Window and chunk sizes: below, equal to, between and above multiples of the block
#: sizes drawn (1, 2, 4).
WINDOWS = [1, 2, 3, 4, 5, 8, 13]
CHUNKS = [2, 3, 4, 6, 8, 12]

#: Group effects reached by the grouped machines.
GROUP_COVERAGE: Counter[str] = Counter()

GroupDraw = tuple[str, int | None]

GROUP = st.one_of(
    st.just(("full_attention", None)),
    st.tuples(st.just("sliding_window"), st.sampled_from(WINDOWS)),
    st.tuples(st.just("chunked_local_attention"), st.sampled_from(CHUNKS)),
)


def _specs(groups: list[GroupDraw]) -> tuple[list[GroupSpec], list[Attention]]:
    """The manager's group specs and the oracle's own attention rule of each."""
    specs, rules = [], []
    for kind, size in groups:
        if kind == "full_attention":
            specs.append(GroupSpec.full_attention())
            rules.append(Attention())
        elif kind == "sliding_window":
            assert size is not None
            specs.append(GroupSpec.sliding_window(size))
            rules.append(Attention(window=size))
        else:
            assert size is not None
            specs.append(GroupSpec.chunked_local_attention(size))
            rules.append(Attention(chunk=size))
    return specs, rules


class _GroupCoverage:
    """What only several groups reach: a prefix hit that leaves a window or chunked group
    with leading null entries (it claimed only what its next query sees), and releases
    by a chunked group."""

    attention: list[Attention]

    def _after_allocate(self, sid: int, new: int, lookahead: int) -> None:
        first = sid not in self.allocated  # type: ignore[attr-defined]
        super()._after_allocate(sid, new, lookahead)  # type: ignore[misc]
        if first and self.computed[sid] > 0:  # type: ignore[attr-defined]
            tables = self._tables(sid)  # type: ignore[attr-defined]
            GROUP_COVERAGE["sparse_hit"] += any(bool((t == 0).any()) for t in tables)

    # An override must carry the marker again: Hypothesis finds invariants by it.
    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        super().every_sequence_reads_its_own_kv()  # type: ignore[misc]
        if not hasattr(self, "m"):
            return
        resident = self._resident()  # type: ignore[attr-defined]
        if not resident:
            return
        # The per-group accessors agree with the one-call ones.
        g = int(self.next_id) % len(self.attention)  # type: ignore[attr-defined]
        sid = resident[-1]
        tables = self._tables(sid)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(self.m.block_table(sid, group=g), tables[g])  # type: ignore[attr-defined]
        for g, rule in enumerate(self.attention):
            if rule.chunk is not None:
                GROUP_COVERAGE["chunk_release"] += any(
                    bool((self._tables(s)[g] == 0).any())  # type: ignore[attr-defined]
                    for s in resident
                )


class GroupedContentOracle(_GroupCoverage, ContentOracle):
    """Every rule of the base machine over a manager of one to three groups."""

    @initialize(
        num_blocks=st.integers(6, 48),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 16),
        caching=st.booleans(),
        hash_algo=st.sampled_from(["blake3", "xxh3_128", "sha256_cbor"]),
        groups=st.lists(GROUP, min_size=1, max_size=3),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, hash_algo, groups):
        specs, self.attention = _specs(groups)
        self.bs = block_size
        self.table = np.zeros((len(specs), 4, self.table.shape[2]), dtype=np.int32)
        self.mirror = self.table.copy()
        self.m = kvblocks.KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=caching,
            hash_algo=hash_algo,
            watermark=0.0,
            groups=specs,
            record_events=False,
        )
        assert self.m.num_groups == len(specs) and self.m.groups == specs
        self.m.register_lora(3, "adapter-3", "/adapters/3")
        self.mem = KVMemory(num_blocks, num_cpu_blocks, block_size)


class GroupedTieredContentOracle(_GroupCoverage, TieredContentOracle):
    """The host-tier machine over a manager of one to three groups."""

    @initialize(
        num_blocks=st.integers(6, 28),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(2, 16),
        host_cache_blocks=st.integers(1, 32),
        host_offload=st.sampled_from(["evict", "evict", "commit"]),
        groups=st.lists(GROUP, min_size=1, max_size=3),
    )
    def setup(
        self, num_blocks, block_size, num_cpu_blocks, host_cache_blocks, host_offload, groups
    ):
        specs, self.attention = _specs(groups)
        self.bs = block_size
        self.table = np.zeros((len(specs), 4, self.table.shape[2]), dtype=np.int32)
        self.mirror = self.table.copy()
        self.m = kvblocks.KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            watermark=0.0,
            groups=specs,
            record_events=False,
            host_cache_blocks=host_cache_blocks,
            host_offload=host_offload,
        )
        self.mem = KVMemory(num_blocks, num_cpu_blocks, block_size, host_cache_blocks)


def _forced_sparse_hit(machine: type[Any], **setup: Any) -> None:
    """One fixed example certain to reach a sparse hit, whatever the random examples drew
    (Hypothesis derandomizes under ``CI=true``): a prompt of three blocks is computed and
    freed, then the same prompt and one more token claims its cached blocks, of which the
    window group keeps only those its window still sees."""
    oracle = machine()
    oracle.setup(
        block_size=2,
        num_cpu_blocks=2,
        groups=[("full_attention", None), ("sliding_window", 2)],
        **setup,
    )
    before = GROUP_COVERAGE["sparse_hit"]
    tokens, _ = oracle._one_off(3, None)
    _, hit = oracle._one_off(0, None, tokens=[*tokens, 0])
    assert hit == len(tokens), hit
    assert GROUP_COVERAGE["sparse_hit"] > before, GROUP_COVERAGE
    oracle.every_sequence_reads_its_own_kv()
    oracle.structure_holds()
    oracle.teardown()


def _forced_group_duplicate() -> None:
    """The duplicates KV cache groups make, for certain: a full-attention group still holds
    a prompt's blocks but the window group's blocks of its end were evicted, so the prompt
    is computed again and the full-attention group caches a second copy of each block.
    The first copies are then freed and evicted: the second copies must keep the prompt a
    whole hit (the read check judges what the claim reads)."""
    oracle = GroupedContentOracle()
    oracle.setup(
        num_blocks=24,
        block_size=2,
        num_cpu_blocks=2,
        caching=True,
        hash_algo="blake3",
        groups=[("full_attention", None), ("sliding_window", 2)],
    )
    first = oracle.next_id
    tokens, _ = oracle._one_off(4, None, keep=True)  # holds window block 3 only
    oracle._one_off(oracle.m.num_free_blocks() // 2, None)  # evicts window blocks 0-2
    _, hit = oracle._one_off(0, None, tokens=tokens[:6], keep=True)
    assert hit == 0, hit  # no window block before the query: computed again
    oracle._forget(first)
    oracle._one_off(oracle.m.num_free_blocks() // 2, None)  # evicts the first copies
    _, hit = oracle._one_off(0, None, tokens=[*tokens[:6], 0])
    if hit != 6:
        raise ContentError(f"a prefix whose every block a sequence holds hit {hit} of 6 tokens")
    oracle.every_sequence_reads_its_own_kv()
    oracle.structure_holds()
    oracle.teardown()


def _run(
    machine: type[Any],
    budget: int,
    examples: int,
    reached: list[tuple[Counter[str], tuple[str, ...]]],
) -> None:
    """Run ``machine`` until ``budget`` operations ran and every named effect was reached."""
    for attempt in range(10):
        run_state_machine_as_test(
            machine, settings=_oracle_settings(max_examples=examples, attempt=attempt)
        )
        if COVERAGE["ops"] >= budget and all(
            counter[what] > 0 for counter, names in reached for what in names
        ):
            break
    assert COVERAGE["ops"] >= budget, COVERAGE
    for counter, names in reached:
        assert all(counter[what] > 0 for what in names), counter


def test_every_group_reads_its_own_kv() -> None:
    """Random operations over managers of several groups: every group of every sequence
    reads its own KV and holds only what its queries can still see."""
    COVERAGE.clear()
    GROUP_COVERAGE.clear()
    _forced_sparse_hit(GroupedContentOracle, num_blocks=24, caching=True, hash_algo="blake3")
    _forced_group_duplicate()
    _run(
        GroupedContentOracle,
        MIN_OPERATIONS // 2,
        ORACLE_EXAMPLES // 2,
        [
            (
                COVERAGE,
                (
                    "copy_on_write",
                    "prefix_hit",
                    "eviction",
                    "swap_out",
                    "swap_in",
                    "fork",
                    "lookahead",
                    "partial_commit",
                    "window_release",
                    "table_incremental",
                    "table_rewrite",
                    "in_flight",
                ),
            ),
            (GROUP_COVERAGE, ("sparse_hit", "chunk_release")),
        ],
    )


def test_every_group_reads_its_own_kv_with_a_host_tier() -> None:
    """The same over a host tier: offloads and loads move whole blocks of any group, and a
    tier hit is per group (a group's block loaded into another group reads wrong ids)."""
    COVERAGE.clear()
    TIER_COVERAGE.clear()
    GROUP_COVERAGE.clear()
    _forced_sparse_hit(
        GroupedTieredContentOracle, num_blocks=24, host_cache_blocks=8, host_offload="evict"
    )
    _run(
        GroupedTieredContentOracle,
        MIN_OPERATIONS // 4,
        ORACLE_EXAMPLES // 4,
        [
            (TIER_COVERAGE, ("offload", "load", "copy", "tier_hit", "import")),
            (GROUP_COVERAGE, ("sparse_hit",)),
        ],
    )


#: The real manager class (the fault-injection test patches the module attribute).
_REAL_MANAGER = kvblocks.KVCacheManager


class _MixedUpGroups:
    """A real manager whose slot mappings give every group the first group's slots: the
    writes of one group land in another's blocks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._m = _REAL_MANAGER(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._m, name)

    def group_slot_mappings(self, seq_ids: Any, num_tokens: Any = None) -> Any:
        slots = self._m.group_slot_mappings(seq_ids, num_tokens)
        return np.repeat(slots[:1], len(slots), axis=0)


def test_oracle_catches_groups_sharing_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager that hands one group's slots to every group fails the oracle."""
    monkeypatch.setattr(sys.modules["kvblocks"], "KVCacheManager", _MixedUpGroups)
    machine = GroupedContentOracle()
    # GroupedContentOracle builds kvblocks.KVCacheManager, patched above.
    machine.setup(
        num_blocks=16,
        block_size=2,
        num_cpu_blocks=0,
        caching=False,
        hash_algo="blake3",
        groups=[("full_attention", None), ("sliding_window", 3)],
    )
    machine.m.add_sequence(0, [1, 2, 3, 4, 5])
    machine.tokens[0] = [1, 2, 3, 4, 5]
    machine.ns[0] = (None, None)
    assert machine.m.allocate_slots(0, 5) is not None
    machine._after_allocate(0, 5, 0)
    with pytest.raises(ContentError):
        machine._write_reserved({0: (5, 0)})


def test_oracle_catches_a_window_group_that_keeps_its_blocks() -> None:
    """The footprint check: a group that holds a block no query can see anymore fails
    (run on the one-group rule, here fed a full-attention table for a window group)."""
    mem = KVMemory(8, 0, 2)
    mem.write(np.arange(2, 12), np.arange(10))
    table = np.arange(1, 6)
    mem.check("full", table, list(range(10)), 10, attention=Attention(), released_exactly=True)
    with pytest.raises(ContentError, match="no query"):
        mem.check(
            "window",
            table,
            list(range(10)),
            10,
            attention=Attention(window=3),
            released_exactly=True,
        )
