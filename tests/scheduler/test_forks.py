"""Parallel sampling (n > 1) and beam search through fork + copy-on-write."""

from __future__ import annotations

import numpy as np
from sched_fake_model import VOCAB, fake_step, next_tokens, run_to_completion, tokens_of

from kvblocks.scheduler import FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig
from kvblocks.scheduler.beam import beam_score


def test_parallel_sampling_draws_n_from_the_prompt_row_then_forks(make_manager) -> None:
    mgr = make_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig())
    prompt = [3, 1, 4, 1, 5, 9]  # 6 tokens: the last block is half full and gets shared
    sched.add_request(Request("par", prompt, SamplingParams(max_tokens=5, n=3, seed=11)))
    out = sched.schedule()
    assert out.sample_counts.tolist() == [3] and out.seeds.tolist() == [11]
    assert out.sample_seq_index.tolist() == [0]
    sched.update(out, fake_step(out))
    out = sched.schedule()
    assert out.num_decode_seqs == 3 and len(set(out.seq_ids.tolist())) == 3
    index_of = dict(zip(out.sample_seq_ids.tolist(), out.sample_seq_index.tolist(), strict=True))
    assert sorted(index_of.values()) == [0, 1, 2]
    # Sequence i continues from the i-th token drawn at the prompt row.
    last_input = dict(zip(out.seq_ids.tolist(), out.input_token_ids.tolist(), strict=True))
    drawn = next_tokens(np.array(9), np.array(5), np.arange(3)).tolist()
    assert all(last_input[seq] == drawn[i] for seq, i in index_of.items())
    # The three sequences shared the half-full block; two of them got copies of it.
    assert out.blocks_to_copy.shape == (2, 2)
    src = set(out.blocks_to_copy[:, 0].tolist())
    assert len(src) == 1 and not src & set(out.blocks_to_copy[:, 1].tolist())
    # memory_ops carries every move of the step, not only steps that swap.
    assert [kind for kind, _ in out.memory_ops] == ["copy"]
    assert out.memory_ops[0][1].tolist() == out.blocks_to_copy.tolist()
    assert len({tuple(row) for row in out.block_tables[:, :2].tolist()}) == 3
    assert len(set(out.block_tables[:, 0].tolist())) == 1  # the full first block stays shared
    sched.update(out, fake_step(out))
    outputs, _ = run_to_completion(sched, check=mgr.check_invariants)
    result = outputs["par"]
    assert [c.index for c in result.outputs] == [0, 1, 2]
    firsts = [c.token_ids[0] for c in result.outputs]
    assert firsts == next_tokens(np.array(9), np.array(5), np.arange(3)).tolist()
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in result.outputs)
    assert len(mgr) == 0


def _reference_beam_search(prompt: list[int], width: int, max_tokens: int, eos: int, n: int):
    """Beam search over the fake model's top-K, written independently of the scheduler."""
    k = 2 * width
    beams = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for step in range(max_tokens):
        cands = []
        for tokens, cum in beams:
            last = (prompt + tokens)[-1]
            pos = len(prompt) + len(tokens) - 1
            for j in range(k):
                tok = (last * 31 + pos * 7 + j * 11 + 5) % VOCAB
                lp = float(np.float32(-(j + 1) * 0.25 - (last % 3) * 0.05))
                cands.append((cum + lp, tokens, tok))
        order = sorted(range(len(cands)), key=lambda i: -cands[i][0])
        new = []
        for i in order:
            score, tokens, tok = cands[i]
            if tok == eos:
                done.append(([*tokens, tok], score, "eos"))
            else:
                new.append(([*tokens, tok], score))
                if len(new) == width:
                    break
        if len(done) >= width:
            break
        if step + 1 == max_tokens:
            done += [(t, s, "length") for t, s in new]
            break
        beams = new
    done.sort(key=lambda d: -beam_score(d[1], len(d[0]), 1.0))
    return done[:n]


