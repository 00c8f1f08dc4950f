"""Step contents: budgets, chunked prefill, batch order and the arrays handed to the engine."""

from __future__ import annotations

import numpy as np
import pytest
from sched_fake_model import fake_step, run_to_completion

from kvblocks import InvalidArgumentError
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def _check_arrays(out, block_size: int) -> None:
    """Internal consistency of a SchedulerOutput."""
    s, t = out.num_seqs, out.num_tokens
    assert out.seq_ids.dtype == np.int64 and out.seq_ids.shape == (s,)
    assert out.num_scheduled_tokens.dtype == np.int32
    assert out.query_start_loc.tolist() == [0, *np.cumsum(out.num_scheduled_tokens).tolist()]
    assert out.positions.shape == (t,) and out.slot_mapping.shape == (t,)
    assert out.block_tables.dtype == np.int32 and out.block_tables.shape[0] == s
    for i in range(s):
        a, b = out.query_start_loc[i], out.query_start_loc[i + 1]
        pos = out.positions[a:b]
        assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + b - a))
        assert out.seq_lens[i] == pos[-1] + 1
        expected = out.block_tables[i, pos // block_size] * block_size + pos % block_size
        assert out.slot_mapping[a:b].tolist() == expected.tolist()
    assert len(set(out.slot_mapping.tolist())) == t  # no two tokens share a slot
    r = out.num_sample_rows
    for arr in (
        out.sample_counts,
        out.temperature,
        out.top_p,
        out.top_k,
        out.seeds,
        out.sample_seq_index,
    ):
        assert arr.shape == (r,)
    assert len(out.sample_request_ids) == r
    assert out.num_prefill_tokens + out.num_decode_tokens == t


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end(make_manager) -> None:
    mgr = make_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=32))
    prompt = list(range(1, 101))
    sched.add_request(Request("long", prompt, SamplingParams(max_tokens=3)))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        _check_arrays(out, 4)
        chunks.append(out.num_scheduled_tokens.tolist())
        start = sum(sum(c) for c in chunks[:-1])
        assert out.input_token_ids.tolist() == prompt[start : start + out.num_tokens]
        assert out.num_sample_rows == (1 if start + out.num_tokens == 100 else 0)
        sched.update(out, fake_step(out))
    assert chunks == [[32], [32], [32], [4]]
    out = sched.schedule()
    assert out.num_decode_seqs == 1 and out.positions.tolist() == [100]


def test_decodes_come_first_and_share_the_budget_with_prefill_chunks(make_manager) -> None:
    mgr = make_manager(128, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=16))
    for i in range(3):
        sched.add_request(Request(f"short{i}", [1 + i, 2, 3], SamplingParams(max_tokens=10)))
    out = sched.schedule()
    assert out.num_tokens == 9 and out.num_sample_rows == 3
    sched.update(out, fake_step(out))
    sched.add_request(Request("long", list(range(40)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    _check_arrays(out, 4)
    assert out.num_decode_seqs == 3 and out.num_decode_tokens == 3
    assert out.num_scheduled_tokens.tolist() == [1, 1, 1, 13]
    assert out.num_tokens == 16  # the token budget is filled exactly
    assert out.logits_indices.tolist() == [0, 1, 2]  # the chunk does not sample


def test_max_num_seqs_limits_the_batch(make_manager) -> None:
    mgr = make_manager(128, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_seqs=2))
    for i in range(5):
        sched.add_request(Request(f"r{i}", [i + 1, 2], SamplingParams(max_tokens=4)))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.num_seqs <= 2
        sched.update(out, fake_step(out))


def test_without_chunked_prefill_prompts_run_whole_or_are_rejected(make_manager) -> None:
    mgr = make_manager(128, 4)
    cfg = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched = Scheduler(mgr, cfg)
    with pytest.raises(InvalidArgumentError, match="chunked prefill is off"):
        sched.add_request(Request("big", list(range(17))))
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=2)))
    sched.add_request(Request("b", list(range(10, 20)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [10]  # b does not fit beside a: it waits
    sched.update(out, fake_step(out))
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [1, 10]


def test_prefix_cache_hit_skips_the_cached_prefix(make_manager) -> None:
    mgr = make_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig())
    shared = list(range(1, 17))
    sched.add_request(Request("first", [*shared, 50], SamplingParams(max_tokens=2)))
    outputs, _ = run_to_completion(sched)
    assert outputs["first"].num_cached_tokens == 0
    sched.add_request(Request("second", [*shared, 60, 61], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [2]  # 16 cached tokens are skipped
    assert out.positions.tolist() == [16, 17]
    sched.update(out, fake_step(out))
    outputs, _ = run_to_completion(sched)
    assert outputs["second"].num_cached_tokens == 16
    assert sched.stats()["prefix_hit_rate"] == pytest.approx(16 / (17 + 18))


def test_requests_queued_together_share_a_prefix_computed_meanwhile(rust_manager) -> None:
    """Claims are taken at admission, so a prefix computed after add_request still hits."""
    mgr = rust_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=17))
    shared = list(range(1, 17))
    sched.add_request(Request("a", [*shared, 50], SamplingParams(max_tokens=1)))
    sched.add_request(Request("b", [*shared, 60], SamplingParams(max_tokens=1)))
    outputs, _ = run_to_completion(sched)
    assert outputs["a"].num_cached_tokens == 0
    assert outputs["b"].num_cached_tokens == 16
