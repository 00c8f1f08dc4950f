"""Admission with same-step prefix sharing: the scheduler's holds on against off, same run.

A held request is registered and probed (``probe_in_flight``) but uses no budget, so the
admission loop walks further into the waiting queue (at most ``max_num_seqs`` holds a
step) and an admitted request costs one more core call. Each round admits a queue of
1,024 requests from scratch until none waits: the time to drain it, with the holds on
and with them disabled (``PrefixHold.should_hold`` returns False), in one run.

* ``copies``: 1,024 copies of one 512-token prompt (+ 16 own tokens), the worst case
  for the scan (every request but the first is held in the first step).
* ``systems``: 8 system prompts of 0-448 tokens + 128 own tokens (the lpm bench's mix).

``benchmark.extra_info["prefill_tokens"]`` records what the holds save in compute.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvblocks import KVCacheManager
from kvblocks.scheduler import ModelStepResult, Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.scheduler.queues.prefix_hold import PrefixHold

NUM_REQUESTS = 1024
_ids = itertools.count()


def _prompts(mix: str) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, size=512)
    if mix == "copies":
        return [np.concatenate([system, rng.integers(0, 32000, size=16)])] * NUM_REQUESTS
    return [
        np.concatenate([system[: (i % 8) * 64], rng.integers(0, 32000, size=128)])
        for i in range(NUM_REQUESTS)
    ]


def _build(prompts: list[np.ndarray], policy: str) -> Scheduler:
    mgr = KVCacheManager(60_000, 16)
    sched = Scheduler(
        mgr,
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=NUM_REQUESTS, policy=policy),
        record_history=False,
    )
    for prompt in prompts:
        sched.add_request(Request(f"q{next(_ids)}", prompt, SamplingParams(max_tokens=10**6)))
    return sched


def _drain(sched: Scheduler, rng: np.random.Generator, totals: list[int]) -> None:
    """Steps until nothing waits; the prefill tokens computed go to ``totals``."""
    prefill = 0
    while sched.stats()["num_waiting"] or prefill == 0:
        out = sched.schedule()
        prefill += out.num_prefill_tokens
        n = int(out.sample_counts.sum())
        sched.update(out, ModelStepResult(rng.integers(0, 32000, size=n), np.zeros(n, np.float32)))
    totals.append(prefill)


@pytest.mark.parametrize("hold", ["on", "off"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("mix", ["copies", "systems"])
def test_admitting_a_queue(
    benchmark: Any, monkeypatch: pytest.MonkeyPatch, mix: str, policy: str, hold: str
) -> None:
    """Admit 1,024 waiting requests until none waits."""
    if hold == "off":
        monkeypatch.setattr(PrefixHold, "should_hold", lambda self, *a: False)
    prompts = _prompts(mix)
    rng = np.random.default_rng(1)
    totals: list[int] = []
    scheds: list[Scheduler] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        scheds.append(_build(prompts, policy))
        return (scheds[-1], rng, totals), {}

    benchmark.group = f"admit {NUM_REQUESTS} waiting, {mix}, {policy}"
    benchmark.extra_info.update(hold=hold, mix=mix, policy=policy)
    benchmark.pedantic(_drain, setup=setup, rounds=3, iterations=1)
    benchmark.extra_info["prefill_tokens"] = totals[-1]
    assert scheds[-1].stats()["num_waiting"] == 0
