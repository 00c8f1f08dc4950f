"""Capacity: the saturation estimate and the bisection, on servers whose capacity is known."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvblocks.simulate import run_plan, run_simulation
from kvblocks.simulate.capacity import estimate_capacity, saturated_config, search_capacity
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.contiguous import run_contiguous
from kvblocks.simulate.metrics import RequestMetrics, StabilityRule
from kvblocks.simulate.report import format_json, format_table
from kvblocks.simulate.workload import LengthDist, WorkloadConfig

from .toy import SERVICE_S, toy_config


def _paged(config: SimulationConfig) -> tuple[RequestMetrics, float]:
    result = run_simulation(config)
    return result.metrics, result.saturated_requests_per_s


def _contiguous(config: SimulationConfig) -> tuple[RequestMetrics, float]:
    result = run_contiguous(config, "max_tokens")
    return result.metrics, result.saturated_requests_per_s


# One request at a time, 9 steps of 10 ms each: the server completes 1 / 0.09 = 11.1 req/s,
# and with evenly spaced arrivals any lower rate keeps the queue empty.
CAPACITY = 1 / SERVICE_S


@pytest.mark.parametrize("probe", [_paged, _contiguous])
def test_saturation_estimate_is_the_service_rate(probe) -> None:  # type: ignore[no-untyped-def]
    assert estimate_capacity(probe, toy_config(), 200) == pytest.approx(CAPACITY, rel=0.01)


@pytest.mark.parametrize("probe", [_paged, _contiguous])
def test_stability_below_and_above_capacity(probe) -> None:  # type: ignore[no-untyped-def]
    below = probe(toy_config(request_rate=0.9 * CAPACITY))[0]
    above = probe(toy_config(request_rate=1.1 * CAPACITY))[0]
    assert below.is_stable() and below.queue_delay.max < 1e-9
    assert not above.is_stable()
    # Above capacity the queue grows about linearly: the last quarter waits ~2.3x longer.
    assert above.quarter_delay(3) > 2 * above.quarter_delay(1) > 0


def test_search_brackets_the_known_capacity() -> None:
    # An overload shows once the queue it adds over the trace exceeds the rule's slack:
    # with 800 requests, anything above ~1% over capacity.
    result = search_capacity(_contiguous, toy_config(num_requests=800), CAPACITY, tolerance=0.02)
    assert 0.97 * CAPACITY <= result.requests_per_s <= CAPACITY * 1.015
    assert result.mode == "search" and result.estimate_requests_per_s == CAPACITY
    rates = [rate for rate, _ in result.probes]
    assert rates[0] == pytest.approx(1.5 * CAPACITY) and not result.probes[0][1]
    # Every probe at or below the answer was stable; every one above it was not.
    for rate, stable in result.probes:
        assert stable == (rate <= result.requests_per_s), (rate, stable)


def test_search_widens_when_the_estimate_is_low() -> None:
    # The paged server on a 200-request trace: overloads above ~5% show.
    result = search_capacity(_paged, toy_config(), CAPACITY / 3, tolerance=0.05)
    assert 0.9 * CAPACITY <= result.requests_per_s <= CAPACITY * 1.05
    assert result.probes[0] == (pytest.approx(0.5 * CAPACITY), True)


def test_a_stricter_rule_never_finds_more_capacity() -> None:
    loose = search_capacity(_contiguous, toy_config(), CAPACITY, tolerance=0.05)
    strict = search_capacity(
        _contiguous,
        toy_config(),
        CAPACITY,
        tolerance=0.05,
        rule=StabilityRule(growth=1.0, slack_s=0.0),
    )
    assert strict.requests_per_s <= loose.requests_per_s


def test_saturated_config_starts_everything_at_once() -> None:
    config = toy_config(request_rate=3.0)
    sat = saturated_config(config, 50)
    assert math.isinf(sat.workload.request_rate) and sat.workload.num_requests == 50
    assert sat.workload.think_time_s == 0.0 and sat.stop_at_window and not sat.progress
    assert config.workload.request_rate == 3.0  # unchanged


def test_search_rejects_bad_arguments() -> None:
    from kvblocks.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        search_capacity(_paged, toy_config(), CAPACITY, tolerance=0.0)
    with pytest.raises(InvalidArgumentError):
        search_capacity(_paged, toy_config(), CAPACITY, max_probes=0)
    assert search_capacity(_paged, toy_config(), 0.0).requests_per_s == 0.0


@pytest.mark.parametrize("probe", [_paged, _contiguous])
def test_saturated_runs_serve_follow_ups_before_new_conversations(probe) -> None:  # type: ignore[no-untyped-def]
    """Two two-turn conversations, one request at a time, 90 ms each, no think time.

    Follow-ups first: c0.0, c0.1, c1.0, c1.1 -> queueing delays 0, 0, 0.18, 0 s.
    Arrival order: c0.0, c1.0, c0.1, c1.1 -> 0, 0.09, 0.09, 0.09 s.
    """
    import dataclasses

    base = toy_config(num_requests=4)
    workload = dataclasses.replace(
        base.workload, multi_turn_share=1.0, max_turns=2, think_time_s=0.0
    )
    plain = dataclasses.replace(base, workload=workload)
    first = dataclasses.replace(plain, follow_ups_first=True)
    assert probe(first)[0].queue_delay.mean == pytest.approx(0.18 / 4)
    assert probe(plain)[0].queue_delay.mean == pytest.approx(0.27 / 4)
    assert saturated_config(plain, 4).follow_ups_first


def test_search_on_a_short_multi_turn_trace_finds_an_overload() -> None:
    # The CLI's default trace (200 requests, a quarter of the conversations multi-turn).
    # Quartered by arrival order, the follow-up turns (closed loop, after think times) filled
    # the last quarter and every rate read as stable: the search doubled its rate up to
    # 22,000 req/s. Quartered by the conversations' first turns, a burst is an overload.
    config = SimulationConfig(workload=WorkloadConfig(num_requests=200), progress=False)
    burst = dataclasses.replace(config.workload, request_rate=1e4)
    metrics, _ = _paged(dataclasses.replace(config, workload=burst))
    assert not metrics.is_stable()
    result = search_capacity(_paged, config, 7.0, max_probes=8)
    assert any(not ok for _, ok in result.probes)
    # Still, 200 requests fit the server's batch at almost any rate: the search finds a
    # stable rate above the saturated throughput, which no server sustains, and says the
    # trace is too short rather than calling it a capacity.
    assert result.requests_per_s > 7.0 and result.trace_too_short


def test_an_estimate_from_a_run_that_never_queued_is_a_lower_bound() -> None:
    """20 requests fit one 64-sequence batch: the 'saturated' run never queues one, they
    all finish after 0.09 s, and its completion rate (222 req/s) is what was offered,
    not what the server sustains (64 per 0.09 s: 711 req/s). It was reported as 'at most
    222.22 req/s': an upper bound 3.2x too low."""
    plan = run_plan(toy_config(num_requests=20, max_num_seqs=64), "estimate", 20)
    for server in plan.servers:
        cap = server.capacity
        assert cap is not None and cap.requests_per_s == pytest.approx(20 / SERVICE_S)
        assert not cap.saturated
    text = format_table(plan)
    assert "at least 222.22 req/s" in text and "at most" not in text
    assert ">= 222.22 (never queued)" in text and "paged" not in text.split("capacity, req/s")[1]
    doc = json.loads(format_json(plan))
    assert [s["capacity"]["saturated"] for s in doc["servers"]] == [False, False, False]
    # One sequence at a time does queue: an upper bound, as before.
    queued = run_plan(toy_config(num_requests=20), "estimate", 20).servers[0].capacity
    assert queued is not None and queued.saturated


