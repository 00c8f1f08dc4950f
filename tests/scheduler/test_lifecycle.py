"""Stop conditions, abort, bad input and the schedule/update protocol."""

from __future__ import annotations

import numpy as np
import pytest
from sched_fake_model import fake_step, run_to_completion

from kvblocks import (
    DuplicateSequenceError,
    InvalidArgumentError,
    KVBlocksError,
    SequenceStateError,
)
from kvblocks.scheduler import (
    FinishReason,
    ModelStepResult,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

PROMPT = [11, 22, 33, 44, 55]


def _generate(make_manager, **kwargs) -> list[int]:
    eos = kwargs.pop("eos_token_id", None)
    sched = Scheduler(make_manager(64, 4), SchedulerConfig())
    sched.add_request(Request("r", PROMPT, SamplingParams(**kwargs), eos_token_id=eos))
    outputs, _ = run_to_completion(sched)
    out = outputs["r"].outputs[0]
    return out.token_ids, out.finish_reason


def test_max_tokens_eos_stop_tokens_and_ignore_eos(make_manager) -> None:
    free_run, reason = _generate(make_manager, max_tokens=8)
    assert len(free_run) == 8 and reason == FinishReason.LENGTH
    target = free_run[3]
    assert target not in free_run[:3]
    tokens, reason = _generate(make_manager, max_tokens=8, eos_token_id=target)
    assert tokens == free_run[:4] and reason == FinishReason.EOS  # EOS kept in the output
    tokens, reason = _generate(make_manager, max_tokens=8, stop_token_ids=(999, target))
    assert tokens == free_run[:4] and reason == FinishReason.STOP
    tokens, reason = _generate(make_manager, max_tokens=8, eos_token_id=target, ignore_eos=True)
    assert tokens == free_run and reason == FinishReason.LENGTH
    tokens, reason = _generate(make_manager, max_tokens=1)
    assert tokens == free_run[:1] and reason == FinishReason.LENGTH


def test_abort_in_every_state_releases_everything(make_manager) -> None:
    mgr = make_manager(64, 4, num_cpu_blocks=16)
    sched = Scheduler(mgr, SchedulerConfig(max_num_seqs=2))
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=50)))
    out = sched.schedule()
    sched.update(out, fake_step(out))
    out = sched.schedule()
    sched.update(out, fake_step(out))
    waiting = sched.abort_request("c")
    assert waiting.outputs[0].token_ids == [] and waiting.outputs[0].finish_reason == "abort"
    running = sched.abort_request("a")
    assert len(running.outputs[0].token_ids) == 2 and running.finished
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    out = sched.schedule()
    assert set(out.finished_request_ids) == {"a", "c"}
    in_flight = sched.abort_request("b")  # between schedule() and update()
    # b waited one step for a's prompt block (same-step prefix sharing): one token so far
    assert len(in_flight.outputs[0].token_ids) == 1
    assert sched.update(out, fake_step(out)).finished == []
    assert not sched.has_unfinished_requests()
    assert len(mgr) == 0 and mgr.num_free_blocks() == 63
    assert sched.schedule().finished_request_ids == ["b"]
    assert sched.stats()["num_requests_aborted"] == 3


