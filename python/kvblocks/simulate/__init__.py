"""``kvblocks simulate``: a synthetic serving workload through the real scheduler and
block manager, with a cost model in place of the forward pass."""

from kvblocks.simulate.contiguous import ContiguousReservation
from kvblocks.simulate.cost_model import CostModel
from kvblocks.simulate.runner import (
    SimulationConfig,
    SimulationError,
    SimulationResult,
    run_simulation,
)
from kvblocks.simulate.workload import SimRequest, WorkloadConfig, iter_workload, make_workload

__all__ = [
    "ContiguousReservation",
    "CostModel",
    "SimRequest",
    "SimulationConfig",
    "SimulationError",
    "SimulationResult",
    "WorkloadConfig",
    "iter_workload",
    "make_workload",
    "run_simulation",
]
