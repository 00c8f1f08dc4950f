"""The workload generator: lengths, shared system prompts, multi-turn conversations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler import Scheduler
from kvblocks.simulate import SimulationConfig, WorkloadConfig, run_simulation
from kvblocks.simulate import runner as runner_module
from kvblocks.simulate.workload import (
    MAX_TURNS,
    LengthDist,
    declared_max_tokens,
    iter_workload,
    make_workload,
    mean_turns,
)


@pytest.mark.parametrize(
    ("dist", "mean"),
    [
        (LengthDist("lognormal", 161, 1.0), 161),
        (LengthDist("lognormal", 338, 0.8), 338),
        (LengthDist("uniform", 10, 30), 20),
        (LengthDist("fixed", 7), 7),
    ],
)
def test_length_distribution_means(dist: LengthDist, mean: float) -> None:
    draws = dist.draw(np.random.default_rng(1), 1, 1_000_000, 40_000)
    assert dist.mean == mean
    assert float(draws.mean()) == pytest.approx(mean, rel=0.03)
    if dist.kind == "uniform":
        assert draws.min() == 10 and draws.max() == 30
    if dist.kind == "lognormal":
        # Parameterised by the mean: the median sits at mean * exp(-sigma^2 / 2).
        assert float(np.median(draws)) == pytest.approx(mean * math.exp(-(dist.b**2) / 2), rel=0.05)


def test_trace_lengths_have_the_configured_means() -> None:
    config = WorkloadConfig(
        num_requests=6000,
        system_prompt_share=0.0,
        multi_turn_share=0.0,
        max_prompt_len=100_000,
        max_output_len=100_000,
        max_context_len=300_000,
    )
    trace = make_workload(config)
    assert len(trace) == 6000
    prompts = np.array([len(r.prompt_token_ids) for r in trace])
    outputs = np.array([r.output_len for r in trace])
    assert prompts.mean() == pytest.approx(161, rel=0.05)
    assert outputs.mean() == pytest.approx(338, rel=0.05)
    # The client's max_tokens is the power of two at or above the output, at least 256.
    assert all(r.declared_max_tokens == declared_max_tokens(r.output_len) for r in trace)
    assert [declared_max_tokens(x) for x in (1, 256, 257, 300, 1024, 1025)] == [
        256,
        256,
        512,
        512,
        1024,
        2048,
    ]


def test_shared_system_prompts_are_really_shared() -> None:
    config = WorkloadConfig(
        num_requests=400,
        system_prompt_share=1.0,
        num_system_prompts=3,
        system_prompt_len=64,
        multi_turn_share=0.0,
    )
    heads = {tuple(r.prompt_token_ids[:64].tolist()) for r in iter_workload(config)}
    assert len(heads) == 3  # every request starts with one of exactly three prefixes
    alone = WorkloadConfig(num_requests=400, system_prompt_share=0.0, multi_turn_share=0.0)
    firsts = [tuple(r.prompt_token_ids[:4].tolist()) for r in iter_workload(alone)]
    assert len(set(firsts)) == 400  # without them, prompts share nothing
    # About the configured share of requests starts with a system prompt.
    half = WorkloadConfig(
        num_requests=2000, system_prompt_share=0.5, num_system_prompts=1, multi_turn_share=0.0
    )
    trace = make_workload(half)
    heads_half = [tuple(r.prompt_token_ids[:256].tolist()) for r in trace]
    most = max(set(heads_half), key=heads_half.count)
    assert heads_half.count(most) / len(trace) == pytest.approx(0.5, abs=0.05)


def test_next_turn_extends_the_previous_turn() -> None:
    config = WorkloadConfig(num_requests=50, multi_turn_share=1.0, max_turns=4, think_time_s=2.0)
    first = next(r for r in iter_workload(config) if len(r.next_turns) >= 2)
    out = np.arange(first.output_len, dtype=np.int64) + 7
    second = first.next_turn(out, finish_time=10.0)
    assert second is not None
    k = len(first.prompt_token_ids)
    np.testing.assert_array_equal(second.prompt_token_ids[:k], first.prompt_token_ids)
    np.testing.assert_array_equal(second.prompt_token_ids[k : k + len(out)], out)
    np.testing.assert_array_equal(
        second.prompt_token_ids[k + len(out) :], first.next_turns[0].message
    )
    assert second.history_len == k + len(out)
    assert second.arrival_time == 10.0 + first.next_turns[0].think_s
    assert second.output_len == first.next_turns[0].output_len
    assert second.request_id == f"{first.request_id}.1" and second.turn == 1 and second.n == 1
    third = second.next_turn(np.zeros(second.output_len, dtype=np.int64), 20.0)
    assert third is not None and third.request_id == f"{first.request_id}.2"
    assert len(third.next_turns) == len(first.next_turns) - 2


def test_conversations_count_toward_num_requests_and_fit_the_context() -> None:
    config = WorkloadConfig(
        num_requests=777, multi_turn_share=0.6, max_turns=6, max_context_len=3400
    )
    trace = make_workload(config)
    assert sum(1 + len(r.next_turns) for r in trace) == 777
    assert any(len(r.next_turns) >= 3 for r in trace)
    for first in trace:
        turn = first
        while True:
            assert len(turn.prompt_token_ids) + turn.output_len <= 3400
            nxt = turn.next_turn(np.zeros(turn.output_len, dtype=np.int64), 0.0)
            if nxt is None:
                break
            turn = nxt


def test_request_rate_counts_turns() -> None:
    config = WorkloadConfig(num_requests=20_000, request_rate=8.0, multi_turn_share=0.5)
    trace = make_workload(config)
    turns = mean_turns(config)
    assert turns == pytest.approx(20_000 / len(trace), rel=0.03)
    starts_per_s = len(trace) / trace[-1].arrival_time
    assert starts_per_s * turns == pytest.approx(8.0, rel=0.05)
    constant = make_workload(
        WorkloadConfig(num_requests=10, arrival="constant", multi_turn_share=0)
    )
    gaps = np.diff([r.arrival_time for r in constant])
    np.testing.assert_allclose(gaps, 1 / 5.0)  # the default rate, one turn each


def test_simulated_follow_ups_carry_the_generated_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a run, turn k+1's prompt is turn k's prompt + what the scheduler generated for it."""
    prompts: dict[str, np.ndarray] = {}
    outputs: dict[str, list[int]] = {}

    class Recording(Scheduler):
        def add_request(self, request):  # type: ignore[no-untyped-def]
            prompts[request.request_id] = np.asarray(request.prompt_token_ids)
            return super().add_request(request)

        def update(self, output, result):  # type: ignore[no-untyped-def]
            outs = super().update(output, result)
            for out in outs:
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            return outs

    monkeypatch.setattr(runner_module, "Scheduler", Recording)
    workload = WorkloadConfig(
        num_requests=60, request_rate=20.0, multi_turn_share=1.0, max_turns=4, think_time_s=0.5
    )
    result = run_simulation(SimulationConfig(workload=workload, num_blocks=2048, progress=False))
    assert result.num_finished == 60
    follow_ups = [rid for rid in prompts if "." in rid]
    assert len(follow_ups) >= 20
    for rid in follow_ups:
        base, k = rid.split(".")
        prev = base if k == "1" else f"{base}.{int(k) - 1}"
        history = np.concatenate([prompts[prev], np.asarray(outputs[prev], dtype=np.int64)])
        np.testing.assert_array_equal(prompts[rid][: len(history)], history)
        assert len(prompts[rid]) > len(history)  # plus a new message
    assert result.history_tokens > 0
    # The history is what the prefix cache serves.
    assert result.summary()["prefix_hit_rate"] > 0.3


