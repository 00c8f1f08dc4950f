"""The continuous-batching scheduler (:class:`Scheduler`): the public API and the four
phases of a step; each phase's mechanics live in the module named after them.

Each step, in this order:

1. **Decodes.** Every running decoding sequence gets one token, in key order, with one
   ``allocate_slots_batch`` call; when the pool runs short the least important running
   request is preempted and the call resumes where it stopped (:mod:`.preemption`).
2. **Prefill chunks** of requests admitted in earlier steps continue.
3. **Swapped** requests come back (unless this step preempted), before anything new.
4. **Admission** of waiting requests in policy order (fcfs, priority, lpm:
   :mod:`.queues.policy`) while the token budget, ``max_num_seqs`` and the block pool
   allow (:mod:`.admission`: cached prefixes, chunking, same-step prefix holds,
   host-tier load bounds).

The step's state is one :class:`~kvblocks.scheduler.step.StepState` passed to every
helper; the manager journals its block moves in issue order (:mod:`.memory_ops`) and
:func:`~kvblocks.scheduler.batch.build_step` assembles the batch. ``update`` applies the
results (:mod:`.apply`, :mod:`.beam_search`) and makes the records (:mod:`.records`).
Decoding sequences live in NumPy columns (:class:`SequenceTable`): Python runs per request
only on events (admission, prefill completion, finish, preemption, fork, beam step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvblocks.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    SequenceStateError,
)
from kvblocks.protocols import BlockManager, EventPublisher
from kvblocks.scheduler.admission import Admission, Admitted, Deferred
from kvblocks.scheduler.apply import ResultApplier, check_result
from kvblocks.scheduler.batch import DecodeRows, StepBatch, StepPlan, build_step
from kvblocks.scheduler.beam_search import BeamSearch
from kvblocks.scheduler.block_table import PersistentBlockTable
from kvblocks.scheduler.config import SchedulerConfig, check_scheduler_args, state_groups
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.placement import Placement
from kvblocks.scheduler.preemption import Preemption
from kvblocks.scheduler.queues.policy import make_policy
from kvblocks.scheduler.records import Records
from kvblocks.scheduler.registry import RequestRegistry
from kvblocks.scheduler.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
)
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import (
    LatencyStats,
    SchedulerCounters,
    StatsHistory,
    gauges,
    history_row,
)
from kvblocks.scheduler.step import Chunk, StepState, UpdateState
from kvblocks.scheduler.step_outputs import StepOutputs
from kvblocks.validation import check_int, check_number, check_request_id

__all__ = ["Scheduler"]


class Scheduler:
    """Continuous-batching scheduler over a block manager.

    Args:
        manager: a :class:`kvblocks.KVCacheManager` (or the pure-Python
            ``ReferenceKVCacheManager`` of the tests); the scheduler owns every sequence in it.
        config: limits and policies.
        record_history: append one statistics row per step to :attr:`stats_history`.
        clock: the time source of the request metrics (:class:`RequestMetrics`), in
            seconds; default ``time.monotonic``. A simulator passes its model time.
        event_publisher: a KV-event publisher (e.g. :class:`kvblocks.events.ZmqEventPublisher`):
            after each ``update()`` the manager's ``take_events()`` are published as one
            batch. The manager must record events (``record_events=True``).

    Sequence ids are assigned by the scheduler (the request's first sequence, then
    forks); ids of finished requests are reused.
    """

    def __init__(
        self,
        manager: BlockManager,
        config: SchedulerConfig | None = None,
        *,
        record_history: bool = True,
        clock: Callable[[], float] = time.monotonic,
        event_publisher: EventPublisher | None = None,
    ) -> None:
        cfg = self.config = check_scheduler_args(manager, config, clock, event_publisher)
        self.event_publisher = event_publisher
        self.manager = manager
        self._clock = clock
        self.policy = make_policy(cfg.policy)
        self.record_history = record_history
        counters = self.counters = SchedulerCounters()
        self.stats_history = StatsHistory()
        self.latency = LatencyStats()
        self._registry = RequestRegistry()
        # Rows are taken back wherever a sequence leaves the GPU (free, swap_out).
        block_table = PersistentBlockTable(
            manager, cfg.max_num_seqs, manager.block_size, cfg.num_lookahead_tokens
        )
        placement = self._placement = Placement(
            manager, block_table, self._registry, self.policy, cfg.max_wait_steps
        )
        records = self._records = Records(manager, placement, counters, self.latency)
        self._preemption = Preemption(manager, cfg, placement, records, counters)
        self._admission = Admission(manager, cfg, placement, records, counters)
        beams = BeamSearch(manager, placement, records, counters)
        self._results = ResultApplier(manager, placement, records, beams, counters)
        self._in_flight: StepPlan | None = None
        # What the content oracles inspect: each sequence's request, the table's rows.
        self._owner = self._registry.owner
        self._block_table = block_table
        self._state_groups = state_groups(manager)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            DuplicateSequenceError: the request id is already unfinished.
            InvalidArgumentError: not a :class:`Request`; the prompt can never fit in the
                pool; it runs more sequences (n, beam_width) than one step can hold; or
                (chunked prefill off) it is longer than ``max_num_batched_tokens``.
        """
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"add_request takes a Request, got {type(request).__name__}")
        registry = self._registry
        if request.request_id in registry.requests:
            raise DuplicateSequenceError(
                f"request id {request.request_id!r} is already queued or running"
            )
        self.config.check_request(request)
        now = self._now()  # before the manager is touched: a failing clock changes nothing
        given = request.arrival_time
        arrival = float(given) if given is not None else float(self.counters.num_steps)
        counter = registry.next_counter()
        key = self.policy.key(request.priority, arrival, counter)
        metrics = RequestMetrics(float(given) if given is not None else now)
        state = RequestState(request, counter, key, registry.new_seq_id(), metrics)
        try:
            self._placement.enter(
                state, self.counters.num_steps, self.config.max_num_batched_tokens
            )
        except Exception:
            registry.give_back(state.seq_ids[0])  # e.g. a LoRA id the manager rejects
            raise
        registry.add(state)
        self.counters.num_requests_added += 1

    def abort_request(
        self, request_id: str, reason: FinishReason | str = FinishReason.ABORT
    ) -> RequestOutput | None:
        """Abort an unfinished request and return its output so far.

        Its unfinished sequences end with ``reason``: ``"abort"`` (the default; counted in
        ``num_requests_aborted``), or another reason for a request the caller ends on a
        condition of its own, e.g. ``"stop"`` for an engine's stop string (counted as
        finished, with its latencies in the statistics).

        Returns ``None`` for an unknown or already finished request id. If a step is in
        flight, the request's blocks are released at the next ``update``.

        Raises:
            InvalidArgumentError: ``reason`` is not a :class:`FinishReason` value.
            InvalidTypeError: ``request_id`` is not a string.
        """
        reason = FinishReason.parse(reason)
        state = self._lookup(request_id)
        if state is None or state.aborted:
            return None
        output = self._records.abort(state, reason, self._now())
        if self._in_flight is not None:
            self._in_flight.aborted.append(state)
        else:
            self._placement.drop(state)
        return output

    def finish_sequence(
        self, request_id: str, index: int, reason: FinishReason | str = FinishReason.STOP
    ) -> CompletionOutput | None:
        """End one decoding sequence of an ``n > 1`` request that keeps others running.

        For an engine condition on one completion (a stop string of one sample): the
        sequence's blocks are released now instead of decoding on until the request ends.
        Works between steps on a decoding (not swapped, split or beam-search) request whose
        other sequences still run; returns the sequence's final record, or ``None`` when
        that does not hold (the caller then ignores the sequence's further tokens, or
        ends the whole request with :meth:`abort_request`).

        Raises:
            InvalidArgumentError: ``reason`` is not a :class:`FinishReason` value, or
                ``index`` not an int >= 0.
            InvalidTypeError: ``request_id`` is not a string.
        """
        reason = FinishReason.parse(reason)
        # Matched by equality: True or 1.0 would end completion 1 under that index.
        index = check_int(index, "index", minimum=0, numpy=True)
        state = self._lookup(request_id)
        if state is None or self._in_flight is not None:
            return None
        return self._records.end_sequence(state, index, reason, self.counters.num_steps)

    def _lookup(self, request_id: str) -> RequestState | None:
        return self._registry.get(check_request_id(request_id))

    def has_unfinished_requests(self) -> bool:
        """True while some request is waiting, running or swapped (or output is pending)."""
        plan = self._in_flight
        return bool(self._registry.requests) or (plan is not None and bool(plan.ended))

    def num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped."""
        return len(self._registry)

    def running_request_ids(self) -> list[str]:
        """Requests whose sequences hold GPU blocks now (decoding or being prefilled)."""
        return self._placement.running_request_ids()

    # -- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch (see the module docstring for the order of work).

        Raises:
            SequenceStateError: the previous ``schedule()`` has not been ``update()``-d.
        """
        if self._in_flight is not None:
            raise SequenceStateError("schedule() called again before update() of the last step")
        cfg = self.config
        step = StepState(self._clock_time(), self.counters.num_steps, cfg.max_num_batched_tokens)
        placement = self._placement
        # Requests past max_wait_steps rank first in the waiting queue from now on.
        self.counters.num_requests_overdue += placement.wait_bound.promote(
            placement.waiting, step.step
        )
        decodes = self._schedule_decodes(step)  # 1. decodes, preempting when short
        self._schedule_chunks(step)  # 2. prefill chunks of requests admitted earlier
        if not step.preempted:
            self._swap_in(step)  # 3. swapped requests come back before new ones
            if not placement.swapped:
                self._admit(step)  # 4. admission in policy order

        moves = self.manager.take_memory_ops()  # every block move, in issue order
        batch = StepBatch(decodes, step.chunks, moves, self._registry.take_finished_ids())
        output, plan = build_step(
            self.manager, batch, self._beam_width, self._block_table, self._state_groups
        )
        plan.now = step.now
        plan.ended = step.ended
        if self._registry.num_min_tokens:
            self._results.suppress_early_stops(output)
        self._in_flight = plan
        counters = self.counters
        counters.num_steps += 1
        counters.num_prefill_tokens += output.num_prefill_tokens
        counters.num_decode_tokens += output.num_decode_tokens
        if self.record_history:
            row = history_row(self._gauges(), counters, output, step.num_loads)
            self.stats_history.append(row)
        return output

    def _schedule_decodes(self, step: StepState) -> DecodeRows:
        """Phase 1: one token for every running sequence, in key order, with one
        ``allocate_slots_batch`` call that resumes after each preemption."""
        cfg = self.config
        table = self._placement.table
        end = min(len(table), step.budget, cfg.max_num_seqs)
        if end < len(table):
            end = table.request_boundary(end)  # never split a multi-sequence request
        start = 0
        synced = None
        placement = self._placement
        if end and not (placement.prefilling or placement.swapped or placement.waiting):
            # Decodes only (phases 2-4 have nothing to do): one manager call allocates,
            # syncs the block-table rows and reads the slots, when it can.
            fused = self._block_table.allocate_decodes(
                table["seq_id"][:end],
                table["num_tokens"][:end],
                cfg.num_lookahead_tokens,
                batch_key=(table.version, end),  # the same rows while the table is unchanged
            )
            if fused is not None:
                start, synced = fused
        while start < end:
            ids = table["seq_id"]
            start += self.manager.allocate_slots_batch(
                ids[start:end], 1, num_lookahead_tokens=cfg.num_lookahead_tokens
            ).num_served
            if start >= end:
                break
            needy = self._registry.owner[int(ids[start])]
            self._preemption.make_room_for_decode(needy, start, step)
            end = min(end, len(table))
        step.budget -= end
        step.num_seqs = end
        return DecodeRows.from_table(table, end, synced)

    def _schedule_chunks(self, step: StepState) -> None:
        """Phase 2: the next chunk of each request being prefilled, in key order."""
        cfg = self.config
        prefilling = self._placement.prefilling
        if not prefilling:
            return
        for state in list(prefilling):
            if step.budget <= 0 or step.num_seqs >= cfg.max_num_seqs:
                break
            if state.status is not RequestStatus.PREFILL:
                continue  # preempted while making room for an earlier one
            length = min(len(state.tokens) - state.num_computed, step.budget)
            length = self._preemption.allocate_chunk(state, length, step)
            if length == 0:
                break
            step.chunks.append(Chunk(state, state.num_computed, length))
            step.budget -= length
            step.num_seqs += 1

    def _swap_in(self, step: StepState) -> None:
        """Phase 3: swapped requests come back whole, in key order (they decode from
        the next step)."""
        placement = self._placement
        swapped = placement.swapped
        while swapped:
            state = swapped[0]
            if placement.num_live_seqs() + len(state.seq_ids) > self.config.max_num_seqs:
                break
            if not self.manager.can_swap_in(state.seq_ids):
                if len(placement.table) == 0 and not placement.prefilling and not step.chunks:
                    # Nothing else holds GPU blocks, so it can never come back whole
                    # (the watermark): recompute it instead.
                    self._preemption.recompute(state, step)
                    continue
                break
            placement.swap_in(state)

    def _admit(self, step: StepState) -> None:
        """Phase 4: waiting requests in policy order while the budget, ``max_num_seqs``
        and the pool allow; the first that must wait stops the step's admission."""
        cfg = self.config
        placement = self._placement
        if not placement.waiting or step.budget <= 0:
            return
        live = placement.num_live_seqs()
        held = 0
        # lpm's order comes from one batch refresh of every waiting sequence's probe.
        for state in self.policy.admission_order(placement.waiting, self.manager):
            if step.budget <= 0 or step.num_seqs >= cfg.max_num_seqs:
                break
            if live + state.width > cfg.max_num_seqs and live > 0:
                break
            match self._admission.admit(state, step, may_hold=step.num_seqs > 0):
                case Admitted(length):
                    step.chunks.append(Chunk(state, state.num_computed, length))
                    step.budget -= length
                    step.num_seqs += 1
                    live += state.width
                case Deferred.HELD:
                    # Its prefix is being computed now: next step it is cached. Held
                    # requests use no budget, so the scan is bounded by their number.
                    held += 1
                    if held >= cfg.max_num_seqs:
                        break
                case Deferred.ENDED:
                    continue  # can never fit: ended at admission
                case Deferred.WAIT:
                    break

    def _beam_width(self, seq: int) -> int:
        return self._registry.owner[seq].params.beam_width

    # -- update --------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: ModelStepResult) -> StepOutputs:
        """Apply the engine's results for ``output``; return every request's news.

        Appends each sampling row's token(s), commits the computed KV, applies stop
        conditions (``max_tokens``, stop tokens, EOS; not before ``min_tokens``), forks
        ``n > 1`` and beam-search sequences, and frees finished requests.

        Returns:
            a :class:`StepOutputs`: a sequence of :class:`RequestOutput`, one per request
            that produced tokens or finished in this step (each running sequence's token
            in ``new_token_ids``; a finished request's final record), with
            ``.finished`` the finished requests' records alone. Concatenating a
            sequence's ``new_token_ids`` over the steps gives its final ``token_ids``
            (beam search: only the final record, with the whole beams). A request
            aborted while the step was in flight produces nothing here.

        Raises:
            SequenceStateError: ``output`` is not the last ``schedule()`` result.
            InvalidArgumentError: ``result`` does not match ``output`` (token counts,
                missing top-K for beam rows); the scheduler is unchanged.
        """
        plan = self._in_flight
        if plan is None or output is not plan.output:
            raise SequenceStateError("update() needs the output of the last schedule() call")
        sampled, logprobs = check_result(output, plan, result)
        now = self._clock_time()  # before any change: a failing clock changes nothing
        self._in_flight = None
        # The engine applied the step's memory ops before computing it: their host-tier
        # copies are complete, so their slots are released (a no-op without a tier).
        self.manager.confirm_memory_ops()
        upd = UpdateState(now, self.counters.num_steps, finished=plan.ended)
        states = self._registry.snapshot()  # the step's records outlive finished requests
        decode = None
        if output.num_seqs:
            decode = self._results.apply(output, plan, sampled, logprobs, result, upd)
        for state in plan.aborted:
            self._placement.drop(state)
        self.publish_events()
        return StepOutputs(upd.finished, upd.events, decode, states)

    def publish_events(self) -> None:
        """Publish the manager's KV events queued since the last publish, in order, as one
        batch (nothing without a publisher or an event). ``update()`` calls it; an engine
        that changes the cache between steps (a failed step's clear) calls it too, so
        routers hear of it before the next step."""
        if self.event_publisher is not None:
            kv_events = self.manager.take_events()
            if kv_events:
                self.event_publisher.publish(kv_events)

    def _now(self) -> float:
        """The step's time while a step is in flight, else the clock."""
        if self._in_flight is not None:
            return self._in_flight.now
        return self._clock_time()

    def _clock_time(self) -> float:
        """The clock's time, checked: a str would be parsed by ``float()`` and a NaN
        would make every latency after it NaN."""
        now = self._clock()
        if type(now) is float and math.isfinite(now):  # every step's case, at 1/8 the cost
            return now
        return check_number(now, "the clock's time", expected="a finite real number", numpy=True)

    def _num_live_seqs(self) -> int:
        return self._placement.num_live_seqs()

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Current gauges (queue lengths, KV usage), the cumulative counters and the
        latency summary of finished requests (:meth:`LatencyStats.summary`: mean and
        percentiles of queue time, TTFT, TPOT and end-to-end latency, in seconds of the
        scheduler's clock).

        Counts (``num_*``) are ints; rates, times and ``kv_usage`` are floats.
        """
        out = self.counters.as_dict()
        out.update(self._gauges())
        out.update(self.latency.summary())
        return out

    def _gauges(self) -> dict[str, int | float]:
        return gauges(
            self._placement, len(self._registry.requests), self.manager, self.counters.num_steps
        )
