"""Bounded waiting (``SchedulerConfig.max_wait_steps``): no request waits forever.

priority and lpm admit better-ranked work first; without a bound a request they rank low
waits for as long as better-ranked work keeps arriving. With it, a request that waited
``max_wait_steps`` steps is overdue: admitted before every request that is not, overdue
requests in arrival order, while the policy's order holds below the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from sched_fake_model import fake_step

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.scheduler.queues.policy import WaitingQueue
from kvblocks.scheduler.queues.prefix_hold import PrefixHold
from kvblocks.scheduler.queues.wait_bound import WaitBound
from kvblocks.scheduler.request_state import RequestState, RequestStatus

POLICIES = ("fcfs", "priority", "lpm")


def _issue_repro(policy: str, **config: object) -> int | None:
    """Issue 16's repro: one cold, low-priority prompt among a stream of hot ones, one
    arrival per step (above what the server computes); the step q50 is admitted."""
    rng = np.random.default_rng(0)
    hot = rng.integers(0, 97, 96).tolist()
    mgr = KVCacheManager(num_blocks=160, block_size=16, num_cpu_blocks=0)
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, policy=policy, **config)
    sched = Scheduler(mgr, cfg)
    admitted = None
    for step in range(300):
        odd = step == 50
        prompt = rng.integers(0, 97, 64).tolist() if odd else hot + rng.integers(0, 97, 8).tolist()
        params = SamplingParams(max_tokens=24, temperature=0)
        sched.add_request(Request(f"q{step}", prompt, params, priority=2 if odd else 0))
        out = sched.schedule()
        sched.update(out, fake_step(out))
        if admitted is None and "q50" in sched.running_request_ids():
            admitted = step
    return admitted


@pytest.mark.parametrize("policy", POLICIES)
def test_the_issue_repro_admits_the_starved_request(policy: str) -> None:
    # fcfs admits q50 at step 74 (24 steps of earlier arrivals ahead of it); priority and
    # lpm never did: every later hot prompt ranked before it.
    admitted = _issue_repro(policy)
    assert admitted is not None
    bound = SchedulerConfig().max_wait_steps
    assert bound is not None
    assert admitted <= 50 + bound + 1, admitted
    if policy == "fcfs":
        assert admitted == 74  # below the bound nothing changes
    # A bound below the fcfs wait admits it exactly when fcfs does.
    assert _issue_repro(policy, max_wait_steps=20) == 74


@pytest.mark.parametrize("policy", ["priority", "lpm"])
def test_without_a_bound_the_repro_starves(policy: str) -> None:
    """What the bound fixes (max_wait_steps=None is the strict order, opt-in)."""
    assert _issue_repro(policy, max_wait_steps=None) is None


@dataclass
class _Trace:
    """One overload run: when each request was added and admitted, per-step holds."""

    added: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    counter: dict[str, int] = field(default_factory=dict)
    held: dict[int, set[str]] = field(default_factory=dict)
    waiting_after: dict[int, set[str]] = field(default_factory=dict)

    def wait(self, rid: str) -> int:
        return self.admitted[rid] - self.added[rid]


def _overload(
    policy: str, bound: int | None, seed: int, rate: float, monkeypatch: pytest.MonkeyPatch
) -> _Trace:
    """Poisson arrivals at ``rate`` per step for 160 steps (the server computes about one
    request per step), random priorities 0-3, 70% of prompts on one of three hot
    prefixes; then the queue drains."""
    trace = _Trace()
    step = 0
    original = PrefixHold.should_hold

    def recording(self: PrefixHold, request: object, cached: int, in_flight: int) -> bool:
        held = original(self, request, cached, in_flight)
        if held:
            trace.held.setdefault(step, set()).add(request.request.request_id)  # type: ignore[attr-defined]
        return held

    monkeypatch.setattr(PrefixHold, "should_hold", recording)
    rng = np.random.default_rng(seed)
    hots = [rng.integers(1, 97, 48).tolist() for _ in range(3)]
    cfg = SchedulerConfig(
        max_num_batched_tokens=128, max_num_seqs=8, policy=policy, max_wait_steps=bound
    )
    sched = Scheduler(KVCacheManager(num_blocks=400, block_size=16), cfg)
    while step < 160 or sched.has_unfinished_requests():
        for _ in range(int(rng.poisson(rate)) if step < 160 else 0):
            rid = f"r{len(trace.added)}"
            hot = hots[int(rng.integers(0, 3))] if rng.random() < 0.7 else []
            prompt = hot + rng.integers(1, 97, int(rng.integers(4, 24))).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(4, 16)), ignore_eos=True)
            priority = int(rng.integers(0, 4))
            sched.add_request(Request(rid, prompt, params, priority=priority))
            trace.counter[rid] = len(trace.added)
            trace.added[rid] = step
            trace.priority[rid] = priority
        out = sched.schedule()
        for rid in sched.running_request_ids():
            trace.admitted.setdefault(rid, step)
        trace.waiting_after[step] = {r for r in trace.added if r not in trace.admitted}
        sched.update(out, fake_step(out))
        step += 1
        assert step < 2000, "no progress"
    assert sched.stats()["num_preemptions"] == 0  # waits start at add_request only
    assert set(trace.admitted) == set(trace.added)
    return trace


def _check_order(trace: _Trace, policy: str, bound: int) -> None:
    """Step by step: nothing admitted passes an overdue request unless it arrived
    before it (and is overdue too); below the bound, the policy's order holds. A request
    held a step for a prefix computed in that step may be passed (that is the hold)."""

    def arrival(rid: str) -> tuple[int, int]:
        return trace.added[rid], trace.counter[rid]

    def key(rid: str) -> tuple[int, int, int]:
        prio = trace.priority[rid] if policy == "priority" else 0
        return (prio, *arrival(rid))

    for step, waiting in trace.waiting_after.items():
        now = [r for r, at in trace.admitted.items() if at == step]
        for w in waiting - trace.held.get(step, set()):
            if trace.added[w] > step:
                continue
            w_overdue = step - trace.added[w] >= bound
            for a in now:
                a_overdue = step - trace.added[a] >= bound
                if w_overdue:
                    assert a_overdue and arrival(a) < arrival(w), (step, a, w)
                elif not a_overdue and policy != "lpm":  # lpm's order is the cache's
                    assert key(a) < key(w), (step, a, w)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rate", [0.9, 1.3])
def test_sustained_overload_admits_every_request_within_the_bound(
    policy: str, rate: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request waits at most ``max_wait_steps`` longer than first-come-first-served
    makes it wait on the same arrivals (at rate 1.3 the queue grows for 160 steps: every
    order makes late arrivals wait long), and the order holds step by step."""
    bound = 24
    for seed in range(2):
        fcfs = _overload("fcfs", bound, seed, rate, monkeypatch)
        trace = _overload(policy, bound, seed, rate, monkeypatch)
        _check_order(trace, policy, bound)
        excess = {rid: trace.wait(rid) - fcfs.wait(rid) for rid in trace.added}
        worst = max(excess, key=excess.__getitem__)
        assert excess[worst] <= bound, (seed, worst, trace.wait(worst), fcfs.wait(worst))
        if policy != "fcfs":
            # Without the bound the same arrivals starve low-ranked requests.
            strict = _overload(policy, None, seed, rate, monkeypatch)
            assert max(strict.wait(r) - fcfs.wait(r) for r in strict.added) > bound