@pytest.mark.parametrize(
    "text", ["lognormal:1", "fixed:1,2", "weibull:1,2", "uniform:9,3", "lognormal:-5,1", "x", ""]
)
def test_bad_length_distributions_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        LengthDist.parse(text)


@pytest.mark.parametrize("text", ["uniform:1e30,1e30", "uniform:0,1e19", "lognormal:1,1e200"])
def test_length_distributions_too_wide_to_draw_are_refused(text: str) -> None:
    # They parsed, then the first draw raised numpy's ValueError ("high is out of bounds
    # for int64") or OverflowError (sigma**2) out of kvblocks simulate.
    with pytest.raises(InvalidArgumentError):
        LengthDist.parse(text)
    rng = np.random.default_rng(0)
    for widest in (LengthDist("uniform", 0, 2**53), LengthDist("lognormal", 1, 2**53)):
        assert ((widest.draw(rng, 1, 10, 5) >= 1) & (widest.draw(rng, 1, 10, 5) <= 10)).all()


def test_more_turns_than_a_conversation_can_draw_are_refused() -> None:
    # max_turns=10**9 parsed, then mean_turns asked numpy for 4096 * 10**9 draws
    # (numpy's _ArrayMemoryError, or the machine's memory).
    with pytest.raises(InvalidArgumentError, match="max_turns"):
        WorkloadConfig(multi_turn_share=1.0, max_turns=10**9)
    config = WorkloadConfig(num_requests=3, multi_turn_share=1.0, max_turns=MAX_TURNS)
    assert 1.0 <= mean_turns(config) <= MAX_TURNS


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_system_prompts": 10**11, "system_prompt_len": 1},
        {"system_prompt_len": 10**11, "max_context_len": 10**12},
    ],
)
def test_system_prompts_too_large_to_draw_are_refused(kwargs: dict[str, int]) -> None:
    # iter_workload draws every system prompt up front: these died with numpy's
    # _ArrayMemoryError (745 GiB) out of kvblocks simulate.
    with pytest.raises(InvalidArgumentError, match="system prompt"):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


