"""What a simulation run depends on, in one record.

It sits below the runs that take it (:mod:`kvblocks.simulate.runner` and the contiguous
baseline :mod:`kvblocks.simulate.contiguous`), so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler import SchedulerConfig
from kvblocks.simulate.cost_model import CostModel
from kvblocks.simulate.layer_mix import LayerMix
from kvblocks.simulate.workload import WorkloadConfig
from kvblocks.validation import check_bool, check_int

__all__ = ["SimulationConfig", "check_parts"]


@dataclass(frozen=True)
class SimulationConfig:
    """Everything a simulation run depends on.

    Attributes:
        workload: the synthetic trace.
        scheduler: scheduler limits and policy.
        num_blocks, block_size, num_cpu_blocks, enable_prefix_caching: the block manager.
        host_cache_blocks: blocks of the manager's host tier below the GPU pool (0: none;
            needs prefix caching); the cost model charges its loads and offloads.
        host_offload: the tier's offload policy, ``"evict"`` or ``"commit"``.
        cost_model: simulated step time.
        progress: show a tqdm progress bar on stderr.
        stop_at_window: end the run as soon as the throughput window closes (90% of the
            requests finished): a capacity estimate needs no drain.
        follow_ups_first: queue a conversation's later turns ahead of conversations that
            have not started (saturated runs: with every conversation queued at t=0, plain
            arrival order would serve all the short first turns before any long follow-up,
            so the measured mix would not be the trace's).
        layer_mix: the model's sliding-window and full-attention layers; each step's
            batch is then also counted under per-layer-kind allocation
            (:mod:`kvblocks.simulate.layer_mix`, an accounting model).
    """

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 4096
    block_size: int = 16
    num_cpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    host_cache_blocks: int = 0
    host_offload: str = "evict"
    cost_model: CostModel = field(default_factory=CostModel)
    progress: bool = True
    stop_at_window: bool = False
    follow_ups_first: bool = False
    layer_mix: LayerMix | None = None

    def __post_init__(self) -> None:
        check_parts(self)
        check_bool(self.stop_at_window, "stop_at_window")
        check_bool(self.follow_ups_first, "follow_ups_first")
        if self.layer_mix is not None and not isinstance(self.layer_mix, LayerMix):
            raise InvalidArgumentError(
                f"layer_mix must be a LayerMix or None, got {type(self.layer_mix).__name__}"
            )


def check_parts(config: Any) -> None:
    """Raise unless the fields a simulation and a fleet share have their types: the parts
    are the config classes (each checked when built), the pool sizes ints, the switches
    bools (the run would otherwise fail mid-way, or take any truthy object as True).
    Ranges are the block manager's and the scheduler's, checked where they are built."""
    for name, kind in (
        ("workload", WorkloadConfig),
        ("scheduler", SchedulerConfig),
        ("cost_model", CostModel),
    ):
        if not isinstance(getattr(config, name), kind):
            raise InvalidArgumentError(
                f"{name} must be a {kind.__name__}, got {type(getattr(config, name)).__name__}"
            )
    for name in ("num_blocks", "block_size", "num_cpu_blocks", "host_cache_blocks"):
        check_int(getattr(config, name), name, numpy=True)
    for name in ("enable_prefix_caching", "progress"):
        check_bool(getattr(config, name), name)
    if not isinstance(config.host_offload, str):
        raise InvalidArgumentError(f"host_offload must be a str, got {config.host_offload!r}")
