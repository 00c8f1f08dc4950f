"""Level (a) of the content oracle over a host tier (:class:`TieredContentOracle`): every
sequence reads its own KV, every loaded block holds its prefix's KV, and offloads, loads,
imports, tier hits and tier evictions are all reached."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from .content_oracle_settings import COVERAGE, MIN_OPERATIONS, ORACLE_EXAMPLES, _oracle_settings
from .content_oracle_tiered import TIER_COVERAGE, TieredContentOracle


def _small_tiered_oracle(num_cpu_blocks: int) -> TieredContentOracle:
    """A host-tier oracle small enough for a fixed example: 12 GPU blocks of 2 tokens and
    a 4-block tier that offloads on eviction."""
    machine = TieredContentOracle()
    machine.setup(
        num_blocks=12,
        block_size=2,
        num_cpu_blocks=num_cpu_blocks,
        host_cache_blocks=4,
        host_offload="evict",
        window=None,
    )
    return machine


def _forced_copy_on_write() -> None:
    """One fixed example over a host tier certain to journal a copy-on-write copy: a
    prompt of one and a half blocks stays held, is forked, and the child writes its next
    token into the shared partial block (Hypothesis derandomizes under ``CI=true``, and
    the fixed draws need not reach it)."""
    machine = _small_tiered_oracle(num_cpu_blocks=2)
    before = TIER_COVERAGE["copy"]
    _, hit = machine._one_off(0, None, tokens=[12, 13, 14], keep=True)
    assert hit == 0, hit
    machine._fork_and_write(machine.next_id - 1, 5)
    assert TIER_COVERAGE["copy"] > before, TIER_COVERAGE
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def _forced_swap_in() -> None:
    """One fixed example over a host tier certain to journal a swap-in copy: a prompt of
    one and a half blocks is swapped out and back (its partial block is never cached, so
    it must come back from CPU memory). Under ``CI=true`` the derandomized draws need not
    reach one: since every copy of a hash stays cached, the swap-ins they draw may find
    their blocks still cached on the GPU."""
    machine = _small_tiered_oracle(num_cpu_blocks=4)
    before = TIER_COVERAGE["swap_in"]
    machine._one_off(0, None, tokens=[12, 13, 14], keep=True)
    sid = machine.next_id - 1
    machine.m.swap_out([sid])
    machine._drain()
    machine.m.swap_in([sid])
    machine._drain()
    assert TIER_COVERAGE["swap_in"] > before, TIER_COVERAGE
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def test_every_sequence_reads_its_own_kv_with_a_host_tier() -> None:
    """Random operations over a host tier: every sequence reads its own KV, every loaded
    block holds its prefix's KV, and offloads, loads, imports, tier hits and tier
    evictions are all reached."""
    COVERAGE.clear()
    TIER_COVERAGE.clear()
    _forced_copy_on_write()
    _forced_swap_in()
    budget = MIN_OPERATIONS // 2
    reached = (
        "offload",
        "load",
        "copy",
        "swap_out",
        "swap_in",
        "tier_hit",
        "tier_eviction",
        "import",
    )
    for attempt in range(10):
        run_state_machine_as_test(
            TieredContentOracle,
            settings=_oracle_settings(max_examples=ORACLE_EXAMPLES // 2, attempt=attempt),
        )
        if COVERAGE["ops"] >= budget and all(TIER_COVERAGE[what] > 0 for what in reached):
            break
    assert COVERAGE["ops"] >= budget, COVERAGE
    assert all(TIER_COVERAGE[what] > 0 for what in reached), TIER_COVERAGE
    assert COVERAGE["prefix_hit"] > 0 and COVERAGE["eviction"] > 0, COVERAGE
