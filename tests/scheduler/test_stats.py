"""Per-step statistics and their time series."""

from __future__ import annotations

import pytest
from sched_fake_model import run_to_completion

from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def test_stats_dict_and_history(make_manager) -> None:
    mgr = make_manager(32, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=16))
    shared = list(range(1, 13))
    for i in range(4):
        sched.add_request(Request(f"r{i}", [*shared, 50 + i], SamplingParams(max_tokens=6)))
    stats = sched.stats()
    assert stats["num_waiting"] == 4 and stats["num_running"] == 0 and stats["kv_usage"] == 0.0
    _, steps = run_to_completion(sched)
    stats = sched.stats()
    for key in (
        "num_running",
        "num_waiting",
        "num_swapped",
        "kv_usage",
        "prefix_hit_rate",
        "num_preemptions",
        "num_preemptions_recompute",
        "num_preemptions_swap",
        "num_steps",
        "num_generated_tokens",
    ):
        assert key in stats
    assert stats["num_steps"] == len(steps) == len(sched.stats_history)
    assert stats["num_requests_finished"] == 4 and stats["num_generated_tokens"] == 24
    assert 0.0 < stats["prefix_hit_rate"] < 1.0
    # Counts are ints (they print as "steps": 4, not 4.0), rates floats.
    assert all(type(v) is int for k, v in stats.items() if k.startswith("num_")), stats
    assert type(stats["kv_usage"]) is float and type(stats["prefix_hit_rate"]) is float
    series = sched.stats_history.as_arrays()
    assert series["num_batched_tokens"].sum() == sum(s.num_tokens for s in steps)
    assert series["kv_usage"].max() > 0.0 and series["kv_usage"][-1] >= 0.0
    assert series["num_waiting"][0] >= series["num_waiting"][-1]
    # r0's 13 tokens; the others wait a step for the shared prefix it computes
    assert sched.stats_history[0]["num_prefill_tokens"] == 13


def test_history_can_be_turned_off(make_manager) -> None:
    sched = Scheduler(make_manager(32, 4), SchedulerConfig(), record_history=False)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    run_to_completion(sched)
    assert len(sched.stats_history) == 0 and sched.stats()["num_steps"] == 2


def test_history_keeps_the_latest_rows_only() -> None:
    from kvblocks.scheduler.stats import StatsHistory

    history = StatsHistory(max_rows=3)
    for step in range(5):
        history.append({"step": float(step)})
    assert len(history) == 3 and history[0]["step"] == 2.0 and history[-1]["step"] == 4.0
    assert history.column("step").tolist() == [2.0, 3.0, 4.0]


def test_readmissions_do_not_inflate_the_prefix_hit_rate(make_manager) -> None:
    # Issue #7 item 8: three unrelated prompts reported ~40% prefix-cache hits because
    # every recompute readmission (which finds its own blocks cached) was counted again.
    mgr = make_manager(12, 4, watermark=0.0)
    sched = Scheduler(mgr, SchedulerConfig())
    for i in range(3):
        prompt = [20 * i + j + 1 for j in range(10)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
    outputs, _ = run_to_completion(sched)
    stats = sched.stats()
    assert stats["num_preemptions_recompute"] > 0
    assert stats["prefix_hit_rate"] == 0.0 and stats["num_cached_tokens_admitted"] == 0
    assert stats["num_prompt_tokens_admitted"] == 30
    assert all(o.num_cached_tokens == 0 for o in outputs.values())
    # Readmissions are reported on their own: they recompute prompt + generated tokens
    # and find their own full blocks cached.
    assert stats["num_readmitted_tokens"] > 0
    assert 0 < stats["num_readmitted_cached_tokens"] <= stats["num_readmitted_tokens"]
    assert stats["readmission_hit_rate"] == pytest.approx(
        stats["num_readmitted_cached_tokens"] / stats["num_readmitted_tokens"]
    )