def test_a_capacity_counts_only_what_fits_and_says_what_was_rejected() -> None:
    """A pool of one usable block (16 tokens) holds none of 40-token prompts: every server
    rejects every request, and a capacity is 'none', not the rate of nothing. With mixed
    lengths and a pool some requests outgrow, the rate is of those that fit and the share
    rejected is named (a contiguous server that rejected 71% read as more capacity than
    the paged one that rejected 36%)."""
    tiny = toy_config(num_requests=20, num_blocks=2)
    tiny = dataclasses.replace(
        tiny, workload=dataclasses.replace(tiny.workload, prompt_len=LengthDist("fixed", 40))
    )
    plan = run_plan(tiny, "estimate", 20)
    for server in plan.servers:
        cap = server.capacity
        assert cap is not None and cap.rejected_share == 1.0 and cap.requests_per_s == 0.0
    text = format_table(plan)
    assert "none: the saturated run rejected every request" in text
    assert text.split("capacity, req/s")[1].count("none (all rejected)") == 3
    base = toy_config(num_requests=40)
    mixed = dataclasses.replace(
        base,
        num_blocks=6,
        workload=dataclasses.replace(
            base.workload, output_len=LengthDist("lognormal", 40, 1.0), max_output_len=128
        ),
    )
    plan = run_plan(mixed, "estimate", 200)
    # Paged holds every request; contiguous max_tokens reserves 16 + 128 > 80 tokens for
    # each; contiguous exact only for the longest outputs.
    shares = [server.capacity.rejected_share for server in plan.servers if server.capacity]
    assert shares[0] == 0.0 and shares[1] == 1.0 and 0 < shares[2] < 1, shares
    text = format_table(plan).split("capacity, req/s")[1]
    assert "none (all rejected)" in text and f"({100 * shares[2]:.0f}% rejected)" in text
    assert "(paged" not in text  # no ratio against a server that served other requests
    doc = json.loads(format_json(plan))
    assert [s["capacity"]["rejected_share"] for s in doc["servers"]] == shares
