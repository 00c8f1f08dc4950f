"""Per-request latency metrics on the simulated clock, in fixed memory.

Definitions (all in the cost model's simulated seconds):

- **queueing delay**: arrival until the start of the first step that computes any of the
  request's tokens;
- **TTFT** (time to first token): arrival until the end of the step that samples its
  first token;
- **TPOT** (time per output token): ``(finish - first token) / (tokens - 1)``, for
  requests with more than one output token, ``tokens`` being what the request produced
  (its longest sequence's): its output length, or fewer when a sequence that alone fills
  the pool ended early (reason ``"length"``; counted in ``num_cut_short``);
- **latency**: arrival until its last sequence finishes.

The stability rule of the capacity search (:meth:`RequestMetrics.is_stable`) compares the
queueing delay of the conversations that started last with that of those that started
earlier. Only first turns count: they arrive at the trace's rate whatever the server does,
while a follow-up turn arrives a think time after its previous turn finished (closed loop),
so an overloaded server also delays the follow-ups' arrivals and they queue little.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.simulate.aggregates import Distribution

__all__ = ["PERCENTILES", "RequestMetrics", "StabilityRule", "ThroughputWindow"]

PERCENTILES = (50, 90, 99)
"""The percentiles every report shows."""


@dataclass(frozen=True)
class StabilityRule:
    """When a run's latency counts as stable (the queue does not grow with the trace).

    Conversations are split into quarters by the order they started in, and each
    quarter's mean is over its first turns' queueing delays (follow-up turns are closed
    loop: see the module docstring). Under a rate the server sustains, queueing delay
    settles after a warm-up, so the last quarter waits about as long as the second;
    above capacity the queue grows by a fixed amount per request, so the last quarter
    waits about ``(7/8) / (3/8) = 2.3x`` as long as the second. A run is stable when

        ``mean_delay(last quarter) <= growth * mean_delay(second quarter) + slack_s``

    ``slack_s`` keeps delays too small to matter (a few steps) from counting as growth.

    Attributes:
        growth: allowed ratio of the last to the second quarter's mean queueing delay.
        slack_s: absolute allowance in simulated seconds.
    """

    growth: float = 1.5
    slack_s: float = 0.25

    def holds(self, second_quarter_s: float, last_quarter_s: float) -> bool:
        """Whether the two quarters' mean queueing delays satisfy the rule."""
        return last_quarter_s <= self.growth * second_quarter_s + self.slack_s


class RequestMetrics:
    """Distributions of queueing delay, TTFT, TPOT and latency, plus per-quarter delays.

    Args:
        num_requests: requests expected.
        num_conversations: conversations in the trace
            (:func:`~kvblocks.simulate.workload.count_conversations`), to assign the
            start-order quarters; default ``num_requests`` (every request a conversation
            of one turn).
    """

    def __init__(self, num_requests: int, num_conversations: float | None = None) -> None:
        self.num_requests = max(num_requests, 1)
        self.num_conversations = max(
            float(num_requests if num_conversations is None else num_conversations), 1.0
        )
        self.queue_delay = Distribution()
        self.ttft = Distribution()
        self.tpot = Distribution()
        self.latency = Distribution()
        self._quarter_sum = [0.0] * 4
        self._quarter_count = [0] * 4
        #: Finished requests that produced fewer tokens than their output length.
        self.num_cut_short = 0

    def scheduled(self, conversation: int, turn: int, delay_s: float) -> None:
        """Turn ``turn`` (0: the first) of conversation ``conversation`` (the index in start
        order, from 0) got its first step ``delay_s`` after it arrived."""
        self.queue_delay.add(delay_s)
        if turn == 0:
            quarter = min(int(4 * conversation // self.num_conversations), 3)
            self._quarter_sum[quarter] += delay_s
            self._quarter_count[quarter] += 1

    def first_token(self, ttft_s: float) -> None:
        """A request sampled its first token ``ttft_s`` after arriving."""
        self.ttft.add(ttft_s)

    def finished(self, latency_s: float, decode_s: float, tokens: int, output_len: int) -> None:
        """A request finished: end-to-end ``latency_s``; ``decode_s`` after its first token;
        ``tokens`` produced (its longest sequence's) of the ``output_len`` it asked for."""
        self.latency.add(latency_s)
        if tokens < output_len:
            self.num_cut_short += 1
        if tokens > 1:
            self.tpot.add(decode_s / (tokens - 1))

    def quarter_delay(self, quarter: int) -> float:
        """Mean queueing delay of the first turns in start quarter ``quarter`` (0..3)."""
        count = self._quarter_count[quarter]
        return self._quarter_sum[quarter] / count if count else 0.0

    def is_stable(self, rule: StabilityRule | None = None) -> bool:
        """Whether the queue stayed bounded over the trace (see :class:`StabilityRule`).

        A run in which not every quarter got a first turn scheduled is not stable (too
        few conversations to tell, or nothing ran).
        """
        rule = rule or StabilityRule()
        if not all(self._quarter_count[1:]):
            return self.num_conversations < 4 and self.queue_delay.count > 0
        return rule.holds(self.quarter_delay(1), self.quarter_delay(3))

    def summary(self) -> dict[str, float]:
        """``{metric}_p{q}_s`` for every metric and percentile, plus means."""
        out: dict[str, float] = {}
        for name in ("queue_delay", "ttft", "tpot", "latency"):
            dist: Distribution = getattr(self, name)
            out[f"mean_{name}_s"] = dist.mean
            for q in PERCENTILES:
                out[f"{name}_p{q}_s"] = dist.percentile(q)
        return out


class ThroughputWindow:
    """Completion rate of the saturated steps between the 10% and 90% completion marks.

    A step is *saturated* when requests were still queued after it was scheduled (the
    server had more work than it could batch). Counting only those steps, and only
    between the marks, measures what the server sustains when never short of work,
    without the ramp-up, the drain, or gaps while multi-turn follow-ups are pending.
    """

    def __init__(self, num_requests: int) -> None:
        self._low = max(1, num_requests // 10)
        self._high = max(self._low + 1, (9 * num_requests) // 10)
        self._finished = 0
        self._time = 0.0
        self._count = 0

    def step(self, dt: float, finished_now: int, saturated: bool) -> None:
        """One step of ``dt`` simulated seconds that finished ``finished_now`` requests."""
        inside = self._low <= self._finished < self._high
        self._finished += finished_now
        if inside and saturated:
            self._time += dt
            self._count += finished_now

    @property
    def saturated(self) -> bool:
        """Some step in the window left requests queued: :meth:`rate` is what the server
        completes when never short of work. Otherwise it is the completion rate of a server
        that was (what was offered: a lower bound on what it sustains)."""
        return self._time > 0

    def is_closed(self) -> bool:
        """The 90% mark has been reached."""
        return self._finished >= self._high

    def rate(self, clock: float) -> float:
        """Requests per second over the saturated steps in the window; if there were
        none, the whole run's completions over ``clock``."""
        if self._time > 0:
            return self._count / self._time
        return self._finished / clock if clock > 0 else 0.0
