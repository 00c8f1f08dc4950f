"""Same-step prefix sharing: requests admitted together share a prefix computed in that step.

Prefill cost is counted from the ``SchedulerOutput`` of every step (``num_prefill_tokens``),
i.e. what the engine is asked to compute. The ideal for ``k`` requests of one prompt of
``p`` tokens (block size ``bs``) is the prompt once plus, for every other request, what
its cached prefix cannot cover: ``p + (k - 1) * (p - (p - 1) // bs * bs)`` (a hit is whole
blocks and never the prompt's last token).
"""

from __future__ import annotations

import numpy as np
import pytest
from sched_fake_model import fake_step, run_to_completion, tokens_of

from kvblocks import KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.scheduler.queues.prefix_hold import PrefixHold

BS = 16


def ideal(prompt_len: int, copies: int, bs: int = BS) -> int:
    """Prefill tokens when every copy after the first claims the cacheable prefix."""
    return prompt_len + (copies - 1) * (prompt_len - (prompt_len - 1) // bs * bs)


def prefill_tokens(steps) -> int:
    return sum(out.num_prefill_tokens for out in steps)


def run_copies(
    manager,
    prompt: list[int],
    copies: int,
    *,
    params: SamplingParams | None = None,
    config: SchedulerConfig | None = None,
    salts: list[str | None] | None = None,
):
    sched = Scheduler(manager, config or SchedulerConfig())
    params = params or SamplingParams(max_tokens=4)
    for i in range(copies):
        salt = salts[i % len(salts)] if salts else None
        sched.add_request(Request(f"r{i}", prompt, params, cache_salt=salt))
    outputs, steps = run_to_completion(sched, check=manager.check_invariants)
    return sched, outputs, steps


PROMPT = list(range(1, 101))


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_64_identical_prompts_compute_their_prefix_once(make_manager, policy) -> None:
    """The issue's case: 2,272 prefill tokens before, the ideal 352 (+ a block each) now."""
    mgr = make_manager(1024, BS)
    _, outputs, steps = run_copies(mgr, PROMPT, 64, config=SchedulerConfig(policy=policy))
    assert prefill_tokens(steps) <= ideal(100, 64) + 64 * BS, prefill_tokens(steps)
    assert ideal(100, 64) == 352
    # Held back one step, not more: every request has its first token after step 2.
    assert steps[1].num_prefill_tokens == 63 * 4 and steps[1].num_decode_seqs == 1
    # Sharing is invisible in the tokens: every copy generates the same continuation.
    assert len({tuple(t[0]) for t in tokens_of(outputs).values()}) == 1


def test_without_holding_back_the_copies_compute_the_prefix_again(monkeypatch) -> None:
    """The same run with the hold disabled: the bound above fails (the test can fail)."""
    monkeypatch.setattr(PrefixHold, "should_hold", lambda self, *a: False)
    mgr = KVCacheManager(1024, BS)
    _, _, steps = run_copies(mgr, PROMPT, 64)
    assert prefill_tokens(steps) == 2272 > ideal(100, 64) + 64 * BS


def test_a_chunked_prompt_is_shared_chunk_by_chunk(make_manager) -> None:
    """Only this step's chunk is in flight: the writer's first chunk takes the whole
    budget; its last chunk leaves room, and the copies admitted beside it would compute
    that chunk's blocks again (2 blocks each) if they were not held back."""
    prompt = list(range(1, 301))
    mgr = make_manager(512, BS)
    config = SchedulerConfig(max_num_batched_tokens=256)
    _, outputs, steps = run_copies(mgr, prompt, 8, config=config)
    assert prefill_tokens(steps) <= ideal(300, 8) + 8 * BS, prefill_tokens(steps)
    assert len({tuple(t[0]) for t in tokens_of(outputs).values()}) == 1


def test_namespaces_share_only_within_themselves(make_manager) -> None:
    """Two cache salts: each salt's prefix is computed once, never shared across salts."""
    mgr = make_manager(1024, BS)
    _, _, steps = run_copies(mgr, PROMPT, 32, salts=["a", "b"])
    once_per_salt = 2 * 100 + 30 * (100 - 96)
    assert steps[0].num_prefill_tokens == 200  # one writer per salt, nobody else
    assert prefill_tokens(steps) == once_per_salt


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=3, max_tokens=4), SamplingParams(beam_width=2, max_tokens=4)],
    ids=["n3", "beam2"],
)
def test_multi_sequence_requests_share_the_prompt(make_manager, params) -> None:
    mgr = make_manager(1024, BS)
    _, outputs, steps = run_copies(mgr, PROMPT, 8, params=params)
    assert prefill_tokens(steps) <= ideal(100, 8) + 8 * BS, prefill_tokens(steps)
    assert len({str(tokens_of({"x": o})) for o in outputs.values()}) == 1