def test_length_distribution_text_round_trips() -> None:
    for text in ("lognormal:161,1", "fixed:32", "uniform:4,8"):
        assert str(LengthDist.parse(text)) == text
    assert LengthDist.parse("64") == LengthDist("fixed", 64)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"multi_turn_share": 1.5},
        {"arrival": "bursty"},
        {"think_time_s": -1.0},
        {"max_context_len": 100},
        {"max_turns": 0},
    ],
)
def test_bad_workload_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_requests": 2.5}, "num_requests"),  # a float count ran 3 requests
        ({"num_requests": float("nan")}, "num_requests"),  # NaN < 1 is False
        ({"num_requests": True}, "num_requests"),
        ({"request_rate": True}, "request_rate"),
        ({"request_rate": "5"}, "request_rate"),  # a TypeError from the comparison
        ({"seed": "x"}, "seed"),  # kept, then numpy's TypeError mid-run
        ({"seed": -1}, "seed"),
        ({"prompt_len": 100}, "prompt_len"),  # an AttributeError mid-run
        ({"output_len": None}, "output_len"),
        ({"max_prompt_len": 64.5}, "max_prompt_len"),
        ({"system_prompt_share": float("nan")}, "system_prompt_share"),
        ({"num_priorities": 0}, "num_priorities"),
        ({"num_priorities": "3"}, "num_priorities"),
        ({"vocab_size": 2**40}, "vocab_size"),  # token ids are u32
        ({"think_time_s": True}, "think_time_s"),
        ({"arrival": ["poisson"]}, "arrival"),  # unhashable: a TypeError
    ],
)
def test_workload_fields_of_the_wrong_kind_are_refused(
    kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args", [("fixed", True), ("fixed", "8"), ("uniform", 1, float("nan")), (["fixed"], 8)]
)
def test_length_distribution_fields_of_the_wrong_kind_are_refused(args: tuple) -> None:
    # True and "8" compared or failed in math.isfinite with a TypeError; a list kind was
    # unhashable.
    with pytest.raises(InvalidArgumentError):
        LengthDist(*args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_rate": 1e-320},  # the mean gap 1 / rate is inf
        {"request_rate": 1e-306},  # each gap finite, their sum inf
        {"think_time_s": 1e308, "multi_turn_share": 1.0},  # a drawn think time is inf
    ],
)
def test_times_that_overflow_the_clock_are_refused(kwargs: dict[str, float]) -> None:
    """Arrival times past the float range were inf: every latency inf in the table and a
    ValueError out of the JSON report (allow_nan=False)."""
    config = WorkloadConfig(num_requests=200, seed=0, **kwargs)
    with pytest.raises(InvalidArgumentError, match=r"request_rate|think_time_s"):
        run_simulation(SimulationConfig(workload=config, progress=False))
