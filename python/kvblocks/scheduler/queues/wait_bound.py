"""Bounded waiting (:class:`WaitBound`): no request waits forever behind better-ranked work.

fcfs admits in arrival order, so a request waits only for the requests that arrived
before it. priority and lpm admit better-ranked work first (a smaller priority, a longer
cached prefix), so a request they rank low waits for as long as better-ranked work keeps
arriving -- forever under sustained load (vLLM's and SGLang's schedulers order strictly
and starve the same way).

The rule: a request that has waited ``SchedulerConfig.max_wait_steps`` scheduler steps
becomes *overdue*. Overdue requests rank before every request that is not, and among
themselves by arrival (the policy's key without its priority); below the bound the
policy's order is untouched. So once a request is overdue, no request that arrived after
it is admitted before it: it waits at most ``max_wait_steps`` steps plus what
first-come-first-served would make it wait for the requests that arrived before it.
(When arrivals exceed what the server can compute for long, every order makes some
requests wait longer and longer; the bound then degrades to fcfs, never to starvation.)

Overdue is for good: a request preempted after its admission goes back to the waiting
queue overdue, so a low-ranked request is not starved by being admitted and preempted
over and over either. The rule only orders the waiting queue: running requests keep the
policy's key, so the choice of preemption victims does not change.

**Time is counted in scheduler steps**, from the step a request entered the waiting
queue (``add_request``, or a recompute preemption). Steps are the scheduler's own unit of
progress: every step is an admission round, so the bound is the number of rounds a
request can be passed over, whatever a step costs in seconds (multiply by the step time:
128 steps of 20 ms are 2.6 s), and it is deterministic for tests and simulations. Time
without steps (an idle engine) admits nobody and passes nobody over.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kvblocks.scheduler.queues.policy import Key, WaitingQueue

__all__ = ["WaitBound"]


class Waiting(Protocol):
    """What the bound needs from a waiting request."""

    key: Key
    seq_ids: list[int]
    overdue: bool
    wait_since: int

    @property
    def queue_key(self) -> tuple[int, int, float, int]: ...

    @property
    def is_waiting(self) -> bool: ...


class WaitBound:
    """Tracks how long each waiting request has waited and marks the overdue ones.

    Args:
        max_steps: steps after which a waiting request is overdue (``None``: never;
            0: at once, so every policy admits in arrival order).
    """

    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        # (step entered, request), in the order requests entered the queue: the first
        # live entry is the longest wait. Entries of requests that left (or re-entered)
        # are dropped when they reach the front.
        self._entries: deque[tuple[int, Waiting]] = deque()
        # The entries not yet overdue, same order: the next to become overdue first.
        self._pending: deque[tuple[int, Waiting]] = deque()
        # Entries kept at the last compaction: stale ones are dropped when the deque
        # doubles past it, so it stays proportional to the waiting queue however long
        # one request waits at its front (and however rarely stats() asks).
        self._compacted = 0

    def enter(self, request: Waiting, step: int) -> None:
        """``request`` enters the waiting queue at ``step`` (before it is pushed)."""
        request.wait_since = step
        entry = (step, request)
        self._entries.append(entry)
        # Entries hold the request: drop those that left at once (the usual case: the
        # front left first), and all of them when one long wait at the front keeps them.
        entries = self._trim_front()
        if len(entries) > 2 * self._compacted + 1024:
            self._entries = entries = deque(e for e in entries if not _left(*e))
            self._compacted = len(entries)
        if not request.overdue and self.max_steps is not None:
            self._pending.append(entry)

    def promote(self, queue: WaitingQueue, step: int) -> int:
        """Mark the requests that have waited ``max_steps`` by ``step`` overdue (moving
        them to their place in ``queue``); return how many."""
        if self.max_steps is None:
            return 0
        pending = self._pending
        due = step - self.max_steps
        promoted = 0
        while pending and pending[0][0] <= due:
            since, request = pending.popleft()
            if _left(since, request) or request.overdue:
                continue
            queue.remove(request)
            request.overdue = True
            queue.push(request)
            promoted += 1
        return promoted

    def longest_wait(self, step: int) -> int:
        """Steps the longest-waiting request has waited at ``step`` (0: none waits)."""
        entries = self._trim_front()
        return step - entries[0][0] if entries else 0

    def _trim_front(self) -> deque[tuple[int, Waiting]]:
        """Drop the stale entries at the front; the first one left is the longest wait."""
        entries = self._entries
        while entries and _left(*entries[0]):
            entries.popleft()
        return entries


def _left(since: int, request: Waiting) -> bool:
    """The entry is stale: the request left the queue (or entered it again later)."""
    return not request.is_waiting or request.wait_since != since
