"""The runner's device copy of the scheduler's persistent block table.

The copy is uploaded whole only when the scheduler announces a new array and otherwise
patched with each step's delta; every step, the rows the runner gathers must equal the
scheduler's rows (and the sequences' true block tables). The run preempts (swap and
recompute), so rows are released and reused, and prompts outgrow the initial width.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import GroupSpec, KVCacheManager
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.runner import ModelRunner
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.scheduler.output import ModelStepResult


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_device_table_follows_the_deltas(tiny_llama: LlamaForCausalLM, num_cpu_blocks: int) -> None:
    mgr = KVCacheManager(30, 8, num_cpu_blocks=num_cpu_blocks, watermark=0.0)
    mode = "swap" if num_cpu_blocks else "recompute"
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode)
    sched = Scheduler(mgr, cfg)
    runner = ModelRunner(tiny_llama, num_blocks=30, block_size=8, num_cpu_blocks=64)
    rng = np.random.default_rng(0)
    for i in range(10):
        prompt = rng.integers(1, 200, size=int(rng.integers(20, 160))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(4, 30)), ignore_eos=True, n=1 + i % 2)
        sched.add_request(Request(f"r{i}", prompt, params))
    uploads = patched = 0
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.num_seqs:
            got = runner.step_block_tables(out).cpu().numpy()
            uploads += out.block_table_reallocated
            patched += len(out.block_table_delta) > 0 and not out.block_table_reallocated
            np.testing.assert_array_equal(got, out.block_table[out.block_table_rows])
            for i, seq in enumerate(out.seq_ids.tolist()):
                want = mgr.block_table(seq)
                assert (got[i, : len(want)] == want).all() and not got[i, len(want) :].any()
        tokens = np.full(int(out.sample_counts.sum()), 7, dtype=np.int64)
        sched.update(out, ModelStepResult(tokens, np.zeros(len(tokens), np.float32)))
    assert not sched.has_unfinished_requests()
    assert uploads >= 2 and patched > 10, (uploads, patched)
    assert sched.counters.as_dict()["num_preemptions"] > 0


def test_device_tables_of_every_group_follow_their_deltas(tiny_llama: LlamaForCausalLM) -> None:
    """With a full and a window group, the runner's copy of every group's table follows
    that group's deltas (the window group's released entries become the null block)."""
    groups = [GroupSpec.full_attention(), GroupSpec.sliding_window(12)]
    mgr = KVCacheManager(40, 8, num_cpu_blocks=64, watermark=0.0, groups=groups)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    sched = Scheduler(mgr, cfg)
    runner = ModelRunner(tiny_llama, num_blocks=40, block_size=8, num_cpu_blocks=64)
    rng = np.random.default_rng(1)
    for i in range(8):
        prompt = rng.integers(1, 200, size=int(rng.integers(20, 120))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(4, 30)), ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params))
    released = 0
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.num_seqs:
            got = runner.step_group_block_tables(out).cpu().numpy()
            assert out.group_block_table is not None
            np.testing.assert_array_equal(got, out.group_block_table[:, out.block_table_rows])
            for i, seq in enumerate(out.seq_ids.tolist()):
                for g in range(2):
                    want = mgr.block_table(seq, group=g)
                    assert (got[g, i, : len(want)] == want).all()
                    assert not got[g, i, len(want) :].any()
                released += int((mgr.block_table(seq, group=1) == 0).sum())
        tokens = np.full(int(out.sample_counts.sum()), 7, dtype=np.int64)
        sched.update(out, ModelStepResult(tokens, np.zeros(len(tokens), np.float32)))
    assert not sched.has_unfinished_requests()
    assert released > 0