def test_zero_bound_admits_in_arrival_order(make_manager) -> None:
    def order(cfg: SchedulerConfig) -> list[str]:
        sched = Scheduler(make_manager(64, 4), cfg)
        for rid, arrival, prio in (("late-urgent", 5.0, 0), ("early", 1.0, 1), ("mid", 2.0, 1)):
            sched.add_request(Request(rid, [4, 5], SamplingParams(max_tokens=1), arrival, prio))
        seen: list[str] = []
        while sched.has_unfinished_requests():
            out = sched.schedule()
            seen += [rid for rid in out.sample_request_ids if rid not in seen]
            sched.update(out, fake_step(out))
        return seen

    urgent_first = ["late-urgent", "early", "mid"]
    assert order(SchedulerConfig(max_num_seqs=1, policy="priority")) == urgent_first
    arrival = ["early", "mid", "late-urgent"]
    assert order(SchedulerConfig(max_num_seqs=1, policy="priority", max_wait_steps=0)) == arrival


def test_stats_show_the_longest_current_wait(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_seqs=1, max_wait_steps=2))
    assert sched.stats()["longest_wait_steps"] == 0
    for i in range(4):
        sched.add_request(Request(f"r{i}", [1, 2, 3, i + 4], SamplingParams(max_tokens=3)))
    waits = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, fake_step(out))
        waits.append(sched.stats()["longest_wait_steps"])
    # One request runs at a time (3 steps each): the last one waits 9 steps.
    assert waits[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 9] and waits[-1] == 0
    stats = sched.stats()
    assert type(stats["longest_wait_steps"]) is int
    assert stats["num_requests_overdue"] == 3  # r1, r2, r3 waited past 2 steps
    history = sched.stats_history.column("longest_wait_steps")
    assert history.max() == 9.0


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True, "8"])
def test_max_wait_steps_is_checked(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_wait_steps"):
        SchedulerConfig(max_wait_steps=bad)  # type: ignore[arg-type]


def test_overdue_is_for_good_and_ranks_by_arrival() -> None:
    """Overdue requests go first in arrival order whatever their priority; one that
    leaves the queue (admitted) and comes back (recompute preemption) is still overdue,
    so a low-ranked request is not admitted and preempted without end either."""

    def state(rid: str, priority: int, counter: int) -> RequestState:
        request = Request(rid, [counter + 1], SamplingParams(), priority=priority)
        return RequestState(request, counter, (priority, float(counter), counter), counter)

    bound, queue = WaitBound(2), WaitingQueue()
    low, high = state("low", 5, 0), state("high", 0, 1)
    for s in (low, high):
        bound.enter(s, 0)
        queue.push(s)
    assert queue.items() == [high, low] and bound.promote(queue, 1) == 0
    assert bound.promote(queue, 2) == 2
    assert queue.items() == [low, high] and queue.num_overdue() == 2
    queue.remove(low)  # admitted
    low.status = RequestStatus.PREFILL
    assert bound.longest_wait(3) == 3  # high, since step 0
    urgent = state("urgent", -9, 2)
    bound.enter(urgent, 3)
    queue.push(urgent)
    low.status = RequestStatus.WAITING  # preempted: back in the queue
    bound.enter(low, 4)
    queue.push(low)
    assert queue.items() == [low, high, urgent]
    assert low.make_part(0, np.array([1]), 0.0).overdue
    queue.remove(high)
    high.status = RequestStatus.PREFILL
    assert bound.longest_wait(5) == 2  # urgent, since step 3 (low re-entered at 4)


def test_the_bound_keeps_no_entry_of_requests_that_left() -> None:
    """Entries of requests that left the queue are dropped as others enter, even while one
    request waits at the front and nothing asks for the longest wait (a simulation never
    calls stats(); the entries of every finished request were kept for the whole run)."""
    from kvblocks.scheduler.queues.wait_bound import WaitBound

    class Item:
        def __init__(self) -> None:
            self.key = (0, 0, 0.0, 0)
            self.seq_ids: list[int] = []
            self.overdue = False
            self.wait_since = -1
            self.is_waiting = True

        @property
        def queue_key(self) -> tuple[int, int, float, int]:
            return self.key

    bound = WaitBound(None)
    head = Item()
    bound.enter(head, 0)
    for step in range(1, 20_000):
        item = Item()
        bound.enter(item, step)
        item.is_waiting = False  # admitted at once
    assert len(bound._entries) < 3_000, len(bound._entries)
    assert bound.longest_wait(20_000) == 20_000  # the head still counts
