"""What contiguous per-request KV reservation would hold (the pre-paging baseline).

Servers before paged attention reserved one contiguous KV buffer per sequence, sized for
``prompt + max_tokens`` because the final length is unknown, and could share nothing
between sequences. Paging allocates blocks as tokens arrive and shares prefix and forked
blocks; comparing the two for the same running batch shows the memory paging saves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.metrics import RequestMetrics, ThroughputWindow
from kvblocks.simulate.workload import ArrivalQueue, SimRequest, count_conversations

if TYPE_CHECKING:
    from kvblocks.simulate.config import SimulationConfig

__all__ = [
    "CONTIGUOUS_RULES",
    "ContiguousReservation",
    "ContiguousResult",
    "reservation_tokens",
    "run_contiguous",
]


class ContiguousReservation:
    """Reservation of a batch under contiguous allocation, in blocks of ``block_size``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def tokens_for(self, requests: Iterable[SimRequest]) -> int:
        """Tokens reserved: ``n * (prompt + declared max_tokens)`` per request."""
        return sum(r.n * (len(r.prompt_token_ids) + r.declared_max_tokens) for r in requests)

    def blocks_for(self, requests: Iterable[SimRequest]) -> float:
        """The same, expressed in blocks (for comparison with the paged pool)."""
        return self.tokens_for(requests) / self.block_size


CONTIGUOUS_RULES = ("max_tokens", "exact")
"""Reservation sizes: the client's ``max_tokens`` (what a real contiguous server must
reserve) or the actual output length (an oracle that knows it: the lower bound)."""