def test_bad_requests_raise_and_leave_the_scheduler_unchanged(make_manager) -> None:
    mgr = make_manager(8, 4)  # 7 usable blocks: 28 tokens
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request("a", PROMPT))
    with pytest.raises(DuplicateSequenceError):
        sched.add_request(Request("a", [1]))
    with pytest.raises(InvalidArgumentError, match="needs more blocks"):
        sched.add_request(Request("huge", list(range(40))))
    with pytest.raises(InvalidArgumentError):
        sched.add_request(("b", [1, 2]))  # type: ignore[arg-type]
    narrow = Scheduler(mgr, SchedulerConfig(max_num_seqs=4))
    with pytest.raises(InvalidArgumentError, match="sequences at once"):
        narrow.add_request(Request("wide", PROMPT, SamplingParams(beam_width=5)))
    assert sched.num_unfinished_requests() == 1 and len(mgr) == 0
    outputs, _ = run_to_completion(sched)
    assert list(outputs) == ["a"]
    with pytest.raises(InvalidArgumentError):
        Scheduler(mgr, {"policy": "fcfs"})  # type: ignore[arg-type]


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 2**70])
def test_a_priority_outside_int64_is_refused(make_manager, priority: int) -> None:
    """The decode table keeps priorities as int64: 2**70 was accepted and raised
    OverflowError inside update(), losing the request mid-step."""
    with pytest.raises(InvalidArgumentError, match="priority"):
        Request("a", PROMPT, priority=priority)
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(policy="priority"))
    for i, edge in enumerate((2**63 - 1, -(2**63))):
        sched.add_request(Request(f"edge{i}", PROMPT, SamplingParams(max_tokens=2), priority=edge))
    outputs, _ = run_to_completion(sched)
    assert sorted(outputs) == ["edge0", "edge1"]


def test_schedule_update_protocol_is_enforced(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig())
    sched.add_request(Request("a", PROMPT, SamplingParams(max_tokens=3)))
    out = sched.schedule()
    with pytest.raises(SequenceStateError):
        sched.schedule()
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        sched.update(out, ModelStepResult(np.zeros(5, np.int64)))
    with pytest.raises(SequenceStateError):
        sched.update(sched_output_copy(out), fake_step(out))
    sched.update(out, fake_step(out))  # the failed calls changed nothing
    with pytest.raises(SequenceStateError):
        sched.update(out, fake_step(out))
    outputs, _ = run_to_completion(sched)
    assert len(outputs["a"].outputs[0].token_ids) == 3


def sched_output_copy(out):
    """A SchedulerOutput equal to ``out`` but not the one the scheduler handed out."""
    import dataclasses

    return dataclasses.replace(out)


def test_beam_rows_require_top_k(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig())
    sched.add_request(Request("b", PROMPT, SamplingParams(beam_width=2)))
    out = sched.schedule()
    with pytest.raises(InvalidArgumentError, match="topk"):
        sched.update(out, ModelStepResult(np.zeros(0, np.int64)))
    sched.update(out, fake_step(out))


def _bad_tokens(tokens: np.ndarray, how: str) -> object:
    """``tokens`` (int64) made hostile: each was cast or taken as a token before."""
    return {
        "float": tokens + 0.5,  # truncated to the token below
        "nan": np.full(tokens.shape, np.nan),
        "bool": tokens > 0,  # taken as 0 and 1
        "str": tokens.astype(str),  # parsed
        "object": tokens.astype(object),
        "negative": -np.ones_like(tokens),  # -1 is "no token": the step's KV was lost
        # Narrower and extreme negatives (the range check reads them as unsigned).
        "negative int32": -np.ones(tokens.shape, np.int32),
        "negative int8": np.full(tokens.shape, -128, np.int8),
        "int64 min": np.full(tokens.shape, -(2**63), np.int64),
        "2**32": np.full_like(tokens, 2**32),  # the manager refused it mid-update
        "uint64 max": np.full(tokens.shape, 2**64 - 1, np.uint64),  # wrapped to -1
    }[how]


HOSTILE_TOKENS = ["float", "nan", "bool", "str", "object", "negative", "2**32", "uint64 max"]
HOSTILE_TOKENS += ["negative int32", "negative int8", "int64 min"]


@pytest.mark.parametrize("how", HOSTILE_TOKENS)
def test_hostile_sampled_tokens_are_refused_and_change_nothing(make_manager, how: str) -> None:
    def start() -> Scheduler:
        sched = Scheduler(make_manager(64, 4), SchedulerConfig())
        sched.add_request(Request("a", PROMPT, SamplingParams(max_tokens=3)))
        sched.add_request(Request("n", PROMPT[:3], SamplingParams(max_tokens=3, n=2)))
        return sched

    sched, twin = start(), start()
    out = sched.schedule()
    good = fake_step(out)
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        sched.update(out, ModelStepResult(_bad_tokens(good.sampled_token_ids, how)))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="sampled_logprobs"):
        sched.update(out, ModelStepResult(good.sampled_token_ids, np.full(3, "x")))  # type: ignore[arg-type]
    sched.update(out, good)
    twin_out = twin.schedule()
    twin.update(twin_out, fake_step(twin_out))
    got, want = run_to_completion(sched)[0], run_to_completion(twin)[0]
    assert {k: [c.token_ids for c in v.outputs] for k, v in got.items()} == {
        k: [c.token_ids for c in v.outputs] for k, v in want.items()
    }


