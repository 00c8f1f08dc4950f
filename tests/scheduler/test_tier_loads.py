"""Host-tier loads under ``SchedulerConfig.max_load_blocks_per_step``: loads are bounded
per step (not charged as batched tokens), over-bound requests wait or load only what
fits, nothing starves; and ``Request.retention_priority`` reaches the block manager."""

from __future__ import annotations

import pytest
from sched_fake_model import fake_step

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

BLOCK = 4


def run(sched: Scheduler, bound: int | None) -> list[int]:
    """Drive to the end; the loads of every step, each checked against ``bound``."""
    loads = []
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return loads
        out = sched.schedule()
        n = sum(len(p) for kind, p in out.memory_ops if kind == "load")
        assert bound is None or n <= bound, f"{n} loads in a step bounded to {bound}"
        loads.append(n)
        sched.update(out, fake_step(out))
    raise AssertionError("requests did not finish: starved or deadlocked")


def tiered_scheduler(bound: int | None, max_tokens: int = 64) -> Scheduler:
    manager = KVCacheManager(17, BLOCK, watermark=0.0, host_cache_blocks=128)
    config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_load_blocks_per_step=bound)
    return Scheduler(manager, config)


def push_to_tier(sched: Scheduler, prefixes: list[list[int]]) -> None:
    """Compute each prefix once, then flood the pool (all 16 blocks) so its blocks move
    to the tier (large enough to keep everything)."""
    for i, p in enumerate(prefixes):
        sched.add_request(Request(f"warm{i}", [*p, 1], SamplingParams(max_tokens=1)))
    run(sched, None)
    for r in range(1):
        flood = [200 + 50 * r + i for i in range(16 * BLOCK - 1)]
        sched.add_request(Request(f"flood{r}", flood, SamplingParams(max_tokens=1)))
        run(sched, None)


def prefix(k: int) -> list[int]:
    return [10 * k + i for i in range(4 * BLOCK)]  # four full blocks


@pytest.mark.parametrize("bound", [None, 0, 1, 2, 3])
def test_each_step_loads_at_most_the_bound_and_every_request_finishes(bound: int | None) -> None:
    sched = tiered_scheduler(bound)
    push_to_tier(sched, [prefix(1), prefix(2), prefix(3)])
    before = sched.counters.num_load_blocks
    for k in (1, 2, 3):
        sched.add_request(Request(f"again{k}", [*prefix(k), 5, 6], SamplingParams(max_tokens=2)))
    loads = run(sched, bound)
    c = sched.counters
    assert sum(loads) == c.num_load_blocks - before
    if bound is None:
        # Unbounded: all twelve prefix blocks come back by loads, in one step.
        assert (max(loads), c.num_loads_deferred, c.num_loads_recomputed) == (12, 0, 0)
    elif bound == 0:
        assert (sum(loads), c.num_loads_recomputed) == (0, 12)
    else:
        # Each request needs 4 loads, over the bound: the first of a step loads what fits
        # and computes the rest, the next one waits for the following step.
        assert c.num_loads_deferred > 0
        assert c.num_loads_recomputed == 3 * (4 - bound)
        assert sum(loads) + c.num_loads_recomputed == 12


def test_loaded_tokens_are_not_batched_tokens() -> None:
    # A step budget of 8 tokens still takes a request whose 16 cached tokens are loads.
    sched = tiered_scheduler(None, max_tokens=8)
    push_to_tier(sched, [prefix(1)])
    sched.add_request(Request("again", [*prefix(1), 5, 6], SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert sum(len(p) for kind, p in out.memory_ops if kind == "load") == 4
    assert out.num_tokens == 2


def test_the_history_and_counters_report_loads() -> None:
    sched = tiered_scheduler(1)
    push_to_tier(sched, [prefix(1), prefix(2)])
    for k in (1, 2):
        sched.add_request(Request(f"again{k}", [*prefix(k), 5], SamplingParams(max_tokens=1)))
    run(sched, 1)
    stats = sched.stats()
    assert stats["num_load_blocks"] == sched.stats_history.column("num_load_blocks").sum()
    assert stats["num_loads_deferred"] > 0 and stats["num_loads_recomputed"] == 6


def test_bad_bounds_and_priorities_are_rejected() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="max_load_blocks_per_step"):
            SchedulerConfig(max_load_blocks_per_step=bad)  # type: ignore[arg-type]
    for bad in (-1, 101, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="retention_priority"):
            Request("r", [1, 2], retention_priority=bad)  # type: ignore[arg-type]


def test_retention_priority_reaches_the_manager() -> None:
    manager = KVCacheManager(16, BLOCK, host_cache_blocks=8)
    sched = Scheduler(manager)
    sched.add_request(Request("hi", list(range(9)), retention_priority=90))
    sched.add_request(Request("plain", list(range(50, 59))))
    sched.schedule()
    by_request = {sched._owner[s].request.request_id: s for s in manager.seq_ids().tolist()}
    assert manager.retention_priority(by_request["hi"]) == 90
    assert manager.retention_priority(by_request["plain"]) == 35
