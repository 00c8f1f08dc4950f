"""Random workloads, configurations and aborts: invariants hold and everything finishes."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_fake_model import fake_step

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_blocks=st.integers(6, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_cpu_blocks=st.sampled_from([0, 8, 64]),
    budget=st.integers(4, 64),
    max_seqs=st.integers(4, 16),
    policy=st.sampled_from(["fcfs", "priority", "lpm"]),
    mode=st.sampled_from([None, "recompute", "swap"]),
    chunked=st.booleans(),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.2]),
)
def test_random_workload_keeps_invariants(
    seed: int,
    num_blocks: int,
    block_size: int,
    num_cpu_blocks: int,
    budget: int,
    max_seqs: int,
    policy: str,
    mode: str | None,
    chunked: bool,
    caching: bool,
    watermark: float,
) -> None:
    rng = np.random.default_rng(seed)
    mgr = KVCacheManager(
        num_blocks,
        block_size,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=caching,
        watermark=watermark,
    )
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        policy=policy,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
    )
    sched = Scheduler(mgr, cfg)
    shared = rng.integers(1, 90, 12).tolist()
    live: dict[str, SamplingParams] = {}
    done: set[str] = set()
    for step in range(400):
        if step < 40 and rng.random() < 0.5:
            rid = f"r{step}"
            body = rng.integers(1, 90, int(rng.integers(1, 20))).tolist()
            prompt = (shared[: int(rng.integers(0, 13))] + body) if rng.random() < 0.5 else body
            kind = rng.integers(0, 6)
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 12)),
                n=int(rng.integers(2, 4)) if kind == 0 else 1,
                beam_width=int(rng.integers(2, 4)) if kind == 1 else 1,
                stop_token_ids=(int(rng.integers(1, 97)),) if kind == 2 else (),
            )
            req = Request(rid, prompt, params, priority=int(rng.integers(0, 3)), eos_token_id=7)
            try:
                sched.add_request(req)
            except InvalidArgumentError:
                assert len(mgr) == len([s for s in mgr.seq_ids()])  # unchanged, no leak
            else:
                live[rid] = params
        if live and rng.random() < 0.05:
            rid = sorted(live)[int(rng.integers(0, len(live)))]
            if sched.abort_request(rid) is not None:
                done.add(rid)
                del live[rid]
        if not sched.has_unfinished_requests():
            if step >= 40:
                break
            continue
        out = sched.schedule()
        assert len(set(out.slot_mapping.tolist())) == out.num_tokens
        assert out.num_tokens <= budget and out.num_seqs <= max_seqs
        if rng.random() < 0.05 and live:
            rid = sorted(live)[int(rng.integers(0, len(live)))]
            if sched.abort_request(rid) is not None:  # in flight
                done.add(rid)
                del live[rid]
        for result in sched.update(out, fake_step(out)).finished:
            params = live.pop(result.request_id)
            done.add(result.request_id)
            assert len(result.outputs) == params.n
            for completion in result.outputs:
                assert 1 <= len(completion.token_ids) <= params.max_tokens
        mgr.check_invariants()
    assert not sched.has_unfinished_requests() and not live
    assert len(mgr) == 0 and mgr.num_free_blocks() == num_blocks - 1
