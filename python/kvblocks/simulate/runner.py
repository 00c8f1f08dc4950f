"""Drive the real scheduler and block manager through a synthetic workload, no model.

A simulated clock advances by the :class:`CostModel` time of each step; the scheduler's
own cost (``schedule()`` + ``update()``) is measured in wall-clock time. The "model"
draws random tokens for every sampling row, so sequences stop at their ``max_tokens``
(the workload's output length).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblocks._core import KVCacheManager
from kvblocks.errors import InvalidArgumentError, KVBlocksError
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import ModelStepResult, Request, Scheduler, SchedulerConfig
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.simulate.aggregates import Distribution, Timeline
from kvblocks.simulate.contiguous import ContiguousReservation
from kvblocks.simulate.cost_model import CostModel
from kvblocks.simulate.workload import SimRequest, WorkloadConfig, iter_workload

__all__ = ["SimulationConfig", "SimulationError", "SimulationResult", "run_simulation"]

_MAX_IDLE_STEPS = 10_000


class SimulationError(KVBlocksError):
    """The simulation cannot make progress (a configuration that can never serve a request)."""


@dataclass(frozen=True)
class SimulationConfig:
    """Everything a simulation run depends on.

    Attributes:
        workload: the synthetic trace.
        scheduler: scheduler limits and policy.
        num_blocks, block_size, num_cpu_blocks, enable_prefix_caching: the block manager.
        cost_model: simulated step time.
        progress: show a tqdm progress bar on stderr.
    """

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 4096
    block_size: int = 16
    num_cpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    cost_model: CostModel = field(default_factory=CostModel)
    progress: bool = True


_TIMELINE_COLUMNS = (
    "kv_usage",
    "running_seqs",
    "waiting",
    "prefix_hit_rate",
    "used_blocks",
    "contiguous_blocks",
)


@dataclass
class SimulationResult:
    """Outcome of :func:`run_simulation`: summary numbers and fixed-size aggregates.

    Nothing in it grows with the run: ``latency_s`` and ``step_wall_s`` are
    :class:`~kvblocks.simulate.aggregates.Distribution` summaries (exact mean and
    maximum, percentiles within ~1%), and ``timeline`` holds exact per-step means and
    peaks of ``kv_usage``, ``running_seqs``, ``waiting``, ``prefix_hit_rate``,
    ``used_blocks`` (paged) and ``contiguous_blocks`` (what prompt + max_tokens
    reservation would hold for the same running requests), plus a plot series of at
    most a few thousand points.
    """

    config: SimulationConfig
    num_requests: int
    num_finished: int
    num_rejected: int
    num_steps: int
    simulated_time_s: float
    scheduler_wall_s: float
    total_wall_s: float
    prompt_tokens: int
    generated_tokens: int
    latency_s: Distribution
    step_wall_s: Distribution
    scheduler_stats: dict[str, int | float]
    timeline: Timeline

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict."""
        usable = self.config.num_blocks - 1
        t = self.timeline
        steps = max(self.num_steps, 1)
        mean_used = t.mean("used_blocks")
        mean_contig = t.mean("contiguous_blocks")
        stats = self.scheduler_stats
        return {
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "num_steps": self.num_steps,
            "simulated_time_s": self.simulated_time_s,
            "simulated_requests_per_s": self.num_finished / max(self.simulated_time_s, 1e-12),
            "simulated_output_tokens_per_s": self.generated_tokens
            / max(self.simulated_time_s, 1e-12),
            "scheduler_wall_s": self.scheduler_wall_s,
            "scheduler_requests_per_s": self.num_finished / max(self.scheduler_wall_s, 1e-12),
            "scheduler_steps_per_s": self.num_steps / max(self.scheduler_wall_s, 1e-12),
            "mean_step_us": 1e6 * self.scheduler_wall_s / steps,
            "p99_step_us": 1e6 * self.step_wall_s.percentile(99),
            "total_wall_s": self.total_wall_s,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "mean_latency_s": self.latency_s.mean,
            "p99_latency_s": self.latency_s.percentile(99),
            "mean_kv_usage": t.mean("kv_usage"),
            "peak_kv_usage": t.peak("kv_usage"),
            "prefix_hit_rate": float(stats.get("prefix_hit_rate", 0.0)),
            "preemptions_recompute": int(stats.get("num_preemptions_recompute", 0)),
            "preemptions_swap": int(stats.get("num_preemptions_swap", 0)),
            "usable_blocks": usable,
            "peak_used_blocks": t.peak("used_blocks"),
            "peak_contiguous_blocks": t.peak("contiguous_blocks"),
            "mean_used_blocks": mean_used,
            "mean_contiguous_blocks": mean_contig,
            "contiguous_over_paged": mean_contig / mean_used if mean_used else 0.0,
            "memory_saved_by_paging": 1.0 - mean_used / mean_contig if mean_contig else 0.0,
        }


