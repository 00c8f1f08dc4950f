"""Scheduler statistics: cumulative counters, request latencies and a per-step time series."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import numpy.typing as npt

from kvblocks.protocols import BlockManager

if TYPE_CHECKING:
    from kvblocks.scheduler.output import SchedulerOutput
    from kvblocks.scheduler.placement import Placement
    from kvblocks.scheduler.request import RequestMetrics

__all__ = ["LatencyStats", "SchedulerCounters", "StatsHistory", "gauges", "history_row"]

_PERCENTILES = (50, 90, 99)


@dataclass
class SchedulerCounters:
    """Counters since the scheduler was created (like the seed's ``Stats``).

    Host-tier loads (``SchedulerConfig.max_load_blocks_per_step``): ``num_load_blocks``
    queued, of which ``num_readmitted_load_blocks`` by recompute readmissions (like
    ``num_readmitted_cached_tokens``, not prompt hits); ``num_loads_deferred``, the loads
    of admissions put off to a later step because the step's bound was reached (counted
    at each step a request waits);
    ``num_loads_recomputed``, host-tier blocks computed instead of loaded because one
    request's loads exceeded the whole bound.

    ``num_requests_overdue``: waiting requests that reached ``max_wait_steps`` and were
    moved ahead of the policy's order (see :mod:`~kvblocks.scheduler.queues.wait_bound`).
    """

    num_steps: int = 0
    num_requests_added: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_prompt_tokens_admitted: int = 0
    num_cached_tokens_admitted: int = 0
    num_readmitted_tokens: int = 0
    num_readmitted_cached_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    num_load_blocks: int = 0
    num_readmitted_load_blocks: int = 0
    num_loads_deferred: int = 0
    num_loads_recomputed: int = 0
    num_requests_overdue: int = 0

    @property
    def num_preemptions(self) -> int:
        """Preemptions of both kinds."""
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache at first admission.

        Readmissions after a recompute preemption are counted apart
        (``readmission_hit_rate``): they mostly find their own blocks cached.
        """
        if self.num_prompt_tokens_admitted == 0:
            return 0.0
        return self.num_cached_tokens_admitted / self.num_prompt_tokens_admitted

    @property
    def readmission_hit_rate(self) -> float:
        """Share of the tokens of recompute readmissions served from the prefix cache."""
        if self.num_readmitted_tokens == 0:
            return 0.0
        return self.num_readmitted_cached_tokens / self.num_readmitted_tokens

    def as_dict(self) -> dict[str, int | float]:
        """The counters (ints) plus the derived rates (floats)."""
        out: dict[str, int | float] = dict(asdict(self))
        out["num_preemptions"] = self.num_preemptions
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["readmission_hit_rate"] = self.readmission_hit_rate
        return out


class StatsHistory:
    """One row of statistics per scheduling step (appended by ``Scheduler.schedule``).

    Keeps the latest ``max_rows`` steps (``None``: all), so a long-running server does
    not grow without bound.
    """

    def __init__(self, max_rows: int | None = 100_000) -> None:
        self.rows: deque[dict[str, float]] = deque(maxlen=max_rows)

    def append(self, row: dict[str, float]) -> None:
        """Record one step."""
        self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, float]:
        return self.rows[index]  # negative indices count from the latest step

    def column(self, name: str) -> npt.NDArray[np.float64]:
        """The time series of one statistic."""
        return np.fromiter((row[name] for row in self.rows), dtype=np.float64, count=len(self))

    def as_arrays(self) -> dict[str, npt.NDArray[np.float64]]:
        """Every statistic as a time series."""
        if not self.rows:
            return {}
        return {name: self.column(name) for name in self.rows[0]}


class LatencyStats:
    """Latencies of finished requests (aborted ones are left out), from their
    :class:`~kvblocks.scheduler.RequestMetrics`.

    Keeps the latest ``max_requests`` requests' values so that a long-running server
    does not grow without bound.
    """

    METRICS: ClassVar[dict[str, str]] = {
        "queue_time": "queue_time",
        "ttft": "time_to_first_token",
        "tpot": "time_per_output_token",
        "e2e_latency": "e2e_latency",
    }
    """Statistic name -> :class:`RequestMetrics` property."""

    def __init__(self, max_requests: int | None = 100_000) -> None:
        self.values: dict[str, deque[float]] = {
            name: deque(maxlen=max_requests) for name in self.METRICS
        }

    def add(self, metrics: RequestMetrics) -> None:
        """Record one finished request (values it does not have, e.g. TPOT of a single
        token, are skipped)."""
        for name, prop in self.METRICS.items():
            value = getattr(metrics, prop)
            if value is not None:
                self.values[name].append(float(value))

    def summary(self) -> dict[str, float]:
        """``{name}_mean_s`` and ``{name}_p50_s``/``_p90_s``/``_p99_s`` of queue time,
        TTFT, TPOT and end-to-end latency; 0.0 while no request has the value."""
        out: dict[str, float] = {}
        for name, values in self.values.items():
            data = np.fromiter(values, dtype=np.float64, count=len(values))
            out[f"{name}_mean_s"] = float(data.mean()) if data.size else 0.0
            pcts = np.percentile(data, _PERCENTILES) if data.size else [0.0] * len(_PERCENTILES)
            for p, v in zip(_PERCENTILES, pcts, strict=True):
                out[f"{name}_p{p}_s"] = float(v)
        return out


def gauges(
    placement: Placement, num_requests: int, manager: BlockManager, step: int
) -> dict[str, int | float]:
    """The scheduler's gauges at ``step``: requests running, waiting and swapped (a split
    request counts as running until its last part finishes), sequences running, KV usage
    and the longest current wait, in steps."""
    waiting, swapped = len(placement.waiting), len(placement.swapped)
    if placement.num_split:
        # Parts of a split request are queued on their own; the request counts as
        # running until its last part finishes.
        waiting = sum(1 for s in placement.waiting if s.parent is None)
        swapped = sum(1 for s in placement.swapped if s.parent is None)
    return {
        "num_running": num_requests - waiting - swapped,
        "num_running_seqs": len(placement.table) + len(placement.prefilling),
        "num_waiting": waiting,
        "num_swapped": swapped,
        "kv_usage": float(manager.usage()),
        "num_free_blocks": int(manager.num_free_blocks()),
        "longest_wait_steps": placement.wait_bound.longest_wait(step),
    }


def history_row(
    step_gauges: dict[str, int | float],
    counters: SchedulerCounters,
    output: SchedulerOutput,
    num_loads: int,
) -> dict[str, float]:
    """One :class:`StatsHistory` row (a float time series) for a scheduled step."""
    row = {name: float(value) for name, value in step_gauges.items()}
    row["step"] = float(counters.num_steps)
    row["num_batched_tokens"] = float(output.num_tokens)
    row["num_prefill_tokens"] = float(output.num_prefill_tokens)
    row["num_decode_tokens"] = float(output.num_decode_tokens)
    row["num_preemptions"] = float(counters.num_preemptions)
    row["num_load_blocks"] = float(num_loads)
    row["prefix_hit_rate"] = counters.prefix_hit_rate
    return row