@pytest.mark.parametrize(
    "how", [*HOSTILE_TOKENS, "1-D", "no rows", "logprobs' shape", "no K", "2K"]
)
def test_hostile_beam_top_k_is_refused_and_changes_nothing(make_manager, how: str) -> None:
    def start() -> Scheduler:
        sched = Scheduler(make_manager(64, 4), SchedulerConfig())
        sched.add_request(Request("b", PROMPT, SamplingParams(beam_width=2, max_tokens=3)))
        return sched

    sched, twin = start(), start()
    out = sched.schedule()
    good = fake_step(out)
    assert good.topk_token_ids is not None and good.topk_logprobs is not None
    ids, lps = good.topk_token_ids, good.topk_logprobs
    bad = {
        "1-D": (ids.reshape(-1), lps.reshape(-1)),
        "no rows": (ids[:0], lps[:0]),
        "logprobs' shape": (ids, lps[:, :1]),
        "no K": (ids[:, :0], lps[:, :0]),
        "2K": (np.concatenate([ids, ids], 1), np.concatenate([lps, lps], 1)),
    }.get(how) or (_bad_tokens(ids, how), lps)
    with pytest.raises(InvalidArgumentError, match="topk_"):
        sched.update(out, ModelStepResult(good.sampled_token_ids, None, *bad))  # type: ignore[arg-type]
    sched.update(out, good)
    twin_out = twin.schedule()
    twin.update(twin_out, fake_step(twin_out))
    got, want = run_to_completion(sched)[0], run_to_completion(twin)[0]
    assert [c.token_ids for c in got["b"].outputs] == [c.token_ids for c in want["b"].outputs]


@pytest.mark.parametrize(
    "result",
    [
        None,
        np.zeros(3, np.int64),
        [7, 7, 7],
        ModelStepResult([1, [2]]),
        ModelStepResult([7] * 3, [1, [2]]),
    ],  # type: ignore[arg-type]
    ids=["None", "array", "list", "ragged tokens", "ragged logprobs"],
)
def test_a_result_that_is_no_result_is_refused(make_manager, result: object) -> None:
    # AttributeError ('... has no attribute sampled_token_ids') or NumPy's ValueError.
    sched = Scheduler(make_manager(64, 4), SchedulerConfig())
    sched.add_request(Request("a", PROMPT, SamplingParams(max_tokens=2, n=3)))
    out = sched.schedule()
    with pytest.raises(InvalidArgumentError, match=r"ModelStepResult|sampled_"):
        sched.update(out, result)  # type: ignore[arg-type]
    sched.update(out, fake_step(out))


@pytest.mark.parametrize("manager", [None, 3, "m", object(), np.zeros(3)])
def test_a_manager_that_is_no_manager_is_refused(manager: object) -> None:
    with pytest.raises(InvalidArgumentError, match="manager"):
        Scheduler(manager)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [np.array(["swap", "recompute"]), np.array([]), ["swap"], 1])
def test_a_preemption_mode_that_is_no_str_is_refused(mode: object) -> None:
    # An array was NumPy's "truth value is ambiguous" ValueError.
    with pytest.raises(InvalidArgumentError, match="preemption_mode"):
        SchedulerConfig(preemption_mode=mode)  # type: ignore[arg-type]


def test_errors_are_kvblocks_errors() -> None:
    assert issubclass(InvalidArgumentError, KVBlocksError)


