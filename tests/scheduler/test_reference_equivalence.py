"""The scheduler drives the Rust core and the Python reference to identical steps,
block ids included (the two managers promise the same free-queue order)."""

from __future__ import annotations

import numpy as np
from sched_fake_model import fake_step

from kvblocks import KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from oracle.reference_manager import ReferenceKVCacheManager

ARRAYS = (
    "seq_ids",
    "num_scheduled_tokens",
    "input_token_ids",
    "positions",
    "seq_lens",
    "logits_indices",
    "sample_counts",
    "temperature",
)
BLOCK_ARRAYS = (
    "slot_mapping",
    "block_tables",
    "blocks_to_swap_out",
    "blocks_to_swap_in",
    "blocks_to_copy",
)


def _workload() -> list[Request]:
    rng = np.random.default_rng(3)
    system = rng.integers(1, 90, 24).tolist()
    reqs = []
    for i in range(24):
        body = rng.integers(1, 90, int(rng.integers(1, 30))).tolist()
        prompt = system + body if i % 2 else body
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 25)),
            n=3 if i % 7 == 3 else 1,
            beam_width=2 if i % 11 == 5 else 1,
            stop_token_ids=(13,) if i % 5 == 0 else (),
        )
        reqs.append(Request(f"r{i}", prompt, params, float(i // 4), priority=i % 3))
    return reqs


def _lockstep(policy: str, **manager_kwargs) -> list[Scheduler]:
    cfg = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=12, policy=policy)
    managers = [cls(**manager_kwargs) for cls in (KVCacheManager, ReferenceKVCacheManager)]
    scheds = [Scheduler(m, cfg) for m in managers]
    for req in _workload():
        for s in scheds:
            s.add_request(req)
    finished: list[list[tuple]] = [[], []]
    steps = 0
    while scheds[0].has_unfinished_requests():
        outs = [s.schedule() for s in scheds]
        for name in ARRAYS + BLOCK_ARRAYS:
            a, b = getattr(outs[0], name), getattr(outs[1], name)
            assert np.array_equal(a, b), (policy, steps, name)
        for i, (s, o) in enumerate(zip(scheds, outs, strict=True)):
            for done in s.update(o, fake_step(o)).finished:
                finished[i].append((done.request_id, [c.token_ids for c in done.outputs]))
        for m in managers:
            m.check_invariants()
        steps += 1
        assert steps < 2000
    assert not scheds[1].has_unfinished_requests()
    assert finished[0] == finished[1] and len(finished[0]) == 24
    return scheds


def test_identical_steps_under_pressure_without_prefix_caching() -> None:
    for policy in ("fcfs", "priority"):
        scheds = _lockstep(
            policy,
            num_blocks=40,
            block_size=4,
            num_cpu_blocks=64,
            watermark=0.0,
            enable_prefix_caching=False,
        )
        stats = scheds[0].stats()
        assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0


def test_identical_steps_and_blocks_with_prefix_caching() -> None:
    for policy in ("fcfs", "lpm"):
        scheds = _lockstep(policy, num_blocks=512, block_size=4)
        assert scheds[0].stats()["prefix_hit_rate"] > 0.1


def test_identical_steps_under_pressure_with_prefix_caching() -> None:
    for policy in ("fcfs", "lpm"):
        scheds = _lockstep(policy, num_blocks=40, block_size=4, num_cpu_blocks=64, watermark=0.0)
        assert scheds[0].stats()["num_preemptions"] > 0