def test_beam_search_matches_an_independent_reference(make_manager) -> None:
    prompt = [10, 20, 30, 40, 50]
    # Pick an EOS that some beam meets, so finished hypotheses are exercised too.
    eos = (50 * 31 + 4 * 7 + 3 * 11 + 5) % VOCAB
    params = SamplingParams(max_tokens=6, beam_width=3, n=2)
    expected = _reference_beam_search(prompt, 3, 6, eos, 2)
    for pool in ((128, 0), (12, 64)):  # roomy, then tight with swapping
        mgr = make_manager(pool[0], 4, num_cpu_blocks=pool[1], watermark=0.0)
        sched = Scheduler(mgr, SchedulerConfig())
        sched.add_request(Request("beam", prompt, params, eos_token_id=eos))
        sched.add_request(Request("other", [7, 7, 7, 7, 7], SamplingParams(max_tokens=12)))
        outputs, steps = run_to_completion(sched)
        got = outputs["beam"].outputs
        assert [(c.token_ids, c.finish_reason) for c in got] == [(t, r) for t, _, r in expected]
        assert np.allclose([c.cumulative_logprob for c in got], [s for _, s, _ in expected])
        assert any(s.beam_topk == 6 for s in steps)
        beam_rows = [s for s in steps if s.beam_topk]
        assert all(
            (s.sample_counts[np.isin(s.sample_request_ids, ["beam"])] == 0).all() for s in beam_rows
        )
        assert len(mgr) == 0


def test_beam_search_stops_at_max_tokens_and_ranks_by_score(rust_manager) -> None:
    sched = Scheduler(rust_manager(64, 4), SchedulerConfig())
    sched.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=4, beam_width=4, n=4)))
    outputs, _ = run_to_completion(sched)
    outs = outputs["b"].outputs
    assert len(outs) == 4 and all(len(c.token_ids) == 4 for c in outs)
    assert all(c.finish_reason == FinishReason.LENGTH for c in outs)
    scores = [c.cumulative_logprob for c in outs]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in outs}) == 4


def test_beam_search_with_an_extreme_length_penalty_finishes(rust_manager) -> None:
    """length ** length_penalty beyond a float (1e308, 2000) raised OverflowError, and
    its underflow to 0 (-2000) ZeroDivisionError, in the middle of update, leaving the
    request unfinished; the score is now the float the quotient rounds to."""
    assert beam_score(-1.0, 2, 2000.0) == 0.0 and beam_score(-1.0, 2, -2000.0) == -np.inf
    assert beam_score(0.0, 2, -2000.0) == 0.0 and beam_score(-3.0, 3, 1.0) == -1.0
    for penalty in (1e308, 2000.0, -2000.0):
        sched = Scheduler(rust_manager(64, 4), SchedulerConfig())
        params = SamplingParams(max_tokens=4, beam_width=2, length_penalty=penalty)
        sched.add_request(Request("b", [1, 2, 3], params))
        outputs, _ = run_to_completion(sched)
        assert len(outputs["b"].outputs[0].token_ids) == 4
        assert not sched.has_unfinished_requests()


def test_forked_requests_give_the_same_tokens_with_and_without_pressure(make_manager) -> None:
    reqs = [
        Request("n2", [5, 6, 7, 8, 9], SamplingParams(max_tokens=10, n=2)),
        Request("beam", [9, 8, 7], SamplingParams(max_tokens=8, beam_width=2)),
        Request("one", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=14)),
    ]
    results = []
    for blocks, cpu in ((256, 0), (9, 128)):
        mgr = make_manager(blocks, 4, num_cpu_blocks=cpu, watermark=0.0)
        sched = Scheduler(mgr, SchedulerConfig())
        for r in reqs:
            sched.add_request(r)
        outputs, _ = run_to_completion(sched)
        results.append((tokens_of(outputs), sched.stats()["num_preemptions_swap"]))
    assert results[0][0] == results[1][0]
    assert results[0][1] == 0 and results[1][1] > 0  # forked sequences were swapped out
