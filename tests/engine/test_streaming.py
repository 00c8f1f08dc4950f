"""LLM streaming: stream == generate, deltas add up, stop strings across token
boundaries, min_tokens, per-token logprobs against the model's log-softmax, priorities,
abort from inside a stream."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch

from kvblocks.engine import LLM
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import FinishReason

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5] * 20]


class PairTokenizer:
    """Token t decodes to two letters; no ``decode_stream`` (the generic incremental path)."""

    def encode(self, text: str) -> list[int]:
        return [(ord(text[i]) - 97) * 26 + ord(text[i + 1]) - 97 for i in range(0, len(text), 2)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(97 + t // 26 % 26) + chr(97 + t % 26) for t in token_ids)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_blocks=96, block_size=8, device="cpu")


@pytest.fixture(scope="module")
def pair_llm() -> LLM:
    return LLM(num_blocks=96, block_size=8, device="cpu", tokenizer=PairTokenizer())


def _collect(records) -> tuple[dict, dict, dict]:
    """Concatenated deltas per (request, index), and the final records by request."""
    tokens: dict = defaultdict(list)
    texts: dict = defaultdict(str)
    final: dict = {}
    for rec in records:
        assert rec.request_id not in final, "a record after the final one"
        for c in rec.outputs:
            tokens[rec.request_id, c.index].extend(c.new_token_ids)
            texts[rec.request_id, c.index] += c.new_text or ""
            assert c.token_ids == tokens[rec.request_id, c.index]
            if c.text is not None:
                assert c.text == texts[rec.request_id, c.index]
        if rec.finished:
            final[rec.request_id] = rec
    return tokens, texts, final


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0.0),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=3),
        SamplingParams(max_tokens=6, beam_width=3, n=2),
    ],
    ids=["greedy", "n3-seeded", "beam"],
)
def test_stream_equals_generate(llm: LLM, params: SamplingParams) -> None:
    expected = llm.generate(PROMPTS, params)
    records = list(llm.stream(PROMPTS, params))
    tokens, texts, final = _collect(records)
    got = [final[r.request_id] for r in sorted(final.values(), key=lambda r: r.prompt_index)]
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert [[c.text for c in o.outputs] for o in got] == [
        [c.text for c in o.outputs] for o in expected
    ]
    for o in got:
        for c in o.outputs:
            assert tokens[o.request_id, c.index] == c.token_ids
            assert texts[o.request_id, c.index] == c.text
    if params.beam_width == 1:
        # Streaming really is incremental: many records per request.
        assert len(records) > 3 * len(PROMPTS)
    assert llm.generate(PROMPTS, params, stream=True) is not None


def test_generate_stream_true_is_the_stream(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    stream = llm.generate([[1, 2]], params, stream=True)
    records = list(stream)
    assert len(records) == 4 and records[-1].finished
    assert [len(r.outputs[0].new_token_ids) for r in records] == [1, 1, 1, 1]


def test_metrics_in_outputs(llm: LLM) -> None:
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0))
    m = out.metrics
    assert m is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_generated_tokens == 5 and m.time_per_output_token is not None
    stats = llm.stats()["scheduler"]
    assert stats["ttft_mean_s"] > 0 and isinstance(stats["num_steps"], int)


@pytest.mark.parametrize("tokenizer", ["pair", "byte"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(
    llm: LLM, pair_llm: LLM, tokenizer: str, include: bool
) -> None:
    engine = pair_llm if tokenizer == "pair" else llm
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [1, 2, 3] if tokenizer == "pair" else [65, 66, 67]
    (base,) = engine.generate([prompt], greedy)
    text = base.text
    assert text is not None and engine.tokenizer is not None
    if tokenizer == "pair":
        start = 2 * 4 + 1  # the last letter of token 4 and the first of token 5
        stop = text[start : start + 2]
        assert text.find(stop) == start, "pick a stop string that occurs first there"
    else:
        # Byte tokens: a two-character ASCII stop string spans two tokens.
        for start in range(2, len(text) - 1):
            stop = text[start : start + 2]
            if text.find(stop) == start and stop.isascii():
                break
        else:
            pytest.skip("no ASCII pair in the greedy output")
    # The token that completes the stop string.
    last_token = next(
        k
        for k in range(len(base.token_ids))
        if stop in engine.tokenizer.decode(base.token_ids[: k + 1])
    )
    assert stop not in engine.tokenizer.decode(base.token_ids[:last_token])
    assert stop[0] in engine.tokenizer.decode(base.token_ids[:last_token])[start:]
    params = SamplingParams(
        max_tokens=16,
        temperature=0.0,
        ignore_eos=True,
        stop=("zzzzzzzz", stop),
        include_stop_str_in_output=include,
    )
    aborted_before = engine.stats()["scheduler"]["num_requests_aborted"]
    records = list(engine.stream([prompt], params))
    _, texts, final = _collect(records)
    (out,) = final.values()
    c = out.outputs[0]
    assert c.finish_reason == FinishReason.STOP and c.stop_reason == stop
    assert c.text == text[: start + (len(stop) if include else 0)]
    assert c.token_ids == base.token_ids[: last_token + 1]
    assert texts[out.request_id, 0] == c.text  # nothing streamed had to be taken back
    (again,) = engine.generate([prompt], params)
    assert again.text == c.text and again.token_ids == c.token_ids
    # A stop string ends the request as finished, not aborted, in the scheduler.
    assert engine.stats()["scheduler"]["num_requests_aborted"] == aborted_before


def test_stop_string_on_one_of_n_samples(pair_llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True)
    (base,) = pair_llm.generate([[4, 5, 6]], params)
    first = base.outputs[0].text
    stop = first[5:8]
    assert stop not in base.outputs[1].text[: len(base.outputs[1].text)]
    generated_before = pair_llm.stats()["scheduler"]["num_generated_tokens"]
    (out,) = pair_llm.generate([[4, 5, 6]], SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    # The stopped sample stopped decoding too (Scheduler.finish_sequence), not only its text.
    generated = pair_llm.stats()["scheduler"]["num_generated_tokens"] - generated_before
    assert generated == sum(len(c.token_ids) for c in out.outputs)
    assert out.outputs[0].finish_reason == FinishReason.STOP
    assert out.outputs[0].text == first[: first.find(stop)]
    assert out.outputs[1].token_ids == base.outputs[1].token_ids
    assert out.outputs[1].finish_reason == FinishReason.LENGTH


def test_min_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (base,) = llm.generate([[7, 7, 7]], greedy)
    stop_tok = base.token_ids[1]
    first = base.token_ids.index(stop_tok)
    common = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    (early,) = llm.generate([[7, 7, 7]], SamplingParams(**common, stop_token_ids=(stop_tok,)))
    assert early.token_ids == base.token_ids[: first + 1]
    assert early.outputs[0].stop_reason == stop_tok
    params = SamplingParams(**common, stop_token_ids=(stop_tok,), min_tokens=first + 3)
    (late,) = llm.generate([[7, 7, 7]], params)
    assert len(late.token_ids) >= first + 3
    # vLLM's rule: below min_tokens the stop token is masked out of the logits, so greedy
    # takes the next best token where it would have drawn it (not: draws it and goes on).
    assert late.token_ids[:first] == base.token_ids[:first]
    assert stop_tok not in late.token_ids[: first + 3]


def test_min_tokens_holds_back_stop_strings(pair_llm: LLM) -> None:
    common = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    (base,) = pair_llm.generate([[7, 7, 7]], SamplingParams(**common))
    stop = base.text[2:4]  # the second token's text
    (early,) = pair_llm.generate([[7, 7, 7]], SamplingParams(**common, stop=(stop,)))
    assert len(early.token_ids) <= 2 and early.finish_reason == FinishReason.STOP
    (late,) = pair_llm.generate([[7, 7, 7]], SamplingParams(**common, stop=(stop,), min_tokens=6))
    assert len(late.token_ids) >= 6
    assert late.token_ids == base.token_ids[: len(late.token_ids)]


def test_min_tokens_ignores_a_stop_string_completed_before_it(pair_llm: LLM) -> None:
    # A stop string that a token before min_tokens completed can no longer end the
    # sequence (vLLM's rule: only text added from the min_tokens-th token on is searched),
    # even when it still sits in the text held back from the stream.
    common = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    (base,) = pair_llm.generate([[7, 7, 7]], SamplingParams(**common))
    # Three letters ending with token m - 1 (two letters a token): held back at token m.
    m, stop = next(
        (m, base.text[2 * m - 5 : 2 * m - 2])
        for m in range(4, 12)
        if base.text.count(base.text[2 * m - 5 : 2 * m - 2]) == 1
    )
    (late,) = pair_llm.generate([[7, 7, 7]], SamplingParams(**common, stop=(stop,), min_tokens=m))
    assert late.token_ids == base.token_ids
    assert late.text == base.text
    assert late.finish_reason == FinishReason.LENGTH and late.outputs[0].stop_reason is None


def test_logprobs_match_the_models_log_softmax(llm: LLM) -> None:
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=11, logprobs=4)
    outs = llm.generate(prompts, params)  # one batch: rows must map to their requests
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
        full = torch.tensor([prompt + c.token_ids[:-1]])
        logp = torch.log_softmax(dense_logits(llm.model, full)[0], dim=-1)
        for i, entry in enumerate(c.logprobs):
            row = logp[len(prompt) - 1 + i]
            assert entry.token_id == c.token_ids[i]
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
            top = torch.topk(row, 4)
            assert entry.top_token_ids == top.indices.tolist()
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        total = sum(e.logprob for e in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
    (plain,) = llm.generate([prompts[0]], SamplingParams(max_tokens=2))
    assert plain.outputs[0].logprobs is None
    (zero,) = llm.generate([prompts[0]], SamplingParams(max_tokens=3, logprobs=0))
    entries = zero.outputs[0].logprobs
    assert entries is not None and [e.top_token_ids for e in entries] == [[], [], []]
    assert sum(e.logprob for e in entries) == pytest.approx(zero.outputs[0].cumulative_logprob)


def test_logprobs_per_sample_with_n(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, n=3, logprobs=1)
    (out,) = llm.generate([[8, 9]], params)
    for c in out.outputs:
        assert [e.token_id for e in c.logprobs] == c.token_ids
        assert all(e.logprob <= e.top_logprobs[0] + 1e-6 for e in c.logprobs)


def test_priority_orders_admission() -> None:
    engine = LLM(num_blocks=64, block_size=8, device="cpu", policy="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = engine.generate([[1, 2], [3, 4], [5, 6]], params, priority=[3, 1, 2])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
    outs = engine.generate([[1, 2], [3, 4], [5, 6]], params)  # all 0: arrival order
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [0, 1, 2]
    with pytest.raises(InvalidArgumentError):
        engine.generate([[1, 2]], params, priority=[1, 2])
    with pytest.raises(InvalidArgumentError):
        engine.generate([[1, 2]], params, priority="high")  # type: ignore[arg-type]


def test_abort_from_inside_the_stream(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = llm.generate(PROMPTS, params)
    records = []
    victim = returned = None
    for rec in llm.stream(PROMPTS, params):
        if returned is not None and rec.request_id == victim:
            assert rec is returned  # the abort's answer is the stream's next record for it
        records.append(rec)
        if victim is None and rec.prompt_index == 1 and len(rec.outputs[0].token_ids) >= 3:
            victim = rec.request_id
            returned = llm.abort_request(victim)
            assert returned is not None and returned.finished
            assert llm.abort_request(victim) is None  # already aborted
    _, _, final = _collect(records)
    assert final[victim] is returned
    assert set(final) == {r.request_id for r in records}
    aborted = final[victim]
    assert aborted.outputs[0].finish_reason == FinishReason.ABORT
    assert aborted.outputs[0].token_ids == expected[1].token_ids[:3]
    others = [o for o in final.values() if o.request_id != victim]
    assert sorted(o.token_ids for o in others) == sorted(expected[i].token_ids for i in (0, 2))
    assert llm.abort_request("no-such-request") is None


def test_abort_of_another_request_is_the_streams_next_record(llm: LLM) -> None:
    # Aborting request 1 while reading request 0's record of a step: the abort's record
    # comes next, before request 2's record of that step (docs/engine.md).
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = llm.generate(PROMPTS, params)
    returned = None
    after = []
    for rec in llm.stream(PROMPTS, params):
        if returned is not None:
            after.append(rec)
        if returned is None and rec.prompt_index == 0 and len(rec.outputs[0].token_ids) == 3:
            victim = str(int(rec.request_id) + 1)
            returned = llm.abort_request(victim)
    assert returned is not None and after[0] is returned
    assert returned.outputs[0].finish_reason == FinishReason.ABORT
    assert returned.outputs[0].token_ids == expected[1].token_ids[: len(returned.token_ids)]
    finals = {r.prompt_index: r for r in after if r.finished}
    assert [finals[i].token_ids for i in (0, 2)] == [expected[i].token_ids for i in (0, 2)]


def test_abort_keeps_the_tokens_its_step_generated(llm: LLM) -> None:
    # Request 1 drew its third token in the step whose record of request 0 aborts it,
    # before its own record of that step was yielded: the abort's record still has the
    # token (the scheduler generated it; its cumulative log-prob counts it).
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    expected = llm.generate(PROMPTS, params)
    returned = None
    for rec in llm.stream(PROMPTS, params):
        if returned is None and rec.prompt_index == 0 and len(rec.outputs[0].token_ids) == 3:
            returned = llm.abort_request(str(int(rec.request_id) + 1))
    assert returned is not None
    (aborted,) = returned.outputs
    assert aborted.token_ids == expected[1].token_ids[:3]
    assert aborted.finish_reason == FinishReason.ABORT
    assert aborted.logprobs is not None
    assert [e.logprob for e in aborted.logprobs] == pytest.approx(
        [e.logprob for e in expected[1].outputs[0].logprobs[:3]], abs=1e-5
    )
    seq = torch.tensor([PROMPTS[1] + aborted.token_ids])
    lps = torch.log_softmax(dense_logits(llm.model, seq)[0].float(), -1)
    want = sum(float(lps[len(PROMPTS[1]) - 1 + j, t]) for j, t in enumerate(aborted.token_ids))
    assert aborted.cumulative_logprob == pytest.approx(want, abs=1e-4)


def test_abort_refuses_a_request_id_that_is_not_a_string(llm: LLM) -> None:
    # An unhashable id raised a bare TypeError from the call's dict of runs.
    params = SamplingParams(max_tokens=4, temperature=0.0)
    stream = llm.stream(PROMPTS, params)
    first = next(stream)
    for bad in (["x"], {"x": 1}, 1):
        with pytest.raises(InvalidArgumentError):
            llm.abort_request(bad)  # type: ignore[arg-type]
    records = [first, *stream]
    assert all(r.outputs[0].finish_reason != FinishReason.ABORT for r in records if r.finished)
    assert not llm.scheduler.has_unfinished_requests()


def test_leaving_a_stream_early_leaves_the_engine_idle(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    stream = llm.stream(PROMPTS, params)
    next(stream)
    with pytest.raises(InvalidArgumentError):
        llm.generate(PROMPTS, params)  # one call at a time
    stream.close()
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.manager) == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_bad_new_parameters_raise() -> None:
    for kwargs in [
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 2},
        {"logprobs": -2},
        {"logprobs": 2, "beam_width": 2},
        # Beams end on tokens only: a stop string cut their text but kept every token.
        {"stop": ["ab"], "beam_width": 2},
        {"stop": [3]},
        {"stop": [""]},
        {"include_stop_str_in_output": "yes"},
    ]:
        with pytest.raises(InvalidArgumentError):
            SamplingParams(**kwargs)


def test_stream_checks_the_schedulers_limits_before_the_first_record() -> None:
    """``stream()`` promises its arguments are checked when it is called; a request of more
    sequences than a step holds was refused only once iteration started (by the
    scheduler's ``add_request``)."""
    engine = LLM(num_blocks=64, block_size=8, device="cpu", max_num_seqs=2)
    params = SamplingParams(max_tokens=2, n=3, temperature=1.0)
    with pytest.raises(InvalidArgumentError, match="sequences at once"):
        engine.stream([[1, 2, 3]], params)
    with pytest.raises(InvalidArgumentError, match="sequences at once"):
        engine.generate([[1, 2, 3]], params)
    ok = SamplingParams(max_tokens=2, temperature=0.0)
    assert len(engine.generate([[1, 2, 3]], ok)[0].token_ids) == 2


def test_incremental_detokenizer_paths() -> None:
    text = "héllo wörld ✓"
    ids = list(text.encode())
    for tok in (ByteTokenizer(), _NoStreamBytes()):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.step([t]) for t in ids]
        assert "".join(pieces) + detok.flush() == text
        assert all("\ufffd" not in p for p in pieces)


class _NoStreamBytes:
    """Bytes without ``decode_stream``: the window-decoding fallback."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return ByteTokenizer().decode(token_ids)
