"""The request rate a server sustains with stable latency: a saturation estimate or a search.

*Capacity* is the highest request rate at which queueing delay stays bounded as the trace
grows, decided by :class:`~kvblocks.simulate.metrics.StabilityRule` on a run of the
configured trace at that rate. Two ways to find it:

- ``estimate`` (cheap, the default): the completion rate of a *saturated* run (every
  conversation starts at t=0 and follow-ups skip the think time, so the queue stays
  full), over the steps that left requests queued between the 10% and 90% completion
  marks (:class:`~kvblocks.simulate.metrics.ThroughputWindow`). A server cannot sustain
  more than it completes when never idle, so this is an upper bound, and a close one
  when batching is what limits throughput.
- ``search``: bisection on the rate between a stable and an unstable probe, starting
  from 1.5x the estimate, until the bracket is within ``tolerance``; each probe runs the
  whole configured trace. Reports the highest rate found stable. A stable rate above the
  saturation estimate means the trace is too short to show an overload (the server
  absorbs the whole trace in its batch before a queue builds up): the result says so
  (``trace_too_short``) instead of passing the rate off as a capacity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.metrics import RequestMetrics, StabilityRule

__all__ = [
    "CAPACITY_MODES",
    "CapacityResult",
    "Probe",
    "estimate_capacity",
    "saturated_config",
    "search_capacity",
]

CAPACITY_MODES = ("estimate", "search", "off")
"""``--capacity`` choices."""

Probe = Callable[[SimulationConfig], tuple[RequestMetrics, float]]
"""Runs a configuration; returns its metrics and its saturated completion rate."""


@dataclass
class CapacityResult:
    """Capacity of one server.

    Attributes:
        mode: ``"estimate"`` or ``"search"``.
        requests_per_s: the capacity (the estimate, or the highest stable probe).
        estimate_requests_per_s: the saturation estimate (both modes compute it).
        probes: ``(rate, stable)`` of every search probe, in order.
        trace_too_short: the search found a rate above the saturation estimate stable,
            which no server sustains: the trace ended before its queue could grow, so
            ``requests_per_s`` is not a capacity (run a longer trace).
        saturated: the saturated run left requests queued in its window. False: every
            request fit the batch, so the estimate is what was offered, a lower bound on
            what the server sustains, not an upper one (raise the saturated requests).
        rejected_share: the share of the saturated run's requests the server refused
            (longer than its pool or limits allow): the rates count only those that fit,
            and 1.0 means it serves none of this workload's requests.
    """

    mode: str
    requests_per_s: float
    estimate_requests_per_s: float
    probes: list[tuple[float, bool]] = field(default_factory=list)
    trace_too_short: bool = False
    saturated: bool = True
    rejected_share: float = 0.0

    @property
    def lower_bound(self) -> bool:
        """An estimate from a saturated run that never queued a request: what it was
        offered, at least what the server sustains (a search's probes are not bounds)."""
        return self.mode == "estimate" and not self.saturated


def saturated_config(config: SimulationConfig, num_requests: int) -> SimulationConfig:
    """``config`` saturated: ``num_requests`` requests, every conversation starting at
    t=0 and every follow-up turn queued as soon as its previous turn finishes (no think
    time: the same work, but the queue never runs dry while turns are pending), no
    progress bar, stopping when the throughput window closes."""
    workload = dataclasses.replace(
        config.workload,
        request_rate=math.inf,
        num_requests=num_requests,
        think_time_s=0.0,
    )
    return dataclasses.replace(
        config,
        workload=workload,
        progress=False,
        stop_at_window=True,
        follow_ups_first=True,
    )


def estimate_capacity(probe: Probe, config: SimulationConfig, num_requests: int) -> float:
    """The saturated completion rate of ``config``'s server on ``num_requests`` requests."""
    return probe(saturated_config(config, num_requests))[1]


def search_capacity(
    probe: Probe,
    config: SimulationConfig,
    estimate: float,
    *,
    tolerance: float = 0.05,
    max_probes: int = 12,
    rule: StabilityRule | None = None,
) -> CapacityResult:
    """Bisect the request rate for the highest one ``rule`` finds stable.

    Args:
        probe: runs a configuration (see :data:`Probe`).
        config: the :class:`SimulationConfig` whose trace each probe replays at a new rate.
        estimate: the saturation estimate (brackets the search).
        tolerance: stop when ``hi - lo <= tolerance * hi``.
        max_probes: most probes in all.
        rule: the stability rule (default :class:`StabilityRule`).

    Raises:
        InvalidArgumentError: ``tolerance`` not in (0, 1) or ``max_probes`` < 1.
    """
    if not 0 < tolerance < 1:
        raise InvalidArgumentError(f"tolerance must be in (0, 1), got {tolerance}")
    if max_probes < 1:
        raise InvalidArgumentError(f"max_probes must be >= 1, got {max_probes}")
    result = CapacityResult("search", 0.0, estimate)
    if not estimate > 0:
        return result

    def stable(rate: float) -> bool:
        workload = dataclasses.replace(config.workload, request_rate=rate)
        run = dataclasses.replace(config, workload=workload, progress=False)
        ok = probe(run)[0].is_stable(rule)
        result.probes.append((rate, ok))
        return ok

    lo, hi = 0.0, 1.5 * estimate
    # Widen upwards while the top is still stable (the estimate can be low).
    while len(result.probes) < max_probes and stable(hi):
        lo, hi = hi, 2 * hi
    while len(result.probes) < max_probes and hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if stable(mid):
            lo = mid
        else:
            hi = mid
    result.requests_per_s = lo
    result.trace_too_short = lo > estimate
    return result
