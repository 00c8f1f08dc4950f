"""Per-step outputs of ``Scheduler.update``: deltas add up to the final tokens, under
forks, preemption (recompute, swap, split n > 1) and aborts mid-stream."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from sched_fake_model import fake_step

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler import (
    FinishReason,
    ModelStepResult,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
)


def _requests(count: int = 6, max_tokens: int = 20, **params) -> list[Request]:
    rng = np.random.default_rng(7)
    return [
        Request(
            f"r{i}", rng.integers(1, 90, 5 + 3 * i), SamplingParams(max_tokens=max_tokens, **params)
        )
        for i in range(count)
    ]


class Stream:
    """Drives a scheduler and checks every step's records as it goes."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.deltas: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.final: dict[str, RequestOutput] = {}
        self.partial_finish: dict[tuple[str, int], FinishReason] = {}
        self.steps = 0

    def step(self) -> StepOutputs:
        out = self.sched.schedule()
        step = self.sched.update(out, fake_step(out))
        self.steps += 1
        records = list(step)
        assert [r for r in records if r.finished] == step.finished
        assert len({r.request_id for r in records}) == len(records)  # one record per request
        for record in records:
            assert record.request_id not in self.final
            assert record.metrics is not None
            for c in record.outputs:
                self.deltas[record.request_id, c.index].extend(c.new_token_ids)
                if record.finished:
                    continue
                # A running record shows what moved: a new token or a finish.
                assert c.new_token_ids or c.finished
                assert c.num_tokens == len(self.deltas[record.request_id, c.index])
                if c.finished:
                    self.partial_finish[record.request_id, c.index] = c.finish_reason
            if record.finished:
                self.final[record.request_id] = record
        return step

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished_requests():
            self.step()
            assert self.steps < max_steps

    def check_deltas(self) -> None:
        for rid, record in self.final.items():
            assert len(record.outputs) == record_n(record)
            for c in record.outputs:
                assert self.deltas[rid, c.index] == c.token_ids, (rid, c.index)
                assert c.num_tokens == len(c.token_ids)
                if (rid, c.index) in self.partial_finish:
                    assert self.partial_finish[rid, c.index] == c.finish_reason


def record_n(record: RequestOutput) -> int:
    return max(c.index for c in record.outputs) + 1


def _run(manager, requests, **cfg) -> Stream:
    sched = Scheduler(manager, SchedulerConfig(**cfg))
    for r in requests:
        sched.add_request(r)
    stream = Stream(sched)
    stream.run()
    assert set(stream.final) == {r.request_id for r in requests}
    stream.check_deltas()
    return stream


def test_single_sequence_deltas_add_up(make_manager) -> None:
    stream = _run(make_manager(256, 4), _requests())
    # Every step after the prompts streams one token per running request.
    assert all(len(v) == 20 for v in stream.deltas.values())


def test_running_records_come_every_step_not_only_at_the_end(rust_manager) -> None:
    sched = Scheduler(rust_manager(256, 4))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    seen = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        step = sched.update(out, fake_step(out))
        seen.append([(r.finished, r.outputs[0].new_token_ids) for r in step])
    tokens = [t for step in seen for (_, new) in step for t in new]
    assert [len(s) for s in seen] == [1, 1, 1, 1]
    assert [s[0][0] for s in seen] == [False, False, False, True]
    assert all(len(s[0][1]) == 1 for s in seen)
    assert len(tokens) == 4


def test_n_greater_than_one_deltas_per_index(make_manager) -> None:
    reqs = _requests(4, max_tokens=12, n=3)
    stream = _run(make_manager(256, 4), reqs)
    assert {k[1] for k in stream.deltas} == {0, 1, 2}


def test_stop_tokens_finish_some_samples_early(rust_manager) -> None:
    # Tokens of the fake model are spread over 0..96: a few stop ids end some samples
    # of an n = 4 request while the others run on (a partial finish in a running record).
    params = {"n": 4, "stop_token_ids": tuple(range(0, 97, 5))}
    stream = _run(rust_manager(256, 4), _requests(4, max_tokens=30, **params))
    assert stream.partial_finish, "no sample finished before its request"
    assert FinishReason.STOP in set(stream.partial_finish.values())


