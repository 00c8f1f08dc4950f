"""Everything ``kvblocks simulate`` reports: the paged run, the contiguous baselines, capacity.

The paged server (the real scheduler and block manager) and two contiguous-reservation
baselines (:func:`~kvblocks.simulate.contiguous.run_contiguous`, reserving prompt +
``max_tokens``, and the exact-output lower bound) serve the same trace with the same
memory, step limits and cost model. Each is run at the configured rate (latency there)
and, unless capacity is ``"off"``, saturated (the most it completes per second, and the
batch size it reaches); ``"search"`` also bisects each server's stable rate.

With a layer mix (``SimulationConfig.layer_mix``) the paged run also counts each step's
batch under per-layer-kind allocation (:mod:`kvblocks.simulate.layer_mix`), and one more
server, ``"paged, grouped KV"``, replays the trace on the pool that uniform allocation
would need to hold as many sequences as the same memory holds grouped: ``1 + (num_blocks
- 1) / ratio`` blocks, ``ratio`` being the trace's grouped-over-uniform KV. Its capacity
is the grouped pool's capacity under that accounting model (exact once the core keeps
one block table per layer kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.capacity import (
    CAPACITY_MODES,
    CapacityResult,
    Probe,
    saturated_config,
    search_capacity,
)
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.contiguous import CONTIGUOUS_RULES, run_contiguous
from kvblocks.simulate.metrics import RequestMetrics
from kvblocks.simulate.runner import SimulationResult, run_simulation

__all__ = [
    "DEFAULT_SATURATION_REQUESTS",
    "GROUPED_SERVER",
    "PlanResult",
    "ServerReport",
    "grouped_equivalent_blocks",
    "run_plan",
]

GROUPED_SERVER = "paged, grouped KV"
"""The server row of the layer-mix accounting model."""

DEFAULT_SATURATION_REQUESTS = 500
"""Requests in a saturated run: enough for the 10%-90% window to reach steady batching."""


@dataclass
class ServerReport:
    """One server's numbers at the configured rate and saturated.

    Attributes:
        name: ``"paged"``, ``"paged + host tier"``, ``"contiguous max_tokens"`` or
            ``"contiguous exact"``.
        at_rate: ``summary()`` of the run at the configured rate.
        saturated: ``summary()`` of the saturated run (``None`` with capacity off).
        capacity: the capacity result (``None`` with capacity off).
    """

    name: str
    at_rate: dict[str, Any]
    saturated: dict[str, Any] | None = None
    capacity: CapacityResult | None = None


@dataclass
class PlanResult:
    """What :func:`run_plan` measured.

    Attributes:
        paged: the full paged run at the configured rate (timeline, scheduler stats),
            without the host tier.
        servers: the paged server first, then ``"paged + host tier"`` when the
            configuration has one, then each contiguous baseline.
        tiered: the full run with the host tier (``None`` without one).
        capacity_mode: ``"estimate"``, ``"search"`` or ``"off"``.
    """

    paged: SimulationResult
    servers: list[ServerReport] = field(default_factory=list)
    capacity_mode: str = "estimate"
    tiered: SimulationResult | None = None


_Run = Callable[[SimulationConfig], tuple[RequestMetrics, float, dict[str, Any]]]
"""Runs one server on a configuration: metrics, saturated completion rate, summary."""


def _run_paged(config: SimulationConfig) -> tuple[RequestMetrics, float, dict[str, Any]]:
    result = run_simulation(config)
    return result.metrics, result.saturated_requests_per_s, result.summary()


def _contiguous_runner(rule: str) -> _Run:
    def run(config: SimulationConfig) -> tuple[RequestMetrics, float, dict[str, Any]]:
        result = run_contiguous(config, rule)
        return result.metrics, result.saturated_requests_per_s, result.summary()

    return run


def _probe(run: _Run) -> Probe:
    def probe(config: SimulationConfig) -> tuple[RequestMetrics, float]:
        metrics, rate, _ = run(config)
        return metrics, rate

    return probe


def grouped_equivalent_blocks(num_blocks: int, ratio: float) -> int:
    """The uniform pool holding as many sequences as ``num_blocks`` hold grouped."""
    if not 0 < ratio <= 1:
        return num_blocks
    return 1 + int((num_blocks - 1) / ratio)


def run_plan(
    config: SimulationConfig,
    capacity: str = "estimate",
    saturation_requests: int = DEFAULT_SATURATION_REQUESTS,
) -> PlanResult:
    """Run the paged server and the contiguous baselines on ``config``'s trace.

    With ``config.host_cache_blocks`` > 0 the paged server runs twice on the same trace,
    without the tier (``"paged"``) and with it (``"paged + host tier"``); the contiguous
    baselines have no tier.

    Raises:
        InvalidArgumentError: ``capacity`` is not one of
            :data:`~kvblocks.simulate.capacity.CAPACITY_MODES`, or
            ``saturation_requests`` < 10.
        SimulationError: the paged run cannot make progress.
    """
    if capacity not in CAPACITY_MODES:
        raise InvalidArgumentError(
            f"capacity must be one of {', '.join(CAPACITY_MODES)}, got {capacity!r}"
        )
    if saturation_requests < 10:
        raise InvalidArgumentError(f"saturation_requests must be >= 10, got {saturation_requests}")
    tiered_config = config if config.host_cache_blocks > 0 else None
    config = replace(config, host_cache_blocks=0)
    paged = run_simulation(config)
    plan = PlanResult(paged, capacity_mode=capacity)
    quiet = replace(config, progress=False)
    servers: list[tuple[str, _Run, SimulationConfig]] = [("paged", _run_paged, quiet)]
    if tiered_config is not None:
        plan.tiered = run_simulation(tiered_config)
        servers.append(("paged + host tier", _run_paged, replace(tiered_config, progress=False)))
    if config.layer_mix is not None and paged.layer_mix is not None:
        grouped = replace(
            quiet,
            num_blocks=grouped_equivalent_blocks(config.num_blocks, paged.layer_mix.ratio),
            layer_mix=None,
        )
        servers.append((GROUPED_SERVER, _run_paged, grouped))
    servers += [
        (f"contiguous {rule}", _contiguous_runner(rule), quiet) for rule in CONTIGUOUS_RULES
    ]
    for name, run, base in servers:
        if name == "paged":
            at_rate = paged.summary()
        elif name == "paged + host tier" and plan.tiered is not None:
            at_rate = plan.tiered.summary()
        else:
            at_rate = run(base)[2]
        report = ServerReport(name, at_rate)
        if capacity != "off":
            _, rate, saturated = run(saturated_config(base, saturation_requests))
            report.saturated = saturated
            full = bool(saturated.get("window_saturated", True))
            report.capacity = CapacityResult("estimate", rate, rate, saturated=full)
            if capacity == "search":
                report.capacity = search_capacity(_probe(run), base, rate)
                report.capacity.saturated = full
            # A rate of the requests that fit is no capacity for the others: say how many.
            # (Of the requests the run ended: it stops when its throughput window closes.)
            rejected = int(saturated.get("num_rejected", 0))
            ended = rejected + int(saturated.get("num_finished", 0))
            report.capacity.rejected_share = rejected / ended if ended > 0 else 0.0
        plan.servers.append(report)
    return plan
