"""Fixed-size summaries of a simulation, so memory does not grow with the run's length.

A long run (a million requests, millions of steps) must not keep one record per request
or per step: :class:`Distribution` keeps a count, sum, maximum and a log-bucketed
histogram (percentiles to within :data:`RELATIVE_RESOLUTION`), and :class:`Timeline`
keeps exact per-column means and peaks plus a plot-sized series that averages ever
larger runs of consecutive steps as the run goes on.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError

__all__ = ["RELATIVE_RESOLUTION", "Distribution", "Timeline"]

# Histogram range: 1 ns to ~11.6 days covers every latency and step time a run produces;
# values outside are clamped into the first or last bucket.
_LOW = 1e-9
_HIGH = 1e6
_BUCKETS_PER_DECADE = 240
_NUM_BUCKETS = math.ceil(math.log10(_HIGH / _LOW) * _BUCKETS_PER_DECADE) + 1

RELATIVE_RESOLUTION = 10 ** (1 / _BUCKETS_PER_DECADE) - 1
"""Relative width of one histogram bucket (~1%): the error bound of a percentile."""


class Distribution:
    """Count, sum, maximum and a log-bucketed histogram of non-negative values.

    Memory is fixed (a few thousand counters) however many values are added.
    """

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self._zeros = 0  # values <= 0 (a step that took no measurable time)
        self._counts = np.zeros(_NUM_BUCKETS, dtype=np.int64)

    def add(self, value: float) -> None:
        """Record one value; one that is not finite raises InvalidArgumentError."""
        if not math.isfinite(value):
            # A cost past the float range (a bandwidth of 1e-320 GB/s) made a time inf.
            raise InvalidArgumentError(
                f"a simulated time or size is {value}, past the float range: a rate, "
                "time or bandwidth option is too extreme"
            )
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        if value <= 0.0:
            self._zeros += 1
            return
        index = int(math.log10(value / _LOW) * _BUCKETS_PER_DECADE) if value > _LOW else 0
        self._counts[min(max(index, 0), _NUM_BUCKETS - 1)] += 1

    @property
    def mean(self) -> float:
        """Exact mean (0 when empty)."""
        return self.total / self.count if self.count else 0.0

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100), within :data:`RELATIVE_RESOLUTION`; 0 when empty.

        Returns the upper edge of the bucket holding the percentile, capped at the exact
        maximum, so ``percentile(100) == max``.
        """
        if not self.count:
            return 0.0
        rank = q / 100.0 * self.count
        if rank <= self._zeros:
            return 0.0
        cumulative = np.cumsum(self._counts) + self._zeros
        index = int(np.searchsorted(cumulative, rank, side="left"))
        index = min(index, _NUM_BUCKETS - 1)
        upper = _LOW * 10 ** ((index + 1) / _BUCKETS_PER_DECADE)
        return min(upper, self.max)


class Timeline:
    """Per-step samples of named columns: exact means and peaks, a bounded plot series.

    Each :meth:`add` is one step. The plot series holds at most ``max_points`` points:
    when it fills up, neighbouring points are averaged in pairs and each later point
    averages twice as many steps, so a run of any length fits. The ``time_s`` column of
    a point is the simulated clock at the end of its last step.

    Args:
        columns: names of the sampled quantities (``time_s`` is added).
        max_points: bound on the plot series (even, >= 2).
    """

    def __init__(self, columns: tuple[str, ...], max_points: int = 4096) -> None:
        if max_points < 2 or max_points % 2:
            raise InvalidArgumentError(f"max_points must be an even number >= 2, got {max_points}")
        self.columns = columns
        self.max_points = max_points
        self.num_steps = 0
        self._sum = [0.0] * len(columns)
        self._max = [-math.inf] * len(columns)
        self._points = np.zeros((max_points, len(columns) + 1), dtype=np.float64)
        self._num_points = 0
        self._stride = 1  # steps averaged per point
        self._bucket = [0.0] * len(columns)
        self._bucket_steps = 0
        self._last_time = 0.0

    def add(self, time_s: float, values: tuple[float, ...]) -> None:
        """Record one step's values (in ``columns`` order) ending at simulated ``time_s``."""
        # Plain Python floats per step (a handful of columns): cheaper than NumPy calls.
        self.num_steps += 1
        self._last_time = time_s
        sums, peaks, bucket = self._sum, self._max, self._bucket
        for i, value in enumerate(values):
            sums[i] += value
            if value > peaks[i]:
                peaks[i] = value
            bucket[i] += value
        self._bucket_steps += 1
        if self._bucket_steps < self._stride:
            return
        if self._num_points == self.max_points:
            # Full: merge neighbouring points pairwise (mean of values, later clock).
            pts = self._points
            half = self.max_points // 2
            merged_time = pts[1::2, 0].copy()
            merged_values = (pts[0::2, 1:] + pts[1::2, 1:]) / 2
            pts[:half, 0] = merged_time
            pts[:half, 1:] = merged_values
            self._num_points = half
            self._stride *= 2
            if self._bucket_steps < self._stride:
                return
        self._points[self._num_points, 0] = time_s
        self._points[self._num_points, 1:] = [b / self._bucket_steps for b in bucket]
        self._num_points += 1
        self._bucket = [0.0] * len(self.columns)
        self._bucket_steps = 0

    def mean(self, column: str) -> float:
        """Exact mean of a column over every step (0 before the first step)."""
        if not self.num_steps:
            return 0.0
        return float(self._sum[self.columns.index(column)] / self.num_steps)

    def peak(self, column: str) -> float:
        """Exact maximum of a column over every step (0 before the first step)."""
        if not self.num_steps:
            return 0.0
        return float(self._max[self.columns.index(column)])

    def series(self) -> dict[str, npt.NDArray[np.float64]]:
        """The plot series: ``time_s`` plus each column, one array per name.

        Steps not yet averaged into a full point form one last, shorter point.
        """
        pts = self._points[: self._num_points]
        if self._bucket_steps:
            partial = [self._last_time] + [b / self._bucket_steps for b in self._bucket]
            pts = np.vstack([pts, partial])
        out = {"time_s": pts[:, 0].copy()}
        for i, name in enumerate(self.columns):
            out[name] = pts[:, i + 1].copy()
        return out