def test_a_held_request_leaves_the_budget_to_later_ones(make_manager) -> None:
    """The copy waits without using budget: a different prompt behind it gets its tokens."""
    mgr = make_manager(256, BS)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=250))
    other = list(range(500, 600))
    for rid, prompt in (("a", PROMPT), ("b", PROMPT), ("c", other)):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [100, 100]  # a and c; b is held
    assert out.sample_request_ids == ["a", "c"]
    sched.update(out, fake_step(out))
    out = sched.schedule()
    # b claims a's 96 committed tokens and computes the 4 left
    assert out.num_prefill_tokens == 4 and "b" in out.sample_request_ids


def test_nothing_is_held_into_an_empty_step(make_manager) -> None:
    """The first request of a step is never held (nothing is in flight before it)."""
    mgr = make_manager(256, BS)
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request("a", PROMPT, SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert out.num_prefill_tokens == 100


def test_an_aborted_writer_does_not_strand_the_copy(make_manager) -> None:
    """The writer is aborted while its step is in flight: the held copy is admitted next
    step with whatever was committed, and finishes like a lone request."""
    mgr = make_manager(256, BS)
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request("a", PROMPT, SamplingParams(max_tokens=3)))
    sched.add_request(Request("b", PROMPT, SamplingParams(max_tokens=3)))
    out = sched.schedule()
    assert out.sample_request_ids == ["a"]
    sched.abort_request("a")
    sched.update(out, fake_step(out))
    outputs, _ = run_to_completion(sched, check=mgr.check_invariants)
    assert len(outputs["b"].outputs[0].token_ids) == 3


class _Req:
    """A stand-in request (weak-referenceable)."""


def test_holds_are_bounded_when_the_prefix_stops_growing() -> None:
    hold = PrefixHold(max_stalls=1)
    req = _Req()
    assert hold.should_hold(req, 0, 32)  # first hold
    assert hold.should_hold(req, 32, 32)  # grew: held again
    assert hold.should_hold(req, 32, 32)  # one stall allowed
    assert not hold.should_hold(req, 32, 32)  # no growth twice in a row: admit
    assert len(hold) == 0
    assert hold.should_hold(req, 32, 16)  # a new episode
    assert not hold.should_hold(req, 48, 0)  # nothing in flight: never held
    assert len(hold) == 0
    hold.should_hold(req, 0, 16)
    hold.release(req)
    assert len(hold) == 0
    hold.should_hold(req, 0, 16)
    del req  # a request that ends while held is forgotten with it
    assert len(hold) == 0


def test_holding_leaves_outputs_unchanged(make_manager) -> None:
    """A mixed workload (shared heads, different tails, n > 1) produces the same tokens
    with and without prefix caching: holding back changes what is computed when, never
    what is generated."""
    rng = np.random.default_rng(3)
    head = rng.integers(1, 90, 70).tolist()
    requests = []
    for i in range(24):
        tail = rng.integers(1, 90, int(rng.integers(0, 40))).tolist()
        n = int(rng.choice([1, 1, 2]))
        requests.append(
            Request(
                f"r{i}", head[: int(rng.integers(10, 71))] + tail, SamplingParams(n=n, max_tokens=5)
            )
        )
    runs = []
    for caching in (True, False):
        mgr = make_manager(128, 8, enable_prefix_caching=caching)
        sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=160, max_num_seqs=16))
        for r in requests:
            sched.add_request(r)
        outputs, steps = run_to_completion(sched, check=mgr.check_invariants)
        runs.append((tokens_of(outputs), prefill_tokens(steps)))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] < runs[1][1]