def _fake_model(output: SchedulerOutput, rng: np.random.Generator, vocab: int) -> ModelStepResult:
    total = int(output.sample_counts.sum())
    tokens = rng.integers(0, vocab, size=total, dtype=np.int64)
    logprobs = np.zeros(total, dtype=np.float32)
    topk_ids = topk_lps = None
    if output.beam_topk:
        rows, k = output.num_sample_rows, output.beam_topk
        topk_ids = rng.integers(0, vocab, size=(rows, k), dtype=np.int64)
        topk_lps = -np.sort(rng.random((rows, k)), axis=1).astype(np.float32)
    return ModelStepResult(tokens, logprobs, topk_ids, topk_lps)


class _NoProgress:
    """Stands in for tqdm when it is not installed or the bar is off."""

    def update(self, n: int = 1) -> None:
        """Ignore progress."""

    def close(self) -> None:
        """Nothing to close."""


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (the "cli" extra)
        return _NoProgress()
    return tqdm(total=total, unit="req", file=sys.stderr, leave=False)


def run_simulation(config: SimulationConfig) -> SimulationResult:
    """Run the workload through a fresh scheduler and block manager.

    The trace is drawn lazily and only running requests are kept, so memory does not
    grow with ``config.workload.num_requests``.
    """
    started = time.perf_counter()
    arrivals = iter_workload(config.workload)
    manager = KVCacheManager(
        config.num_blocks,
        config.block_size,
        num_cpu_blocks=config.num_cpu_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        record_events=False,  # nothing drains them: they would pile up
    )
    # No per-step history: the timeline below keeps what the report needs in fixed memory.
    scheduler = Scheduler(manager, config.scheduler, record_history=False)
    reserve = ContiguousReservation(config.block_size)
    live: dict[str, SimRequest] = {}  # admitted, not yet finished
    rng = np.random.default_rng(config.workload.seed + 1)
    vocab = config.workload.vocab_size
    cost = config.cost_model
    clock = 0.0
    sched_wall = 0.0
    idle_steps = 0
    rejected = 0
    finished = 0
    prompt_tokens = 0
    generated = 0
    latency = Distribution()
    step_wall = Distribution()
    timeline = Timeline(_TIMELINE_COLUMNS)
    usable = config.num_blocks - 1
    num_requests = config.workload.num_requests
    bar = _progress_bar(num_requests, config.progress)
    upcoming = next(arrivals, None)
    try:
        while upcoming is not None or scheduler.has_unfinished_requests():
            while upcoming is not None and upcoming.arrival_time <= clock:
                sim = upcoming
                upcoming = next(arrivals, None)
                params = SamplingParams(max_tokens=sim.output_len, n=sim.n, ignore_eos=True)
                try:
                    scheduler.add_request(
                        Request(
                            sim.request_id,
                            sim.prompt_token_ids,
                            params,
                            sim.arrival_time,
                            priority=sim.priority,
                        )
                    )
                except InvalidArgumentError:
                    rejected += 1
                    bar.update(1)
                    continue
                live[sim.request_id] = sim
                prompt_tokens += len(sim.prompt_token_ids)
            if not scheduler.has_unfinished_requests():
                if upcoming is None:
                    break  # the last arrivals were all rejected: nothing left to run
                clock = upcoming.arrival_time
                continue
            t0 = time.perf_counter()
            output = scheduler.schedule()
            t1 = time.perf_counter()
            result = _fake_model(output, rng, vocab)
            t2 = time.perf_counter()
            done = scheduler.update(output, result)
            t3 = time.perf_counter()
            wall = (t1 - t0) + (t3 - t2)
            step_wall.add(wall)
            sched_wall += wall
            dt = cost.step_time(output)
            if dt == 0.0:
                idle_steps += 1
                if upcoming is not None:
                    clock = max(clock, upcoming.arrival_time)
                elif idle_steps > _MAX_IDLE_STEPS:
                    raise SimulationError(
                        "the scheduler made no progress for 10,000 steps; the pool is too "
                        "small for the workload (raise --num-blocks)"
                    )
            else:
                idle_steps = 0
            clock += dt
            for out in done:
                finished += 1
                generated += sum(len(c.token_ids) for c in out.outputs)
                latency.add(clock - live.pop(out.request_id).arrival_time)
            if done:
                bar.update(len(done))
            usage = float(manager.usage())
            running = scheduler.running_request_ids()
            timeline.add(
                clock,
                (
                    usage,
                    float(output.num_seqs),
                    float(scheduler.stats()["num_waiting"]),
                    scheduler.counters.prefix_hit_rate,
                    usage * usable,
                    reserve.blocks_for(live[r] for r in running),
                ),
            )
    finally:
        bar.close()
    return SimulationResult(
        config=config,
        num_requests=num_requests,
        num_finished=finished,
        num_rejected=rejected,
        num_steps=timeline.num_steps,
        simulated_time_s=clock,
        scheduler_wall_s=sched_wall,
        total_wall_s=time.perf_counter() - started,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        latency_s=latency,
        step_wall_s=step_wall,
        scheduler_stats=scheduler.stats(),
        timeline=timeline,
    )
