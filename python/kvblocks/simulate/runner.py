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
from kvblocks.scheduler import ModelStepResult, Request, Scheduler
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.simulate.aggregates import Distribution, Timeline
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.contiguous import ContiguousReservation
from kvblocks.simulate.cost_model import CostModel, tier_ops
from kvblocks.simulate.layer_mix import LayerMixTotals
from kvblocks.simulate.metrics import RequestMetrics, ThroughputWindow
from kvblocks.simulate.workload import ArrivalQueue, SimRequest, count_conversations

__all__ = [
    "SimulationError",
    "SimulationResult",
    "TierTotals",
    "request_for",
    "run_simulation",
]

_MAX_IDLE_STEPS = 10_000
_FOLLOW_UP_HEAD_START = 1e9
"""Seconds subtracted from a follow-up's arrival time under ``follow_ups_first``: earlier
than any conversation start, so arrival-ordered policies admit it first."""


def request_for(sim: SimRequest, follow_ups_first: bool) -> Request:
    """The scheduler request of a simulated arrival: its trace's output length exactly (EOS
    ignored), and under ``follow_ups_first`` a follow-up turn queued before any conversation
    start."""
    queue_time = sim.arrival_time
    if follow_ups_first and sim.turn:
        queue_time -= _FOLLOW_UP_HEAD_START
    return Request(
        sim.request_id,
        sim.prompt_token_ids,
        SamplingParams(max_tokens=sim.output_len, n=sim.n, ignore_eos=True),
        queue_time,
        priority=sim.priority,
    )


class SimulationError(KVBlocksError):
    """The simulation cannot make progress (a configuration that can never serve a request)."""


_TIMELINE_COLUMNS = (
    "kv_usage",
    "running_seqs",
    "waiting",
    "prefix_hit_rate",
    "used_blocks",
    "contiguous_blocks",
)


@dataclass
class TierTotals:
    """Prefill work and host-tier traffic of a run (all zero but the first without a tier).

    Attributes:
        prefill_tokens_computed: prompt tokens the model computed (``num_prefill_tokens``
            summed over steps: misses, and recomputes after preemption).
        blocks_loaded, blocks_offloaded: host-tier ``"load"`` / ``"offload"`` ops.
        transfer_s: seconds their bytes take over the host link.
        transfer_added_s: seconds they added to the steps (less than ``transfer_s`` where
            write-through offloads overlap compute; see :class:`CostModel`).
        readmitted_loads: the loads of recompute readmissions (their own blocks coming
            back, not prompt hits: the prefix hit rate counts first admissions only).
    """

    prefill_tokens_computed: int = 0
    blocks_loaded: int = 0
    blocks_offloaded: int = 0
    transfer_s: float = 0.0
    transfer_added_s: float = 0.0
    readmitted_loads: int = 0

    def add(self, output: SchedulerOutput, cost: CostModel, block_size: int, step_s: float) -> None:
        """Count one step that the cost model charged ``step_s`` seconds."""
        self.prefill_tokens_computed += output.num_prefill_tokens
        loads, offloads = tier_ops(output)
        if loads or offloads:
            self.blocks_loaded += loads
            self.blocks_offloaded += offloads
            self.transfer_s += cost.transfer_time(loads + offloads, block_size)
            compute = 0.0
            if not output.is_empty:
                compute = cost.time(output.num_tokens, int(output.seq_lens.sum(dtype="int64")))
            self.transfer_added_s += step_s - compute

    def summary(
        self, cost: CostModel, block_size: int, prompt_tokens: int, cached_tokens: int
    ) -> dict[str, Any]:
        """JSON-ready numbers; the prefix hit rate split into GPU and host-tier hits.

        ``prompt_tokens`` / ``cached_tokens``: prompt tokens first admitted / found cached
        at first admission (GPU and tier), as in the scheduler's prefix hit rate. Tier
        hits are the tokens of the blocks those admissions loaded (not
        ``readmitted_loads``); the rest of the cached tokens are GPU hits.
        """
        host_tokens = max(self.blocks_loaded - self.readmitted_loads, 0) * block_size
        denom = max(prompt_tokens, 1)
        return {
            "gpu_hit_rate": max(cached_tokens - host_tokens, 0) / denom,
            "host_hit_rate": host_tokens / denom,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "blocks_loaded": self.blocks_loaded,
            "blocks_offloaded": self.blocks_offloaded,
            "transfer_bytes": (self.blocks_loaded + self.blocks_offloaded)
            * cost.block_bytes(block_size),
            "transfer_s": self.transfer_s,
            "transfer_added_s": self.transfer_added_s,
        }