@dataclass
class ContiguousResult:
    """Outcome of :func:`run_contiguous`: a contiguous-reservation server on the same trace.

    Attributes:
        rule: ``"max_tokens"`` or ``"exact"`` (see :data:`CONTIGUOUS_RULES`).
        num_finished, num_rejected, num_steps, simulated_time_s, generated_tokens: as for
            the paged run.
        mean_batch_seqs, peak_batch_seqs: sequences per step (the batch size).
        mean_reserved_tokens, peak_reserved_tokens: KV tokens reserved.
        metrics: queueing delay, TTFT, TPOT and latency on the simulated clock.
        saturated_requests_per_s: completion rate of the saturated steps
            (:class:`~kvblocks.simulate.metrics.ThroughputWindow`).
        window_saturated: some step in the window left requests queued (False: the rate
            is the whole run's, a lower bound on what the server sustains).
    """

    rule: str
    num_finished: int
    num_rejected: int
    num_steps: int
    simulated_time_s: float
    generated_tokens: int
    mean_batch_seqs: float
    peak_batch_seqs: int
    mean_reserved_tokens: float
    peak_reserved_tokens: int
    metrics: RequestMetrics
    saturated_requests_per_s: float
    window_saturated: bool = True

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict."""
        return {
            "rule": self.rule,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "num_steps": self.num_steps,
            "simulated_time_s": self.simulated_time_s,
            "simulated_requests_per_s": self.num_finished / max(self.simulated_time_s, 1e-12),
            "simulated_output_tokens_per_s": self.generated_tokens
            / max(self.simulated_time_s, 1e-12),
            "mean_batch_seqs": self.mean_batch_seqs,
            "peak_batch_seqs": self.peak_batch_seqs,
            "mean_reserved_tokens": self.mean_reserved_tokens,
            "peak_reserved_tokens": self.peak_reserved_tokens,
            **self.metrics.summary(),
            "latency_stable": self.metrics.is_stable(),
            "window_saturated": self.window_saturated,
        }


def reservation_tokens(request: SimRequest, rule: str) -> int:
    """KV tokens a contiguous server reserves for ``request`` at admission.

    ``n * (prompt + max_tokens)`` under ``"max_tokens"``: the final length is unknown, so
    every sequence gets a buffer for the longest output the client allows, and nothing
    is shared between sequences or requests. ``"exact"`` uses the real output length.
    """
    budget = request.declared_max_tokens if rule == "max_tokens" else request.output_len
    return request.n * (len(request.prompt_token_ids) + budget)


def run_contiguous(config: SimulationConfig, rule: str = "max_tokens") -> ContiguousResult:
    """Serve ``config``'s trace with contiguous per-request reservation.

    The same GPU memory (``(num_blocks - 1) * block_size`` tokens), step limits
    (``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill), FCFS order and cost
    model as the paged run; a request is admitted only when its whole reservation
    (:func:`reservation_tokens`) fits, so it never needs preempting, and nothing is
    shared (no prefix cache, no copy-on-write). A request whose reservation exceeds the
    memory, or whose ``n`` exceeds ``max_num_seqs``, is rejected (with its conversation's
    later turns). Multi-turn follow-ups are created as for the paged run.

    Raises:
        InvalidArgumentError: ``rule`` is not one of :data:`CONTIGUOUS_RULES`.
    """
    if rule not in CONTIGUOUS_RULES:
        raise InvalidArgumentError(
            f"rule must be one of {', '.join(CONTIGUOUS_RULES)}, got {rule!r}"
        )
    capacity = (config.num_blocks - 1) * config.block_size
    max_seqs = config.scheduler.max_num_seqs
    token_budget = config.scheduler.max_num_batched_tokens
    cost = config.cost_model
    num_requests = config.workload.num_requests
    arrivals = ArrivalQueue(config.workload)
    metrics = RequestMetrics(num_requests, count_conversations(config.workload))
    window = ThroughputWindow(num_requests)
    waiting: deque[tuple[SimRequest, int]] = deque()
    follow_ups: deque[tuple[SimRequest, int]] = deque()  # ahead of waiting, if asked
    running: list[_Running] = []  # in admission order
    reserved = 0
    seqs = 0
    clock = 0.0
    arrived = rejected = finished = generated = steps = 0
    batch_sum = reserved_sum = 0.0
    batch_peak = reserved_peak = 0
    while True:
        while (sim := arrivals.pop_due(clock)) is not None:
            index = arrived
            arrived += 1
            if reservation_tokens(sim, rule) > capacity or sim.n > max_seqs:
                rejected += 1 + len(sim.next_turns)
                continue
            if config.follow_ups_first and sim.turn:
                follow_ups.append((sim, index))
            else:
                waiting.append((sim, index))
        if not running and not waiting and not follow_ups:
            upcoming = arrivals.next_time()
            if upcoming is None:
                break
            clock = max(clock, upcoming)
            continue
        step_start = clock
        # Decodes first (one token per sequence), then prefill chunks in admission
        # order, then admissions while the reservation, sequence and token limits allow.
        num_tokens = 0
        context = 0
        for r in running:
            if not r.prefill_left:
                num_tokens += r.sim.n
                context += r.sim.n * (r.context + 1)
        budget = token_budget - num_tokens
        for r in running:
            if r.prefill_left and budget > 0:
                chunk = min(r.prefill_left, budget)
                budget -= chunk
                num_tokens += chunk
                context += r.context + chunk
                r.prefill_left -= chunk
                r.context += chunk
        while (queue := follow_ups or waiting) and budget > 0:
            sim, index = queue[0]
            need = reservation_tokens(sim, rule)
            if reserved + need > capacity or seqs + sim.n > max_seqs:
                break  # FCFS: nobody overtakes the head of the queue
            queue.popleft()
            reserved += need
            seqs += sim.n
            metrics.scheduled(sim.conversation, sim.turn, step_start - sim.arrival_time)
            r = _Running(sim, need, len(sim.prompt_token_ids))
            running.append(r)
            chunk = min(r.prefill_left, budget)
            budget -= chunk
            num_tokens += chunk
            context += chunk
            r.prefill_left -= chunk
            r.context += chunk
        if num_tokens == 0:
            # Nothing fits and nothing runs: cannot happen with every reservation
            # <= capacity, but never spin.
            raise InvalidArgumentError("contiguous baseline made no progress")  # pragma: no cover
        clock += cost.time(num_tokens, context)
        steps += 1
        step_seqs = sum(r.sim.n for r in running)
        batch_sum += step_seqs
        batch_peak = max(batch_peak, step_seqs)
        reserved_sum += reserved
        reserved_peak = max(reserved_peak, reserved)
        still: list[_Running] = []
        finished_now = 0
        for r in running:
            if r.prefill_left:
                still.append(r)
                continue
            if r.generated == 0:  # its prefill completed in this step
                metrics.first_token(clock - r.sim.arrival_time)
                r.first_token_time = clock
                r.generated = 1
            else:
                r.generated += 1
                r.context += 1
            if r.generated < r.sim.output_len:
                still.append(r)
                continue
            finished += 1
            finished_now += 1
            generated += r.sim.n * r.sim.output_len
            reserved -= r.reserved
            seqs -= r.sim.n
            metrics.finished(
                clock - r.sim.arrival_time,
                clock - r.first_token_time,
                r.sim.output_len,
                r.sim.output_len,
            )
            follow = r.sim.next_turn(np.zeros(r.sim.output_len, dtype=np.int64), clock)
            if follow is not None:
                arrivals.push(follow)
        running = still
        window.step(clock - step_start, finished_now, bool(waiting or follow_ups))
        if config.stop_at_window and window.is_closed():
            break
    return ContiguousResult(
        rule=rule,
        num_finished=finished,
        num_rejected=rejected,
        num_steps=steps,
        simulated_time_s=clock,
        generated_tokens=generated,
        mean_batch_seqs=batch_sum / steps if steps else 0.0,
        peak_batch_seqs=batch_peak,
        mean_reserved_tokens=reserved_sum / steps if steps else 0.0,
        peak_reserved_tokens=reserved_peak,
        metrics=metrics,
        saturated_requests_per_s=window.rate(clock),
        window_saturated=window.saturated,
    )


@dataclass
class _Running:
    sim: SimRequest
    reserved: int
    prefill_left: int
    context: int = 0  # tokens in each sequence's KV buffer
    generated: int = 0
    first_token_time: float = 0.0
