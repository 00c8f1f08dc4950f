"""Recompute and swap preemption with tiny pools: same tokens as without memory pressure."""

from __future__ import annotations

import numpy as np
import pytest
from sched_fake_model import run_to_completion, tokens_of

from kvblocks.scheduler import FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig


def _requests(n: int = 6, max_tokens: int = 20, **params) -> list[Request]:
    rng = np.random.default_rng(7)
    return [
        Request(
            f"r{i}", rng.integers(1, 90, 5 + 3 * i), SamplingParams(max_tokens=max_tokens, **params)
        )
        for i in range(n)
    ]


def _run(manager, requests, **cfg):
    sched = Scheduler(manager, SchedulerConfig(**cfg))
    for r in requests:
        sched.add_request(r)
    outputs, steps = run_to_completion(sched, check=manager.check_invariants)
    assert len(manager) == 0 and manager.num_free_blocks() == manager.num_blocks - 1
    return sched, outputs, steps


def test_recompute_preemption_gives_the_same_tokens(make_manager) -> None:
    reqs = _requests()
    _, baseline, _ = _run(make_manager(256, 4), reqs)
    sched, outputs, steps = _run(make_manager(14, 4, watermark=0.0), reqs)
    assert sched.stats()["num_preemptions_recompute"] > 0
    assert sched.stats()["num_preemptions_swap"] == 0
    assert tokens_of(outputs) == tokens_of(baseline)
    assert all(len(s.blocks_to_swap_out) == 0 for s in steps)


def test_swap_preemption_of_single_sequences_when_asked(rust_manager) -> None:
    reqs = _requests()
    _, baseline, _ = _run(rust_manager(256, 4), reqs)
    sched, outputs, steps = _run(
        rust_manager(14, 4, num_cpu_blocks=64, watermark=0.0), reqs, preemption_mode="swap"
    )
    assert sched.stats()["num_preemptions_swap"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)
    out_pairs = np.concatenate([s.blocks_to_swap_out for s in steps])
    in_pairs = np.concatenate([s.blocks_to_swap_in for s in steps])
    assert len(out_pairs) > 0 and len(in_pairs) > 0
    assert out_pairs[:, 0].min() >= 1 and in_pairs[:, 1].min() >= 1  # GPU side: never null


def test_swap_falls_back_to_recompute_without_a_cpu_pool(rust_manager) -> None:
    reqs = _requests()
    _, baseline, _ = _run(rust_manager(256, 4), reqs)
    sched, outputs, _ = _run(rust_manager(14, 4, watermark=0.0), reqs, preemption_mode="swap")
    assert sched.stats()["num_preemptions_recompute"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)


def test_parallel_sampling_is_swapped_and_keeps_its_samples(make_manager) -> None:
    reqs = [
        Request(f"r{i}", list(range(1 + i, 7 + i)), SamplingParams(max_tokens=16, n=3))
        for i in range(4)
    ]
    _, baseline, _ = _run(make_manager(256, 4), reqs)
    sched, outputs, _ = _run(make_manager(20, 4, num_cpu_blocks=64, watermark=0.0), reqs)
    assert sched.stats()["num_preemptions_swap"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)


def test_multi_sequence_request_without_cpu_pool_finishes_every_sequence(make_manager) -> None:
    # Issue #7 item 7: these used to end early with reason "length" (silent truncation).
    # Without a CPU pool the forked sequences are recomputed one by one instead.
    reqs = [
        Request(f"r{i}", list(range(1, 7)), SamplingParams(max_tokens=30, n=3)) for i in range(3)
    ]
    _, baseline, _ = _run(make_manager(256, 4), reqs)
    sched, outputs, _ = _run(make_manager(16, 4, watermark=0.0), reqs)
    assert sched.stats()["num_preemptions_recompute"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)
    assert all(len(c.token_ids) == 30 for o in outputs.values() for c in o.outputs)


def test_n8_requests_in_a_pool_without_cpu_blocks_are_not_truncated(make_manager) -> None:
    # The case: n = 8 in a 100-block pool without CPU blocks ended with 9, 13, 21
    # and 30 of 30 tokens, all reported as "length".
    rng = np.random.default_rng(3)
    reqs = [
        Request(f"r{i}", rng.integers(1, 90, 8), SamplingParams(max_tokens=30, n=8))
        for i in range(4)
    ]
    _, baseline, _ = _run(make_manager(1024, 4), reqs)
    sched, outputs, _ = _run(make_manager(100, 4), reqs)
    assert sched.stats()["num_preemptions"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)
    reasons = {c.finish_reason for o in outputs.values() for c in o.outputs}
    assert all(len(c.token_ids) == 30 for o in outputs.values() for c in o.outputs), reasons


def test_beam_search_without_cpu_pool_is_recomputed_not_truncated(make_manager) -> None:
    reqs = [
        Request(f"b{i}", list(range(1 + i, 9 + i)), SamplingParams(max_tokens=24, beam_width=3))
        for i in range(4)
    ]
    _, baseline, _ = _run(make_manager(512, 4), reqs)
    sched, outputs, _ = _run(make_manager(30, 4, watermark=0.0), reqs)
    assert sched.stats()["num_preemptions_recompute"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)
    for o in outputs.values():
        assert [c.finish_reason for c in o.outputs] == [
            c.finish_reason for c in baseline[o.request_id].outputs
        ]