def test_recompute_preemption_deltas(make_manager) -> None:
    stream = _run(make_manager(14, 4, watermark=0.0), _requests())
    assert stream.sched.stats()["num_preemptions_recompute"] > 0
    preempted = [r for r in stream.final.values() if r.metrics.num_preemptions > 0]
    assert preempted


def test_swap_preemption_deltas(rust_manager) -> None:
    stream = _run(
        rust_manager(14, 4, num_cpu_blocks=64, watermark=0.0),
        _requests(),
        preemption_mode="swap",
    )
    assert stream.sched.stats()["num_preemptions_swap"] > 0
    _check_preemption_metrics(stream)


def _check_preemption_metrics(stream: Stream) -> None:
    total = sum(r.metrics.num_preemptions for r in stream.final.values())
    assert total == stream.sched.stats()["num_preemptions"]


def test_split_n_greater_than_one_deltas(rust_manager) -> None:
    # n > 1 without swap space: the request continues as one part per sample.
    stream = _run(rust_manager(20, 4, watermark=0.0), _requests(4, max_tokens=16, n=3))
    assert stream.sched.stats()["num_preemptions_recompute"] > 0
    _check_preemption_metrics(stream)


def test_beam_search_streams_only_its_final_record(rust_manager) -> None:
    reqs = _requests(2, max_tokens=6, beam_width=3, n=2)
    stream = _run(rust_manager(256, 4), reqs)
    for record in stream.final.values():
        assert all(c.new_token_ids == c.token_ids for c in record.outputs)


@pytest.mark.parametrize("when", ["between_steps", "in_flight"])
def test_abort_mid_stream(rust_manager, when: str) -> None:
    sched = Scheduler(rust_manager(256, 4))
    for r in _requests(3, max_tokens=30):
        sched.add_request(r)
    stream = Stream(sched)
    for _ in range(6):
        stream.step()
    if when == "in_flight":
        out = sched.schedule()
        aborted = sched.abort_request("r1")
        step = sched.update(out, fake_step(out))
        assert "r1" not in {r.request_id for r in step}  # nothing after the abort record
        for record in step:
            for c in record.outputs:
                stream.deltas[record.request_id, c.index].extend(c.new_token_ids)
    else:
        aborted = sched.abort_request("r1")
    assert aborted is not None and aborted.finished
    assert aborted.outputs[0].finish_reason == FinishReason.ABORT
    assert aborted.outputs[0].new_token_ids == []
    assert aborted.outputs[0].token_ids == stream.deltas["r1", 0]
    assert aborted.metrics is not None and aborted.metrics.finished_time is not None
    stream.run()
    assert set(stream.final) == {"r0", "r2"}
    stream.check_deltas()
    assert sched.stats()["num_requests_aborted"] == 1


def test_decode_columns_match_the_records(rust_manager) -> None:
    sched = Scheduler(rust_manager(256, 4))
    for r in _requests(3):
        sched.add_request(r)
    for _ in range(4):
        out = sched.schedule()
        step = sched.update(out, fake_step(out))
    assert step.decode is not None and len(step.decode.token_ids) == 3
    by_rid = {r.request_id: r.outputs[0].new_token_ids[0] for r in step}
    pairs = zip(step.decode.request_ids.tolist(), step.decode.token_ids.tolist(), strict=True)
    assert dict(pairs) == by_rid


def test_min_tokens_holds_back_eos_and_stop_tokens(rust_manager) -> None:
    def run(min_tokens: int) -> list[int]:
        sched = Scheduler(rust_manager(256, 4))
        params = SamplingParams(max_tokens=40, min_tokens=min_tokens)
        sched.add_request(Request("a", [1, 2, 3], params, eos_token_id=None))
        # The fake model's tokens from this prompt: pick the third as EOS.
        stream = Stream(sched)
        stream.run()
        return stream.final["a"].outputs[0].token_ids

    tokens = run(0)
    eos = tokens[2]
    first = tokens.index(eos)
    for min_tokens, stop_kind in [(0, "eos"), (first + 2, "eos"), (first + 2, "stop")]:
        sched = Scheduler(rust_manager(256, 4))
        params = SamplingParams(
            max_tokens=40,
            min_tokens=min_tokens,
            stop_token_ids=(eos,) if stop_kind == "stop" else (),
        )
        sched.add_request(
            Request("a", [1, 2, 3], params, eos_token_id=eos if stop_kind == "eos" else None)
        )
        stream = Stream(sched)
        stream.run()
        out = stream.final["a"].outputs[0]
        assert len(out.token_ids) >= min_tokens
        if min_tokens == 0:
            assert len(out.token_ids) == first + 1
        else:
            # The first EOS was sampled before min_tokens and did not stop it.
            assert out.token_ids[first] == eos and len(out.token_ids) > first + 1
        if out.finish_reason != FinishReason.LENGTH:
            assert out.token_ids[-1] == eos