@dataclass
class SimulationResult:
    """Outcome of :func:`run_simulation`: summary numbers and fixed-size aggregates.

    Nothing in it grows with the run: ``metrics`` (queueing delay, TTFT, TPOT and
    latency on the simulated clock) and ``step_wall_s`` hold
    :class:`~kvblocks.simulate.aggregates.Distribution` summaries (exact mean and
    maximum, percentiles within ~1%); ``saturated_requests_per_s`` is the completion rate
    of the saturated steps (:class:`~kvblocks.simulate.metrics.ThroughputWindow`;
    ``window_saturated`` False: none was, and it is the whole run's completion rate);
    ``history_tokens`` counts prompt tokens carried over from earlier turns; and
    ``timeline`` holds exact per-step means and peaks (memory as the step runs,
    before it frees its finished requests' blocks) of ``kv_usage``,
    ``running_seqs``, ``waiting``, ``prefix_hit_rate``,
    ``used_blocks`` (paged) and ``contiguous_blocks`` (what prompt + max_tokens
    reservation would hold for the same running requests), plus a plot series of at
    most a few thousand points.
    """

    config: SimulationConfig
    num_requests: int
    num_admitted: int
    num_finished: int
    num_rejected: int
    num_steps: int
    simulated_time_s: float
    scheduler_wall_s: float
    total_wall_s: float
    prompt_tokens: int
    history_tokens: int
    generated_tokens: int
    metrics: RequestMetrics
    saturated_requests_per_s: float
    step_wall_s: Distribution
    scheduler_stats: dict[str, int | float]
    timeline: Timeline
    tier: TierTotals = field(default_factory=TierTotals)
    layer_mix: LayerMixTotals | None = None
    window_saturated: bool = True

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict."""
        usable = self.config.num_blocks - 1
        t = self.timeline
        steps = max(self.num_steps, 1)
        mean_used = t.mean("used_blocks")
        mean_contig = t.mean("contiguous_blocks")
        stats = self.scheduler_stats
        cfg = self.config
        tier = self.tier.summary(
            cfg.cost_model,
            cfg.block_size,
            int(stats.get("num_prompt_tokens_admitted", 0)),
            int(stats.get("num_cached_tokens_admitted", 0)),
        )
        return {
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "num_cut_short": self.metrics.num_cut_short,
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
            "history_tokens": self.history_tokens,
            **self.metrics.summary(),
            "latency_stable": self.metrics.is_stable(),
            "window_saturated": self.window_saturated,
            "mean_batch_seqs": t.mean("running_seqs"),
            "peak_batch_seqs": t.peak("running_seqs"),
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
            "host_cache_blocks": cfg.host_cache_blocks,
            **tier,
            **({"layer_mix": self.layer_mix.summary()} if self.layer_mix is not None else {}),
        }


def _fake_model(output: SchedulerOutput, rng: np.random.Generator, vocab: int) -> ModelStepResult:
    total = int(output.sample_counts.sum())
    tokens = rng.integers(0, vocab, size=total, dtype=np.int64)
    topk_ids = topk_lps = None
    if output.beam_topk:
        rows, k = output.num_sample_rows, output.beam_topk
        topk_ids = rng.integers(0, vocab, size=(rows, k), dtype=np.int64)
        topk_lps = -np.sort(rng.random((rows, k)), axis=1).astype(np.float32)
    # No sampled log-probs: nothing reads them, and the scheduler takes None as zeros.
    return ModelStepResult(tokens, None, topk_ids, topk_lps)


@dataclass
class _Live:
    """An admitted request: its trace entry, arrival index and first-token time."""

    sim: SimRequest
    index: int
    reserved: int  # tokens a contiguous server would reserve for it
    first_token_time: float | None = None


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
    grow with ``config.workload.num_requests``. A multi-turn conversation's next turn is
    created when its previous turn finishes (see :mod:`kvblocks.simulate.workload`).
    """
    started = time.perf_counter()
    arrivals = ArrivalQueue(config.workload)
    manager = KVCacheManager(
        config.num_blocks,
        config.block_size,
        num_cpu_blocks=config.num_cpu_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        record_events=False,  # nothing drains them: they would pile up
        host_cache_blocks=config.host_cache_blocks,
        host_offload=config.host_offload,  # type: ignore[arg-type]
    )
    # No per-step history: the timeline below keeps what the report needs in fixed memory.
    scheduler = Scheduler(manager, config.scheduler, record_history=False)
    reserve = ContiguousReservation(config.block_size)
    live: dict[str, _Live] = {}  # admitted, not yet finished
    awaiting_step: dict[str, _Live] = {}  # admitted, never scheduled
    awaiting_token: dict[str, _Live] = {}  # scheduled, no token yet
    rng = np.random.default_rng(config.workload.seed + 1)
    vocab = config.workload.vocab_size
    cost = config.cost_model
    num_requests = config.workload.num_requests
    metrics = RequestMetrics(num_requests, count_conversations(config.workload))
    window = ThroughputWindow(num_requests)
    clock = 0.0
    sched_wall = 0.0
    idle_steps = 0
    rejected = 0
    rejected_arrivals = 0
    finished = 0
    arrived = 0
    prompt_tokens = 0
    history_tokens = 0
    generated = 0
    step_wall = Distribution()
    timeline = Timeline(_TIMELINE_COLUMNS)
    tier = TierTotals()
    mix = None if config.layer_mix is None else LayerMixTotals(config.layer_mix, config.block_size)
    usable = config.num_blocks - 1
    bar = _progress_bar(num_requests, config.progress)
    try:
        while True:
            while (sim := arrivals.pop_due(clock)) is not None:
                index = arrived
                arrived += 1
                try:
                    scheduler.add_request(request_for(sim, config.follow_ups_first))
                except InvalidArgumentError:
                    # The conversation's later turns never arrive: count them too.
                    rejected_arrivals += 1
                    lost = 1 + len(sim.next_turns)
                    rejected += lost
                    bar.update(lost)
                    continue
                entry = _Live(sim, index, reserve.tokens_for((sim,)))
                live[sim.request_id] = entry
                awaiting_step[sim.request_id] = entry
                prompt_tokens += len(sim.prompt_token_ids)
                history_tokens += sim.history_len
            if not scheduler.has_unfinished_requests():
                upcoming = arrivals.next_time()
                if upcoming is None:
                    break  # nothing running and nothing left to arrive
                clock = max(clock, upcoming)
                continue
            t0 = time.perf_counter()
            output = scheduler.schedule()
            t1 = time.perf_counter()
            # KV held while the step runs: update() frees the blocks of the requests it
            # finishes, which the step still used.
            usage = float(manager.usage())
            result = _fake_model(output, rng, vocab)
            t2 = time.perf_counter()
            outputs = scheduler.update(output, result)
            t3 = time.perf_counter()
            wall = (t1 - t0) + (t3 - t2)
            step_wall.add(wall)
            sched_wall += wall
            running = scheduler.running_request_ids()
            step_start = clock
            dt = cost.step_time(output, config.block_size, config.host_offload == "commit")
            tier.add(output, cost, config.block_size, dt)
            if mix is not None and not output.is_empty:
                mix.add(output.seq_lens, output.num_scheduled_tokens)
            if dt == 0.0:
                idle_steps += 1
                upcoming = arrivals.next_time()
                if upcoming is not None:
                    clock = max(clock, upcoming)
                elif idle_steps > _MAX_IDLE_STEPS:
                    raise SimulationError(
                        "the scheduler made no progress for 10,000 steps; the pool is too "
                        "small for the workload (raise --num-blocks)"
                    )
            else:
                idle_steps = 0
            clock += dt
            if awaiting_step and dt:
                for rid in awaiting_step.keys() & set(running).union(output.sample_request_ids):
                    entry = awaiting_step.pop(rid)
                    metrics.scheduled(
                        entry.sim.conversation, entry.sim.turn, step_start - entry.sim.arrival_time
                    )
                    awaiting_token[rid] = entry
            if awaiting_token and output.sample_request_ids:
                for rid in awaiting_token.keys() & set(output.sample_request_ids):
                    entry = awaiting_token.pop(rid)
                    entry.first_token_time = clock
                    metrics.first_token(clock - entry.sim.arrival_time)
            # The finished requests' final records (full token_ids), without building the
            # running requests' per-step records.
            done = outputs.finished
            in_step = set(output.sample_request_ids) if done else ()
            finished_reserved = 0  # the reservations of the batch's finished requests
            for out in done:
                finished += 1
                generated += sum(len(c.token_ids) for c in out.outputs)
                entry = live.pop(out.request_id)
                if out.request_id in in_step:
                    finished_reserved += entry.reserved
                awaiting_step.pop(out.request_id, None)
                awaiting_token.pop(out.request_id, None)
                sim = entry.sim
                first = entry.first_token_time if entry.first_token_time is not None else clock
                tokens = max(len(c.token_ids) for c in out.outputs)
                metrics.finished(clock - sim.arrival_time, clock - first, tokens, sim.output_len)
                follow = sim.next_turn(out.outputs[0].token_ids, clock)
                if follow is not None:
                    arrivals.push(follow)
            queued = scheduler.num_unfinished_requests() - len(running)
            window.step(dt, len(done), queued > 0)
            if done:
                bar.update(len(done))
                if config.stop_at_window and window.is_closed():
                    break
            timeline.add(
                clock,
                (
                    usage,
                    float(output.num_seqs),
                    # Not scheduler.stats(): it builds the whole counter dict every step.
                    float(queued),
                    scheduler.counters.prefix_hit_rate,
                    usage * usable,
                    (sum(live[r].reserved for r in running if r in live) + finished_reserved)
                    / config.block_size,
                ),
            )
    finally:
        bar.close()
    tier.readmitted_loads = scheduler.counters.num_readmitted_load_blocks
    return SimulationResult(
        config=config,
        num_requests=num_requests,
        num_admitted=arrived - rejected_arrivals,
        num_finished=finished,
        num_rejected=rejected,
        num_steps=timeline.num_steps,
        simulated_time_s=clock,
        scheduler_wall_s=sched_wall,
        total_wall_s=time.perf_counter() - started,
        prompt_tokens=prompt_tokens,
        history_tokens=history_tokens,
        generated_tokens=generated,
        metrics=metrics,
        saturated_requests_per_s=window.rate(clock),
        window_saturated=window.saturated,
        step_wall_s=step_wall,
        scheduler_stats=scheduler.stats(),
        timeline=timeline,
        tier=tier,
        layer_mix=mix,
    )
