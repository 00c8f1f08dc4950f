"""Admission order of each policy and the order in which running requests are preempted."""

from __future__ import annotations

from sched_fake_model import fake_step, run_to_completion

from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def _admission_order(sched: Scheduler) -> list[str]:
    order: list[str] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [rid for rid in out.sample_request_ids if rid not in order]
        sched.update(out, fake_step(out))
    return order


def test_fcfs_admits_by_arrival_time_not_by_call_order(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_seqs=1, policy="fcfs"))
    for rid, arrival in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), arrival))
    assert _admission_order(sched) == ["a", "b", "c"]


def test_priority_admits_smaller_priority_first_then_by_arrival(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_seqs=1, policy="priority"))
    for rid, arrival, prio in (("late-urgent", 5.0, 0), ("early", 1.0, 1), ("mid", 2.0, 1)):
        sched.add_request(Request(rid, [4, 5], SamplingParams(max_tokens=1), arrival, prio))
    sched.add_request(Request("lowest", [6], SamplingParams(max_tokens=1), 0.0, priority=9))
    assert _admission_order(sched) == ["late-urgent", "early", "mid", "lowest"]


def _lpm_setup(policy: str, make_manager) -> Scheduler:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_seqs=1, policy=policy))
    shared = list(range(1, 17))
    sched.add_request(Request("warm", [*shared, 90], SamplingParams(max_tokens=1), 0.0))
    run_to_completion(sched)  # leaves `shared` in the prefix cache
    sched.add_request(Request("cold", list(range(40, 58)), SamplingParams(max_tokens=1), 1.0))
    sched.add_request(Request("short", [*shared[:8], 70, 71], SamplingParams(max_tokens=1), 2.0))
    sched.add_request(Request("hot", [*shared, 80, 81], SamplingParams(max_tokens=1), 3.0))
    return sched


def test_lpm_admits_the_longest_cached_prefix_first(make_manager) -> None:
    assert _admission_order(_lpm_setup("lpm", make_manager)) == ["hot", "short", "cold"]
    assert _admission_order(_lpm_setup("fcfs", make_manager)) == ["cold", "short", "hot"]


def test_lpm_sees_prefixes_cached_while_requests_wait(make_manager) -> None:
    """ "hot" arrives before "warm" caches the shared prefix; its probe is refreshed."""
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_seqs=1, policy="lpm"))
    shared = list(range(1, 17))
    sched.add_request(Request("warm", [*shared, 90], SamplingParams(max_tokens=1), 0.0))
    sched.add_request(Request("cold", list(range(40, 58)), SamplingParams(max_tokens=1), 1.0))
    sched.add_request(Request("hot", [*shared, 80, 81], SamplingParams(max_tokens=1), 2.0))
    order: list[str] = []
    cached: dict[str, int] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [rid for rid in out.sample_request_ids if rid not in order]
        for result in sched.update(out, fake_step(out)).finished:
            if result.finished:
                cached[result.request_id] = result.num_cached_tokens
    assert order == ["warm", "hot", "cold"]
    assert cached == {"warm": 0, "hot": 16, "cold": 0}


def test_lpm_orders_thousands_of_waiting_requests_with_one_probe(rust_manager) -> None:
    mgr = rust_manager(4096, 16)
    sched = Scheduler(mgr, SchedulerConfig(max_num_seqs=8, policy="lpm"))
    shared = list(range(1, 65))
    sched.add_request(Request("warm", [*shared, 1000], SamplingParams(max_tokens=1), 0.0))
    run_to_completion(sched)
    for i in range(3000):
        prompt = [*shared, 2000 + i] if i % 1000 == 999 else [5000 + i, 1, 2, 3]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), float(i)))
    out = sched.schedule()
    first = [rid for rid in out.sample_request_ids]
    assert first[:3] == ["r999", "r1999", "r2999"]  # the cached ones jump the queue


def test_preemption_takes_the_least_important_running_request(make_manager) -> None:
    # 11 usable blocks of 4 tokens; each request grows to 4 + 15 = 19 tokens (5 blocks).
    mgr = make_manager(12, 4, watermark=0.0)
    sched = Scheduler(mgr, SchedulerConfig(policy="priority"))
    for rid, prio in (("p0", 0), ("p2", 2), ("p1", 1)):
        sched.add_request(
            Request(rid, [1, 2, 3, prio + 4], SamplingParams(max_tokens=15), 0.0, prio)
        )
    preempted: list[str] = []
    while sched.has_unfinished_requests():
        before = sched.running_request_ids()
        out = sched.schedule()
        after = sched.running_request_ids()
        preempted += [rid for rid in before if rid not in after]
        sched.update(out, fake_step(out))
    assert preempted and preempted[0] == "p2"
    assert "p0" not in preempted