def test_injected_clock_gives_exact_metrics(rust_manager) -> None:
    now = [0.0]
    sched = Scheduler(rust_manager(256, 4), SchedulerConfig(max_num_seqs=1), clock=lambda: now[0])
    now[0] = 1.0
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    now[0] = 2.0
    sched.add_request(Request("b", [4, 5, 6], SamplingParams(max_tokens=2)))
    final: dict[str, RequestOutput] = {}
    t = 10.0
    while sched.has_unfinished_requests():
        now[0] = t  # schedule() at t
        out = sched.schedule()
        now[0] = t + 0.5  # update() at t + 0.5
        for r in sched.update(out, fake_step(out)).finished:
            final[r.request_id] = r
        t += 10.0
    a, b = final["a"].metrics, final["b"].metrics
    # a: admitted at step 1 (t=10), tokens at 10.5, 20.5, 30.5.
    assert (a.arrival_time, a.first_scheduled_time) == (1.0, 10.0)
    assert (a.first_token_time, a.finished_time) == (10.5, 30.5)
    assert a.queue_time == 9.0 and a.time_to_first_token == 9.5
    assert a.time_per_output_token == pytest.approx(10.0)
    assert a.num_generated_tokens == 3 and a.num_preemptions == 0
    # b waits for a (max_num_seqs=1): admitted at step 4 (t=40).
    assert (b.arrival_time, b.first_scheduled_time, b.first_token_time) == (2.0, 40.0, 40.5)
    assert b.finished_time == 50.5 and b.e2e_latency == 48.5
    stats = sched.stats()
    assert stats["ttft_mean_s"] == pytest.approx((9.5 + 38.5) / 2)
    assert stats["queue_time_p50_s"] == pytest.approx((9.0 + 38.0) / 2)
    assert stats["tpot_mean_s"] == pytest.approx(10.0)
    assert isinstance(stats["num_requests_finished"], int)


def test_metrics_are_ordered_under_preemption(make_manager) -> None:
    stream = _run(make_manager(14, 4, watermark=0.0), _requests())
    for record in stream.final.values():
        m = record.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    total = sum(r.metrics.num_preemptions for r in stream.final.values())
    assert total == stream.sched.stats()["num_preemptions"]


def test_arrival_time_given_by_the_caller(rust_manager) -> None:
    sched = Scheduler(rust_manager(64, 4), clock=lambda: 100.0)
    sched.add_request(Request("a", [1, 2], SamplingParams(max_tokens=1), arrival_time=90.0))
    out = sched.schedule()
    (record,) = sched.update(out, fake_step(out)).finished
    assert record.metrics.queue_time == 10.0 and record.metrics.time_per_output_token is None


def test_bad_clock_is_rejected(rust_manager) -> None:
    with pytest.raises(InvalidArgumentError):
        Scheduler(rust_manager(64, 4), clock=3.0)  # type: ignore[arg-type]


def _summary(step: StepOutputs) -> list[tuple]:
    return [
        (
            r.request_id,
            r.finished,
            tuple(r.prompt_token_ids),
            [(c.index, c.new_token_ids, c.finish_reason, c.num_tokens) for c in r.outputs],
        )
        for r in step
    ]


