"""Latency metrics from a trace small enough to work out by hand, and the stability rule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler import SchedulerConfig
from kvblocks.simulate import FleetConfig, WorkloadConfig, make_workload, run_fleet, run_simulation
from kvblocks.simulate.aggregates import RELATIVE_RESOLUTION, Distribution
from kvblocks.simulate.contiguous import run_contiguous
from kvblocks.simulate.metrics import RequestMetrics, StabilityRule, ThroughputWindow

from .toy import STEP_S, toy_config

# Four requests arrive at t=0; one runs at a time; each takes 3 steps of 10 ms (a prefill
# step that samples token 1, then two decode steps). Request i starts at 30*i ms.
QUEUE = [0.0, 0.03, 0.06, 0.09]
TTFT = [0.01, 0.04, 0.07, 0.10]
LATENCY = [0.03, 0.06, 0.09, 0.12]
TPOT = 0.01  # (finish - first token) / (3 - 1)


def _check(metrics: RequestMetrics) -> None:
    def near(got: float, want: float) -> None:
        # Percentiles are histogram bucket edges: exact to within one bucket (~1%).
        assert want * (1 - 1e-9) <= got <= want * (1 + RELATIVE_RESOLUTION) + 1e-12, (got, want)

    s = metrics.summary()
    # p50 of four values is the 2nd smallest; p90 and p99 the largest.
    for name, values in (("queue_delay", QUEUE), ("ttft", TTFT), ("latency", LATENCY)):
        assert s[f"mean_{name}_s"] == pytest.approx(sum(values) / 4)
        near(s[f"{name}_p50_s"], values[1])
        near(s[f"{name}_p90_s"], values[3])
        near(s[f"{name}_p99_s"], values[3])
    for q in (50, 90, 99):
        near(s[f"tpot_p{q}_s"], TPOT)
    assert metrics.ttft.count == metrics.latency.count == metrics.queue_delay.count == 4


def test_paged_run_metrics_by_hand() -> None:
    result = run_simulation(toy_config(num_requests=4, output_len=3))
    assert result.num_finished == 4
    assert result.simulated_time_s == pytest.approx(12 * STEP_S)
    _check(result.metrics)


def _cut_short_config(num_requests: int = 4):
    """Two usable blocks of 16 slots: a 16-token prompt grows to 33 slots by its 30th
    token, so each request ends (reason "length") at its 17th token, alone in the pool."""
    return toy_config(num_requests=num_requests, output_len=30, num_blocks=3)


def test_tpot_counts_the_tokens_a_cut_short_request_produced() -> None:
    result = run_simulation(_cut_short_config())
    s = result.summary()
    assert result.num_finished == 4 and result.generated_tokens == 4 * 17
    assert s["num_cut_short"] == 4
    # One request at a time, 17 steps each (prefill + 16 decodes): 10 ms between tokens,
    # not 16 intervals spread over the 29 of its output length.
    assert result.simulated_time_s == pytest.approx(4 * 17 * STEP_S)
    assert s["mean_tpot_s"] == pytest.approx(STEP_S)
    assert run_simulation(toy_config(num_requests=4, output_len=3)).summary()["num_cut_short"] == 0


def test_fleet_tpot_counts_the_tokens_a_cut_short_request_produced() -> None:
    toy = _cut_short_config(num_requests=8)
    config = FleetConfig(
        workload=toy.workload,
        num_instances=2,
        router="round-robin",
        scheduler=toy.scheduler,
        num_blocks=toy.num_blocks,
        block_size=toy.block_size,
        num_cpu_blocks=0,
        cost_model=toy.cost_model,
    )
    result = run_fleet(config)
    s = result.summary()
    assert result.num_finished == 8 and result.generated_tokens == 8 * 17
    assert s["num_cut_short"] == 8
    assert s["mean_tpot_s"] == pytest.approx(STEP_S)


@pytest.mark.parametrize("rule", ["max_tokens", "exact"])
def test_contiguous_run_metrics_by_hand(rule: str) -> None:
    result = run_contiguous(toy_config(num_requests=4, output_len=3), rule)
    assert result.num_finished == 4 and result.peak_batch_seqs == 1
    assert result.simulated_time_s == pytest.approx(12 * STEP_S)
    _check(result.metrics)


def test_stability_rule_arithmetic() -> None:
    rule = StabilityRule(growth=1.5, slack_s=0.25)
    assert rule.holds(1.0, 1.75)  # 1.5 * 1.0 + 0.25
    assert not rule.holds(1.0, 1.76)
    assert rule.holds(0.0, 0.25) and not rule.holds(0.0, 0.26)


def test_is_stable_compares_the_second_and_last_arrival_quarters() -> None:
    growing = RequestMetrics(8)
    for i in range(8):  # queue delay grows by 1 s per request: an overloaded server
        growing.scheduled(i, 0, float(i))
    assert growing.quarter_delay(1) == 2.5 and growing.quarter_delay(3) == 6.5
    assert not growing.is_stable()
    flat = RequestMetrics(8)
    for i in range(8):  # a warm-up, then a steady delay
        flat.scheduled(i, 0, 0.0 if i < 2 else 1.0)
    assert flat.is_stable()
    # Nothing ever scheduled in a quarter: not stable.
    assert not RequestMetrics(8).is_stable()


def test_follow_up_turns_do_not_hide_a_growing_queue() -> None:
    # A burst: 8 conversations start at once and their first turns queue up (delay grows);
    # their follow-ups arrive later, after think times, to an idle server. Counted by
    # arrival order the follow-ups filled the last quarter with no delay and the run read
    # as stable at any rate (the capacity search doubled its rate to its probe limit).
    burst = RequestMetrics(16, num_conversations=8)
    for conv in range(8):
        burst.scheduled(conv, 0, float(conv))
    for conv in range(8):
        burst.scheduled(conv, 1, 0.0)
    assert burst.queue_delay.count == 16
    assert burst.quarter_delay(3) == 6.5 and not burst.is_stable()


def test_throughput_window_counts_saturated_steps_between_the_marks() -> None:
    window = ThroughputWindow(100)  # marks at 10 and 90 completions
    window.step(1.0, 10, saturated=True)  # before the 10% mark: ignored
    window.step(2.0, 40, saturated=True)
    window.step(5.0, 0, saturated=False)  # idle, waiting for arrivals: ignored
    window.step(2.0, 40, saturated=True)
    assert window.is_closed()
    window.step(9.0, 10, saturated=True)  # after the 90% mark: ignored
    assert window.rate(clock=19.0) == 80 / 4.0
    never = ThroughputWindow(100)
    never.step(2.0, 5, saturated=False)
    assert not never.is_closed() and never.rate(clock=2.0) == 2.5  # falls back to the run


@pytest.mark.parametrize(
    ("output_len", "blocks"),
    [
        (1, [1]),  # the prefill step holds the prompt's block, then the request is done
        # The prefill holds 16 tokens (1 block); decode k holds 16 + k tokens (2 blocks).
        (9, [1] + [2] * 8),
    ],
)
def test_kv_memory_is_what_each_step_holds(output_len: int, blocks: list[int]) -> None:
    """KV utilisation, blocks held and the contiguous reservation of the same batch are
    taken as the step runs: a request finishing in the step still holds its blocks. They
    were taken after the step had freed the finished requests' blocks: single-token
    outputs reported a peak KV usage of 0.0% (and 'paging saves 0%')."""
    cfg = toy_config(num_requests=4, output_len=output_len)
    s = run_simulation(cfg).summary()
    usable = cfg.num_blocks - 1
    assert s["num_steps"] == 4 * len(blocks)
    assert s["peak_used_blocks"] == pytest.approx(max(blocks))
    assert s["mean_used_blocks"] == pytest.approx(sum(blocks) / len(blocks))
    assert s["peak_kv_usage"] == pytest.approx(max(blocks) / usable)
    assert s["mean_kv_usage"] == pytest.approx(sum(blocks) / len(blocks) / usable)
    contiguous = (16 + 256) / 16  # prompt + max_tokens (256) per running request
    assert s["mean_contiguous_blocks"] == pytest.approx(contiguous)
    assert s["peak_contiguous_blocks"] == pytest.approx(contiguous)


def test_quarters_split_the_trace_s_own_conversations() -> None:
    """The stability rule's quarters are quarters of the conversations the trace has.
    They were quarters of ``num_requests / mean_turns`` (a Monte Carlo expectation): on
    this trace 45.9 for 40 conversations, so the 'last quarter' held the last 6 (15%),
    and on the CLI's default 200 requests (seed 1) 123.5 for 149, the last 56 (38%)."""
    workload = WorkloadConfig(num_requests=100, seed=3, multi_turn_share=0.5, request_rate=8)
    conversations = len(make_workload(workload))
    assert conversations == 40
    cfg = replace(toy_config(), workload=workload, scheduler=SchedulerConfig())
    runs = [
        run_simulation(cfg).metrics,
        run_contiguous(cfg).metrics,
        run_fleet(FleetConfig(workload=workload, num_instances=2, progress=False)).metrics,
    ]
    for metrics in runs:
        assert metrics.num_conversations == conversations
        assert metrics._quarter_count == [10, 10, 10, 10]


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_time_past_the_float_range_is_refused(value: float) -> None:
    """A bandwidth so small that a transfer takes inf seconds (kvblocks simulate
    --host-bandwidth-gbps 1e-320) made a latency inf: an OverflowError traceback from the
    histogram's bucket index. It is an InvalidArgumentError; the distribution is kept."""
    dist = Distribution()
    dist.add(1.0)
    with pytest.raises(InvalidArgumentError, match="float range"):
        dist.add(value)
    assert (dist.count, dist.total, dist.max) == (1, 1.0, 1.0)