def test_abort_of_a_swapped_request(rust_manager) -> None:
    mgr = rust_manager(12, 4, num_cpu_blocks=64, watermark=0.0)
    sched = Scheduler(mgr, SchedulerConfig())
    sched.add_request(Request("first", [1, 2, 3], SamplingParams(max_tokens=30), 0.0))
    sched.add_request(Request("fork", [4, 5, 6], SamplingParams(max_tokens=30, n=2), 1.0))
    aborted = None
    for _ in range(100):
        out = sched.schedule()
        sched.update(out, fake_step(out))
        if sched.stats()["num_swapped"]:
            aborted = sched.abort_request("fork")
            break
    assert aborted is not None and len(aborted.outputs) == 2
    assert all(c.finish_reason == "abort" and c.token_ids for c in aborted.outputs)
    outputs, _ = run_to_completion(sched)
    assert list(outputs) == ["first"] and len(outputs["first"].outputs[0].token_ids) == 30
    assert len(mgr) == 0 and mgr.num_free_cpu_blocks() == 64


def test_abort_while_prefilling_in_chunks(make_manager) -> None:
    mgr = make_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=8))
    sched.add_request(Request("long", list(range(1, 30)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    sched.update(out, fake_step(out))
    aborted = sched.abort_request("long")
    assert aborted.outputs[0].token_ids == [] and not sched.has_unfinished_requests()
    assert len(mgr) == 0 and mgr.num_free_blocks() == 63


def test_lookahead_slots_are_reserved_for_decodes(make_manager) -> None:
    mgr = make_manager(64, 4)
    sched = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=3))
    sched.add_request(Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=4)))
    out = sched.schedule()  # prefill: 4 tokens, one block
    assert (out.block_tables[0] != 0).sum() == 1
    sched.update(out, fake_step(out))
    out = sched.schedule()  # decode at position 4, plus 3 lookahead slots: positions 4..7
    assert out.positions.tolist() == [4]
    assert (out.block_tables[0] != 0).sum() == 2
    sched.update(out, fake_step(out))
    run_to_completion(sched)


def test_a_lookahead_the_pool_can_never_give_is_refused(make_manager) -> None:
    """63 usable blocks of 4 tokens (252 slots): the first decode of a one-token prompt
    holds two tokens and the lookahead, so a lookahead of 251 would stop every request at
    its first token; 250 decodes."""
    mgr = make_manager(64, 4)
    for look in (251, 2**40):
        with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens"):
            Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=look))
    sched = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=250))
    sched.add_request(Request("a", [1], SamplingParams(max_tokens=2, ignore_eos=True)))
    outputs, _ = run_to_completion(sched)
    assert len(outputs["a"].outputs[0].token_ids) == 2 and len(mgr) == 0


def test_abort_before_an_n_request_forks_returns_n_completions(make_manager) -> None:
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_batched_tokens=3))
    sched.add_request(Request("w", PROMPT, SamplingParams(n=3)))
    sched.add_request(Request("p", PROMPT, SamplingParams(n=3)))
    out = sched.schedule()  # "p" waits, "w" has its first chunk of three tokens
    sched.update(out, fake_step(out))
    for rid in ("w", "p"):
        result = sched.abort_request(rid)
        assert [c.index for c in result.outputs] == [0, 1, 2]
        assert all(c.token_ids == [] and c.finish_reason == "abort" for c in result.outputs)


def test_abort_before_a_beam_request_forks_returns_n_completions(make_manager) -> None:
    # As for n > 1 sampling: n completions (here 2 of 3 beams), the unforked ones empty.
    sched = Scheduler(make_manager(64, 4), SchedulerConfig(max_num_batched_tokens=3))
    sched.add_request(Request("w", PROMPT, SamplingParams(beam_width=3, n=2)))
    sched.add_request(Request("p", PROMPT, SamplingParams(beam_width=3, n=2)))
    out = sched.schedule()  # "p" waits, "w" has its first chunk of three tokens
    sched.update(out, fake_step(out))
    for rid in ("w", "p"):
        result = sched.abort_request(rid)
        assert [c.index for c in result.outputs] == [0, 1]
        assert all(c.token_ids == [] and c.finish_reason == "abort" for c in result.outputs)