def test_records_read_late_are_the_records_of_their_step(rust_manager) -> None:
    # The records are built when read: reading a step's outputs after later steps (rows
    # removed, added, reordered; ids of finished requests reused) must give the same.
    def build() -> Scheduler:
        sched = Scheduler(rust_manager(24, 4, watermark=0.0))
        for r in _requests(6, max_tokens=10, n=2):
            sched.add_request(r)
        return sched

    eager, late = build(), build()
    eager_seen, late_held = [], []
    step = 0
    while eager.has_unfinished_requests():
        out_e, out_l = eager.schedule(), late.schedule()
        eager_seen.append(_summary(eager.update(out_e, fake_step(out_e))))
        late_held.append(late.update(out_l, fake_step(out_l)))
        step += 1
        if step == 3:  # reuse a finished id? add fresh requests under new ids midway
            for sched in (eager, late):
                sched.add_request(Request("x", [5, 6, 7], SamplingParams(max_tokens=3)))
        assert step < 1000
    assert late.stats()["num_preemptions"] > 0
    assert [_summary(s) for s in late_held] == eager_seen


def test_abort_with_a_reason_of_the_callers_counts_as_finished(rust_manager) -> None:
    now = [0.0]
    sched = Scheduler(rust_manager(64, 4), clock=lambda: now[0])
    for r in _requests(2, max_tokens=30):
        sched.add_request(r)
    for t in range(1, 5):
        now[0] = float(t)
        out = sched.schedule()
        sched.update(out, fake_step(out))
    with pytest.raises(InvalidArgumentError):
        sched.abort_request("r0", "bored")
    stopped = sched.abort_request("r0", FinishReason.STOP)
    assert stopped is not None and stopped.outputs[0].finish_reason == FinishReason.STOP
    assert stopped.metrics.finished_time == 4.0
    aborted = sched.abort_request("r1")
    assert aborted.outputs[0].finish_reason == FinishReason.ABORT
    stats = sched.stats()
    assert (stats["num_requests_finished"], stats["num_requests_aborted"]) == (1, 1)
    assert stats["e2e_latency_mean_s"] == 4.0  # r0 only: aborted requests are left out
    assert not sched.has_unfinished_requests()


def test_finish_sequence_refusals(rust_manager) -> None:
    sched = Scheduler(rust_manager(64, 4))
    sched.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, n=3)))
    stream = Stream(sched)
    for _ in range(4):
        stream.step()
    assert sched.finish_sequence("a", 7) is None  # no such completion
    assert sched.finish_sequence("zz", 0) is None
    out = sched.schedule()
    assert sched.finish_sequence("a", 1) is None  # not while a step is in flight
    sched.update(out, fake_step(out))
    with pytest.raises(InvalidArgumentError):
        sched.finish_sequence("a", 1, "bored")


def test_abort_and_finish_refuse_a_request_id_that_is_not_a_string(rust_manager) -> None:
    # An unhashable id raised a bare TypeError from the registry's dict lookup.
    sched = Scheduler(rust_manager(64, 4))
    sched.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, n=3)))
    Stream(sched).step()
    for bad in (["a"], {"a": 1}, 1, None):
        with pytest.raises(InvalidArgumentError):
            sched.abort_request(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            sched.finish_sequence(bad, 1)  # type: ignore[arg-type]
    assert sched.running_request_ids() == ["a"] and sched.num_unfinished_requests() == 1


def test_finish_sequence_refuses_an_index_that_is_not_an_int(rust_manager) -> None:
    # True and 1.0 compare equal to 1: they ended completion 1 and returned (and kept in
    # the request's final record) a CompletionOutput whose index was True / 1.0.
    sched = Scheduler(rust_manager(64, 4))
    sched.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, n=3)))
    stream = Stream(sched)
    stream.step()
    free = sched.manager.num_free_blocks()
    for bad in (True, 1.0, "1", None, -1):
        with pytest.raises(InvalidArgumentError):
            sched.finish_sequence("a", bad)  # type: ignore[arg-type]
    assert sched.manager.num_free_blocks() == free
    done = sched.finish_sequence("a", np.int64(1))  # type: ignore[arg-type]
    assert done is not None and type(done.index) is int and done.index == 1


def test_finish_one_sequence_of_several(rust_manager) -> None:
    sched = Scheduler(rust_manager(64, 4))
    sched.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, n=3)))
    stream = Stream(sched)
    for _ in range(4):
        stream.step()
    used = sched.manager.num_free_blocks()
    done = sched.finish_sequence("a", 1, FinishReason.STOP)
    assert done is not None and done.finish_reason == FinishReason.STOP
    assert done.token_ids == stream.deltas["a", 1] and len(done.token_ids) == 4
    assert sched.manager.num_free_blocks() > used  # its own tail block went back
    assert sched.finish_sequence("a", 1) is None  # already finished
    stream.run()
    stream.check_deltas()
    final = stream.final["a"]
    assert final.outputs[1].finish_reason == FinishReason.STOP
    assert final.outputs[1].token_ids == done.token_ids
    assert [len(c.token_ids) for c in final.outputs] == [12, 4, 12]
    sched.manager.check_invariants()
    assert len(sched.manager) == 0


