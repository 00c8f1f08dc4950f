"""Admission cost with thousands of waiting requests: lpm against fcfs in the same run.

lpm orders the waiting queue by cached prefix every step (one ``refresh_prefixes`` call
over all waiting sequences: a re-probe from stored block hashes, no re-hashing); fcfs
takes the queue as it is. The ratio is the price of cache-aware admission.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvblocks import KVCacheManager
from kvblocks.scheduler import ModelStepResult, Request, SamplingParams, Scheduler, SchedulerConfig

_ids = itertools.count()


@pytest.mark.parametrize("waiting", [1000, 4000])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_admission_step_with_many_waiting(benchmark: Any, policy: str, waiting: int) -> None:
    """One schedule()+update() while ``waiting`` requests queue (8 system prompts)."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, size=512)
    mgr = KVCacheManager(30_000, 16)
    sched = Scheduler(
        mgr, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, policy=policy)
    )

    def refill() -> None:
        while sched.num_unfinished_requests() < waiting + 256:
            i = next(_ids)
            prompt = np.concatenate([system[: (i % 8) * 64], rng.integers(0, 32000, size=128)])
            sched.add_request(Request(f"q{i}", prompt, SamplingParams(max_tokens=16)))

    def step() -> None:
        out = sched.schedule()
        total = int(out.sample_counts.sum())
        sched.update(
            out, ModelStepResult(rng.integers(0, 32000, size=total), np.zeros(total, np.float32))
        )

    refill()
    for _ in range(20):  # reach a steady state with a running batch
        step()
        refill()
    benchmark.group = f"admission step, {waiting} waiting"
    benchmark.extra_info.update(policy=policy, waiting=waiting)
    benchmark.pedantic(step, setup=refill, rounds=30, iterations=1, warmup_rounds=1)
    assert sched.stats()["num_waiting"] >= waiting - 256