def test_a_recompute_longer_than_the_token_budget_is_admitted_without_chunking(
    make_manager,
) -> None:
    # Issue #7 item 6: with chunked prefill off, a preempted sequence whose prompt plus
    # generated tokens exceed max_num_batched_tokens was never admitted again and
    # schedule() returned empty steps forever.
    reqs = [
        Request(
            f"r{i}",
            list(range(1 + 20 * i, 13 + 20 * i)),
            SamplingParams(max_tokens=20, ignore_eos=True),
        )
        for i in range(2)
    ]
    cfg = {"max_num_batched_tokens": 16, "enable_chunked_prefill": False}
    _, baseline, _ = _run(make_manager(64, 4, enable_prefix_caching=False), reqs, **cfg)
    mgr = make_manager(10, 4, enable_prefix_caching=False)
    sched = Scheduler(mgr, SchedulerConfig(**cfg))
    for r in reqs:
        sched.add_request(r)
    outputs, steps = run_to_completion(sched, max_steps=500, check=mgr.check_invariants)
    assert sched.stats()["num_preemptions_recompute"] > 0
    assert tokens_of(outputs) == tokens_of(baseline)
    assert all(s.num_tokens <= 16 for s in steps)


def test_a_sequence_that_outgrows_the_whole_pool_finishes_with_length(make_manager) -> None:
    mgr = make_manager(8, 4, watermark=0.0)  # 7 usable blocks = 28 tokens
    _, outputs, _ = _run(mgr, [Request("big", list(range(1, 9)), SamplingParams(max_tokens=100))])
    out = outputs["big"].outputs[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert len(out.token_ids) == 28 - 8 + 1  # the last token needs no KV slot of its own


def test_a_recomputed_request_that_outgrew_the_watermark_finishes_at_readmission(
    make_manager,
) -> None:
    # 10 usable blocks, 2 kept free at admission: a sequence of more than 8 blocks can
    # grow while running but can never be admitted again after a recompute.
    mgr = make_manager(11, 4, watermark=0.2)
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request("small", [1, 2, 3], SamplingParams(max_tokens=20), 0.0))
    sched.add_request(Request("big", list(range(10, 38)), SamplingParams(max_tokens=40), 1.0))
    outputs, _ = run_to_completion(sched, check=mgr.check_invariants)
    assert sched.stats()["num_preemptions_recompute"] >= 1
    assert len(outputs["small"].outputs[0].token_ids) == 20
    big = outputs["big"].outputs[0]
    assert big.finish_reason == FinishReason.LENGTH and 0 < len(big.token_ids) < 40
    assert len(mgr) == 0


def test_a_prefill_chunk_that_cannot_get_blocks_waits_then_is_recomputed(make_manager) -> None:
    # 5 usable blocks (20 tokens), 2 tokens per step: "b" is admitted while it fits, then
    # "a"'s decodes take the free blocks, b's next chunk cannot allocate and b waits until
    # the decode phase preempts it (recompute); both finish with the unpressured tokens.
    reqs = [
        Request("a", [1, 2, 3], SamplingParams(max_tokens=30), 0.0),
        Request("b", list(range(50, 62)), SamplingParams(max_tokens=5), 1.0),
    ]
    _, roomy, _ = _run(make_manager(64, 4), reqs, max_num_batched_tokens=2)
    sched, tight, _ = _run(make_manager(6, 4, watermark=0.0), reqs, max_num_batched_tokens=2)
    assert sched.stats()["num_preemptions_recompute"] >= 1
    assert tokens_of(tight)["b"] == tokens_of(roomy)["b"]
    a_tokens = tokens_of(tight)["a"][0]
    assert len(a_tokens) == 20 - 3 + 1  # "a" alone fills the pool, then stops
    assert a_tokens == tokens_of(roomy)["a"][0][: len(a_tokens)]


def test_a_budget_cut_never_splits_a_forked_request(make_manager) -> None:
    mgr = make_manager(128, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=5))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6, n=3), 0.0))
    sched.add_request(Request("b", [4, 5, 6], SamplingParams(max_tokens=6, beam_width=3), 1.0))
    outputs, steps = run_to_completion(sched, check=mgr.check_invariants)
    for step in steps:
        decode_reqs = [r for r, c in zip(step.sample_request_ids, step.sample_counts, strict=True)][
            : step.num_decode_seqs
        ]
        for rid in set(decode_reqs):
            assert decode_reqs.count(rid) in (0, 3) or len(outputs[rid].outputs) < 3
    assert len(outputs["a"].outputs) == 3 and len(outputs["b"].outputs) == 1


def test_memory_ops_is_the_one_protocol(make_manager) -> None:
    """Swaps and copies of every step come through the manager's one journal, in issue
    order, with or without a host tier and on the reference manager too; the per-kind
    arrays are read-only views of it."""
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=12, n=2)  # forks: copy-on-writes
    reqs = [Request(f"r{i}", rng.integers(1, 90, 5 + 3 * i), params) for i in range(4)]
    sched, _, steps = _run(
        make_manager(14, 4, num_cpu_blocks=64, watermark=0.0), reqs, preemption_mode="swap"
    )
    assert sched.stats()["num_preemptions_swap"] > 0
    kinds = {kind for s in steps for kind, _ in s.memory_ops}
    assert {"copy", "swap_out", "swap_in"} <= kinds
    for s in steps:
        for name, kind in (
            ("blocks_to_swap_out", "swap_out"),
            ("blocks_to_swap_in", "swap_in"),
            ("blocks_to_copy", "copy"),
        ):
            runs = [np.asarray(p).reshape(-1, 2) for k, p in s.memory_ops if k == kind]
            want = np.concatenate(runs) if runs else np.zeros((0, 2), np.int64)
            np.testing.assert_array_equal(getattr(s, name), want)
    with pytest.raises(AttributeError):
        steps[0].blocks_to_copy = np.zeros((1, 2), np.int64)  # type: ignore[misc]