def test_finish_sequence_refuses_the_last_one(rust_manager) -> None:
    sched = Scheduler(rust_manager(64, 4))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=12)))
    stream = Stream(sched)
    stream.step()
    assert sched.finish_sequence("a", 0) is None  # use abort_request for the whole request


def test_a_failing_clock_changes_nothing(rust_manager) -> None:
    fail = [False]

    def clock() -> float:
        if fail[0]:
            raise RuntimeError("clock down")
        return 1.0

    manager = rust_manager(64, 4)
    sched = Scheduler(manager, clock=clock)
    fail[0] = True
    with pytest.raises(RuntimeError):
        sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError):
        sched.schedule()
    assert len(manager) == 0 and not sched.has_unfinished_requests()
    fail[0] = False
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    fail[0] = True
    with pytest.raises(RuntimeError):
        sched.update(out, fake_step(out))
    fail[0] = False
    (record,) = sched.update(out, fake_step(out))  # the same step, applied once
    assert record.outputs[0].num_tokens == 1


@pytest.mark.parametrize("value", ["2.5", b"1", None, [1.0], np.array([1.0]), float("nan"), 1j])
def test_a_clock_that_returns_no_time_is_refused_and_changes_nothing(rust_manager, value) -> None:
    # float() of it raised TypeError or ValueError from add_request, schedule and update,
    # or parsed a str; a NaN made every later latency NaN.
    now: list[object] = [1.0]
    manager = rust_manager(64, 4)
    sched = Scheduler(manager, clock=lambda: now[0])
    now[0] = value
    with pytest.raises(InvalidArgumentError, match="clock"):
        sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidArgumentError, match="clock"):
        sched.schedule()
    assert len(manager) == 0 and not sched.has_unfinished_requests()
    now[0] = 2.0
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    now[0] = value
    with pytest.raises(InvalidArgumentError, match="clock"):
        sched.update(out, fake_step(out))
    now[0] = np.float32(3.0)  # any real number is a time
    (record,) = sched.update(out, fake_step(out))
    assert record.outputs[0].num_tokens == 1 and record.metrics.first_token_time == 3.0


def test_rows_below_min_tokens_ban_eos_and_stop_tokens(rust_manager) -> None:
    """The step tells the engine which tokens each row may not draw: EOS and the stop
    tokens while the sequence has fewer than ``min_tokens`` tokens (vLLM's rule), nothing
    for other rows and nothing once the minimum is reached."""
    sched = Scheduler(rust_manager(256, 4))
    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(9, 4))
    sched.add_request(Request("min", [1, 2, 3], params, eos_token_id=7))
    sched.add_request(Request("free", [5, 6], SamplingParams(max_tokens=10), eos_token_id=7))
    seen = []
    for _ in range(4):
        out = sched.schedule()
        rows = {int(s): r for r, s in enumerate(out.sample_seq_ids.tolist())}
        owner = dict(zip(out.sample_seq_ids.tolist(), out.sample_request_ids, strict=True))
        if out.suppressed_indptr is None:
            seen.append({})
        else:
            ip, ids = out.suppressed_indptr, out.suppressed_token_ids
            assert ids is not None and len(ip) == out.num_sample_rows + 1
            seen.append(
                {owner[s]: sorted(ids[ip[r] : ip[r + 1]].tolist()) for s, r in rows.items()}
            )
        # Never EOS or a stop token, so nothing ends early.
        sampled = np.full(int(out.sample_counts.sum()), 11, dtype=np.int64)
        sched.update(out, ModelStepResult(sampled))
    # Tokens before a draw: 0 (prompt row), 1, 2 (minimum reached), 3.
    assert seen == [{"min": [4, 7, 9], "free": []}, {"min": [4, 7, 9], "free": []}, {}, {}]
