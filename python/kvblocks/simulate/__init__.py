"""``kvblocks simulate``: a synthetic serving workload through the real scheduler and
block manager, with a cost model in place of the forward pass; latency percentiles,
capacity, and contiguous-reservation baselines on the same trace; a fleet of instances
behind a (cache-aware) router (:func:`run_fleet`)."""

from kvblocks.simulate.capacity import CapacityResult, estimate_capacity, search_capacity
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.contiguous import ContiguousReservation, ContiguousResult, run_contiguous
from kvblocks.simulate.cost_model import CostModel
from kvblocks.simulate.fleet import FleetConfig, FleetResult, run_fleet
from kvblocks.simulate.metrics import RequestMetrics, StabilityRule
from kvblocks.simulate.planner import PlanResult, run_plan
from kvblocks.simulate.runner import (
    SimulationError,
    SimulationResult,
    TierTotals,
    run_simulation,
)
from kvblocks.simulate.workload import (
    LengthDist,
    SimRequest,
    WorkloadConfig,
    iter_workload,
    make_workload,
)

__all__ = [
    "CapacityResult",
    "ContiguousReservation",
    "ContiguousResult",
    "CostModel",
    "FleetConfig",
    "FleetResult",
    "LengthDist",
    "PlanResult",
    "RequestMetrics",
    "SimRequest",
    "SimulationConfig",
    "SimulationError",
    "SimulationResult",
    "StabilityRule",
    "TierTotals",
    "WorkloadConfig",
    "estimate_capacity",
    "iter_workload",
    "make_workload",
    "run_contiguous",
    "run_fleet",
    "run_plan",
    "run_simulation",
    "search_capacity",
]
