"""The continuous-batching scheduler (:class:`Scheduler`).

Each step, in this order:

1. **Decodes.** Every running decoding sequence gets one token, in priority order, with
   one ``allocate_slots_batch`` call. When the pool runs short the least important
   running request is preempted (recompute or swap) and the call resumes where it
   stopped; a request that is itself the least important preempts itself. A forked
   request that cannot be swapped is recomputed: ``n > 1`` sequence by sequence (parts),
   beam search from its prompt.
2. **Prefill chunks** of requests admitted in earlier steps continue.
3. **Swapped** requests come back (unless this step preempted), before anything new.
4. **Admission** of waiting requests in policy order (fcfs, priority, lpm) while the
   token budget, ``max_num_seqs`` and the block pool (``can_allocate``, watermark) allow;
   the cached prefix is skipped, long prompts are chunked. A request whose next prompt
   blocks another sequence is computing in this very step (``probe_in_flight``) is held
   back to the next step, where it claims them from the prefix cache instead of
   computing them again: never into an empty step, without using budget (later
   requests are admitted past it; after ``max_num_seqs`` holds the step's admission
   stops), and only while its cached prefix keeps growing between holds
   (:class:`~kvblocks.scheduler.queues.prefix_hold.PrefixHold`; see
   docs/scheduler-engine-interface.md, *Same-step prefix sharing*). With a host tier,
   ``max_load_blocks_per_step`` bounds the loads admissions queue (see
   :class:`SchedulerConfig`); loaded tokens never count as batched tokens.

Decoding sequences live in NumPy columns (:class:`SequenceTable`) so that a decode step
over a thousand sequences is a few vectorised operations and a few Rust calls; Python
runs per request only on events (admission, prefill completion, finish, preemption,
fork, beam step).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks._core import AllocStatus
from kvblocks.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    SequenceStateError,
)
from kvblocks.scheduler.batch import StepPlan, build_step, stack_pairs
from kvblocks.scheduler.beam import Hypothesis, rank_hypotheses, select_beams
from kvblocks.scheduler.block_table import PersistentBlockTable
from kvblocks.scheduler.config import SchedulerConfig
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.queues.policy import WaitingQueue, make_policy
from kvblocks.scheduler.queues.prefix_hold import PrefixHold
from kvblocks.scheduler.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
)
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.seq_table import Rows, SequenceTable
from kvblocks.scheduler.stats import LatencyStats, SchedulerCounters, StatsHistory
from kvblocks.scheduler.step_outputs import DecodeDeltas, StepOutputs

__all__ = ["Scheduler"]

#: ``_admit``: the request waits for a prefix being computed in this step.
_HELD = -1


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
        manager: Any,
        config: SchedulerConfig | None = None,
        *,
        record_history: bool = True,
        clock: Callable[[], float] = time.monotonic,
        event_publisher: Any | None = None,
    ) -> None:
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be callable, got {clock!r}")
        if event_publisher is not None:
            if not callable(getattr(event_publisher, "publish", None)):
                raise InvalidArgumentError(
                    f"event_publisher needs a publish() method, got {event_publisher!r}"
                )
            if not getattr(manager, "record_events", False):
                raise InvalidArgumentError(
                    "event_publisher needs a manager built with record_events=True"
                )
        self.event_publisher = event_publisher
        self.manager = manager
        # A host tier: the manager orders every block move (offloads and loads included)
        # in one list, drained by take_memory_ops; confirmed at the step's update().
        self._tiered = getattr(manager, "host_cache_blocks", 0) > 0
        self._clock = clock
        self.config = config if config is not None else SchedulerConfig()
        if not isinstance(self.config, SchedulerConfig):
            raise InvalidArgumentError(
                f"config must be a SchedulerConfig, got {type(self.config).__name__}"
            )
        # The first decode step holds the prompt's token, the decoded one and the lookahead:
        # past what the pool can ever give, every request would stop at its first token
        # (and the persistent table would be sized for slots that can never exist).
        usable = (int(manager.num_blocks) - 1) * int(manager.block_size)
        if self.config.num_lookahead_tokens + 2 > usable:
            raise InvalidArgumentError(
                f"num_lookahead_tokens = {self.config.num_lookahead_tokens} leaves no room "
                f"for a decode step: the pool holds {usable} tokens ({int(manager.num_blocks) - 1} "
                f"usable blocks of {int(manager.block_size)})"
            )
        self.policy = make_policy(self.config.policy)
        self.record_history = record_history
        self.counters = SchedulerCounters()
        self.stats_history = StatsHistory()
        self.latency = LatencyStats()
        # Records of sequences that started or finished in the update in progress, by
        # request id then completion index (the decode tokens are kept as columns).
        self._step_events: dict[str, dict[int, CompletionOutput]] = {}
        # The clock, read once at the start of schedule() and of update(): every event of
        # a step shares it, and a failing clock raises before anything changed.
        self._step_time: float | None = None
        self._requests: dict[str, RequestState] = {}
        self._owner: dict[int, RequestState] = {}
        self._waiting = WaitingQueue()
        self._prefilling: list[RequestState] = []  # key order
        self._swapped: list[RequestState] = []  # key order
        self._table = SequenceTable()
        # Rows are taken back wherever a sequence leaves the GPU (free, swap_out).
        self._block_table = PersistentBlockTable(
            manager,
            self.config.max_num_seqs,
            manager.block_size,
            self.config.num_lookahead_tokens,
        )
        self._next_seq_id = 0
        self._free_seq_ids: list[int] = []
        # Unfinished requests with min_tokens > 0: only then do steps scan their rows.
        self._num_min_tokens_requests = 0
        self._counter = 0
        self._in_flight: StepPlan | None = None
        self._pending_aborts: list[RequestState] = []
        self._early_outputs: list[RequestOutput] = []
        self._finished_ids: list[str] = []
        self._stop_tokens = np.zeros(0, dtype=np.int64)
        self._swap_out_maps: list[npt.NDArray[np.int64]] = []
        # Swap/copy groups in issue order (see SchedulerOutput.memory_ops).
        self._memory_ops: list[tuple[str, npt.NDArray[np.int64]]] = []
        self._preempted = False
        self._num_split = 0  # requests in SPLIT state (their parts sit in the queues)
        self._prefix_hold = PrefixHold()
        self._prefix_caching = bool(manager.enable_prefix_caching)
        # Host-tier loads the step in progress queued (admissions claim them).
        self._step_loads = 0
        # Recurrent-state groups: each step carries where their states are read and saved.
        self._state_groups = [
            g for g, spec in enumerate(getattr(manager, "groups", ())) if spec.kind == "mamba"
        ]
        if self._state_groups and self.config.num_lookahead_tokens:
            raise InvalidArgumentError(
                "num_lookahead_tokens must be 0 with a recurrent-state group (its state is "
                "saved after the known tokens only)"
            )

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
        rid = request.request_id
        if rid in self._requests:
            raise DuplicateSequenceError(f"request id {rid!r} is already queued or running")
        num_prompt = request.num_prompt_tokens
        width = request.sampling_params.num_sequences
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if width > limit:
            raise InvalidArgumentError(
                f"request {rid!r} runs {width} sequences at once (n / beam_width) but a step "
                f"holds at most {limit} (max_num_seqs, max_num_batched_tokens)"
            )
        if (
            not self.config.enable_chunked_prefill
            and num_prompt > self.config.max_num_batched_tokens
        ):
            raise InvalidArgumentError(
                f"request {rid!r}: prompt of {num_prompt} tokens exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and chunked prefill is off"
            )
        now = self._now()  # before the manager is touched: a failing clock changes nothing
        seq_id = self._new_seq_id()
        try:
            self.manager.add_sequence(
                seq_id,
                request.prompt_token_ids,
                cache_salt=request.cache_salt,
                lora_id=request.lora_id,
                **_retention_kwargs(request),
            )
        except Exception:
            self._free_seq_ids.append(seq_id)  # e.g. a LoRA id the manager rejects
            raise
        if self.manager.can_allocate(seq_id) == AllocStatus.NEVER:
            self.manager.free(seq_id)
            self._free_seq_ids.append(seq_id)
            usable = self.manager.num_blocks - 1
            raise InvalidArgumentError(
                f"request {rid!r}: prompt of {num_prompt} tokens needs more blocks than the pool "
                f"can ever give ({usable} usable blocks of {self.manager.block_size} tokens, "
                "minus the watermark)"
            )
        arrival = (
            float(request.arrival_time)
            if request.arrival_time is not None
            else float(self.counters.num_steps)
        )
        key = self.policy.key(request.priority, arrival, self._counter)
        metrics = RequestMetrics(
            float(request.arrival_time) if request.arrival_time is not None else now
        )
        state = RequestState(request, self._counter, key, seq_id, metrics)
        self._counter += 1
        self._requests[rid] = state
        self._owner[seq_id] = state
        if state.params.min_tokens > 0:
            self._num_min_tokens_requests += 1
        if self.policy.name == "lpm":
            state.registered_step = self.counters.num_steps  # lpm probes waiting sequences
        else:
            self.manager.free(seq_id)
        self._waiting.push(state)
        self.counters.num_requests_added += 1
        if state.stop_set:
            union = set(self._stop_tokens.tolist()) | set(state.stop_set)
            self._stop_tokens = np.array(sorted(union), dtype=np.int64)

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
        """
        reason = _finish_reason(reason)
        state = self._requests.get(request_id)
        if state is None or state.aborted:
            return None
        output = self._abort_output(state, reason)
        state.metrics.finished_time = self._now()
        state.aborted = True
        for part in state.parts:
            part.aborted = True
        if reason == FinishReason.ABORT:
            self.counters.num_requests_aborted += 1
            metrics = state.metrics
            metrics.num_generated_tokens = max(
                (len(c.token_ids) for c in output.outputs), default=0
            )
        else:
            self.counters.num_requests_finished += 1
            self._record_finish(state, output)
        if self._in_flight is not None:
            self._pending_aborts.append(state)
        else:
            self._drop_request(state)
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
            InvalidArgumentError: ``reason`` is not a :class:`FinishReason` value.
        """
        reason = _finish_reason(reason)
        state = self._requests.get(request_id)
        if (
            state is None
            or state.aborted
            or self._in_flight is not None
            or state.status is not RequestStatus.RUNNING
            or state.params.use_beam_search
            or len(state.seq_ids) < 2
        ):
            return None
        seqs = [seq for seq in state.seq_ids if state.seq_index.get(seq) == index]
        if not seqs:
            return None
        seq = seqs[0]
        rows = self._table.rows_of(np.array([seq], dtype=np.int64))
        cum = float(self._table["cum_logprob"][rows[0]])
        tokens = self.manager.token_ids(seq)[state.num_prompt :].tolist()
        completion = CompletionOutput(index, tokens, cum, reason)
        state.outputs[index] = completion
        state.output_step[index] = self.counters.num_steps
        self._table.update(rows, [])
        self._release_seq(state, seq)
        return completion

    def has_unfinished_requests(self) -> bool:
        """True while some request is waiting, running or swapped (or output is pending)."""
        return bool(self._requests) or bool(self._early_outputs)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped."""
        return len(self._requests)

    def running_request_ids(self) -> list[str]:
        """Requests whose sequences hold GPU blocks now (decoding or being prefilled)."""
        ids = dict.fromkeys(self._table["request_id"].tolist())
        ids.update(dict.fromkeys(s.request.request_id for s in self._prefilling))
        return list(ids)

    # -- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch (see the module docstring for the order of work).

        Raises:
            SequenceStateError: the previous ``schedule()`` has not been ``update()``-d.
        """
        if self._in_flight is not None:
            raise SequenceStateError("schedule() called again before update() of the last step")
        self._step_time = float(self._clock())
        cfg = self.config
        mgr = self.manager
        table = self._table
        budget = cfg.max_num_batched_tokens
        self._swap_out_maps = []
        self._memory_ops = []
        swap_in_maps: list[npt.NDArray[np.int64]] = []
        self._preempted = False
        self._step_loads = 0

        # 1. decodes, with preemption when the pool is short.
        end = min(len(table), budget, cfg.max_num_seqs)
        if end < len(table):
            end = self._cut_at_request_boundary(end)
        start = 0
        while start < end:
            ids = table["seq_id"]
            start += mgr.allocate_slots_batch(
                ids[start:end], 1, num_lookahead_tokens=cfg.num_lookahead_tokens
            ).num_served
            if start >= end:
                break
            self._make_room_for(self._owner[int(ids[start])], start)
            end = min(end, len(table))
        num_decode = end
        cols = table.cols
        dec_ids = cols["seq_id"][:end].copy()
        dec_tokens = cols["last_token"][:end].copy()
        dec_lens = cols["num_tokens"][:end]
        dec_beam = cols["is_beam"][:end]
        dec_sampling = (
            cols["temperature"][:end].copy(),
            cols["top_p"][:end].copy(),
            cols["top_k"][:end].copy(),
            cols["seed"][:end].copy(),
            cols["seq_index"][:end].copy(),
        )
        dec_request_ids: list[str] = cols["request_id"][:end].tolist()
        budget -= num_decode
        num_seqs = num_decode

        # 2. prefill chunks of requests admitted earlier.
        chunks: list[tuple[RequestState, int, int]] = []
        for state in list(self._prefilling):
            if budget <= 0 or num_seqs >= cfg.max_num_seqs:
                break
            if state.status is not RequestStatus.PREFILL:
                continue  # preempted while making room for an earlier one
            length = min(len(state.tokens) - state.num_computed, budget)
            if not self._allocate_prefill(state, length):
                break
            chunks.append((state, state.num_computed, length))
            budget -= length
            num_seqs += 1

        # 3. swapped requests come back before new ones are admitted.
        if not self._preempted:
            while self._swapped:
                state = self._swapped[0]
                if self._num_live_seqs() + len(state.seq_ids) > cfg.max_num_seqs:
                    break
                if not mgr.can_swap_in(state.seq_ids):
                    if len(table) == 0 and not self._prefilling and not chunks:
                        # Nothing else holds GPU blocks, so it can never come back whole
                        # (the watermark): recompute it instead.
                        self._recompute_any(state)
                        continue
                    break
                self._drain_copies()
                swap_in_maps.append(mgr.swap_in(state.seq_ids))
                if self._tiered:
                    self._drain_copies()  # the manager queued the swap with its ops
                else:
                    self._memory_ops.append(("swap_in", swap_in_maps[-1]))
                self._swapped.pop(0)
                rows = state.swapped_rows
                state.swapped_rows = None
                state.status = RequestStatus.RUNNING
                assert rows is not None
                table.update(None, [rows])

        # 4. admission of waiting requests.
        if not self._preempted and not self._swapped and self._waiting and budget > 0:
            live = self._num_live_seqs()
            held = 0
            # lpm's order comes from one batch refresh of every waiting sequence's probe.
            for state in self.policy.admission_order(self._waiting, mgr):
                if budget <= 0 or num_seqs >= cfg.max_num_seqs:
                    break
                if live + state.width > cfg.max_num_seqs and live > 0:
                    break
                admitted = self._admit(state, budget, may_hold=num_seqs > 0)
                if admitted is None:
                    break
                if admitted == _HELD:
                    # Its prefix is being computed now: next step it is cached. Held
                    # requests use no budget, so the scan is bounded by their number.
                    held += 1
                    if held >= cfg.max_num_seqs:
                        break
                    continue
                if admitted == 0:
                    continue  # finished at admission (can never fit)
                chunks.append((state, state.num_computed, admitted))
                budget -= admitted
                num_seqs += 1
                live += state.width

        if self._tiered:
            # Allocation is over: drain its ops so that build_step's copy drain finds none.
            self._drain_copies()
        output, plan = build_step(
            mgr,
            num_decode,
            dec_ids,
            dec_tokens,
            dec_lens,
            dec_beam,
            dec_sampling,
            dec_request_ids,
            chunks,
            self._swap_out_maps,
            swap_in_maps,
            self._finished_ids,
            lambda seq: self._owner[seq].params.beam_width,
            self._block_table,
            self._state_groups,
        )
        self._finished_ids = []
        # memory_ops carries every move of the step, so an engine can apply it alone.
        if len(output.blocks_to_copy):
            self._memory_ops.append(("copy", output.blocks_to_copy))
        if self._memory_ops:
            output.memory_ops = self._memory_ops
            output.blocks_to_copy = stack_pairs(
                [pairs for kind, pairs in self._memory_ops if kind == "copy"]
            )
        if self._num_min_tokens_requests:
            self._suppress_early_stops(output)
        self._in_flight = plan
        self.counters.num_steps += 1
        self.counters.num_prefill_tokens += output.num_prefill_tokens
        self.counters.num_decode_tokens += output.num_decode_tokens
        if self.record_history:
            self.stats_history.append(self._stats_row(output))
        return output

    def _suppress_early_stops(self, output: SchedulerOutput) -> None:
        """``min_tokens``: ban EOS and the stop tokens in the rows of sequences that have
        generated fewer than ``min_tokens`` tokens (vLLM's rule: they may end the sequence
        from token ``min_tokens + 1`` on), through ``output.suppressed_*``."""
        mgr = self.manager
        banned: list[list[int]] = []
        for seq in output.sample_seq_ids.tolist():
            state = self._owner.get(seq)
            if (
                state is None
                or not state.params.min_tokens
                or mgr.num_tokens(seq) - state.num_prompt >= state.params.min_tokens
            ):
                banned.append([])
                continue
            banned.append(sorted(state.beam_stops))  # the stop tokens and EOS
        counts = [len(b) for b in banned]
        if not any(counts):
            return
        indptr = np.zeros(len(banned) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        output.suppressed_indptr = indptr
        output.suppressed_token_ids = np.array([t for b in banned for t in b], dtype=np.int64)

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
        counts = output.sample_counts
        num_rows = len(counts)
        sampled = np.asarray(result.sampled_token_ids, dtype=np.int64).reshape(-1)
        total = int(counts.sum()) if plan.special else num_rows
        if sampled.shape[0] != total:
            raise InvalidArgumentError(
                f"sampled_token_ids has {sampled.shape[0]} tokens, the step's sample_counts "
                f"sum to {total}"
            )
        if result.sampled_logprobs is None:
            logprobs = np.zeros(total, dtype=np.float64)
        else:
            logprobs = np.asarray(result.sampled_logprobs, dtype=np.float64).reshape(-1)
            if logprobs.shape[0] != total:
                raise InvalidArgumentError(
                    f"sampled_logprobs has {logprobs.shape[0]} entries, expected {total}"
                )
        if output.beam_topk and (result.topk_token_ids is None or result.topk_logprobs is None):
            raise InvalidArgumentError(
                f"this step has beam-search rows: topk_token_ids/topk_logprobs [R, "
                f"{output.beam_topk}] are required"
            )
        now = float(self._clock())  # before any change: a failing clock changes nothing
        self._in_flight = None
        if self._tiered:
            # The engine applied the step's memory ops before computing it: their
            # host-tier copies are complete, so their slots are released.
            self.manager.confirm_memory_ops()
        finished: list[RequestOutput] = self._early_outputs
        self._early_outputs = []
        self._step_events = {}
        self._step_time = now
        states = dict(self._requests)  # the step's records outlive finished requests
        decode: DecodeDeltas | None = None
        try:
            if output.num_seqs:
                decode = self._apply_results(output, plan, sampled, logprobs, result, finished)
            for state in self._pending_aborts:
                self._drop_request(state)
            self._pending_aborts = []
        finally:
            self._step_time = None
        if self.event_publisher is not None:
            # Everything since the last update (admission evictions included), in order.
            kv_events = self.manager.take_events()
            if kv_events:
                self.event_publisher.publish(kv_events)
        events, self._step_events = self._step_events, {}
        return StepOutputs(finished, events, decode, states)

    def _now(self) -> float:
        """The step's time inside ``schedule``/``update`` (and while a step is in
        flight), else the clock."""
        if self._step_time is not None:
            return self._step_time
        return float(self._clock())

    def _apply_results(
        self,
        output: SchedulerOutput,
        plan: StepPlan,
        sampled: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        result: ModelStepResult,
        finished: list[RequestOutput],
    ) -> DecodeDeltas | None:
        mgr = self.manager
        table = self._table
        decode: DecodeDeltas | None = None
        counts = output.sample_counts
        num_decode = output.num_decode_seqs
        if plan.special:
            offsets = np.cumsum(counts, dtype=np.int64) - counts
            ones = counts == 1
            safe = np.minimum(offsets, max(len(sampled) - 1, 0))
            row_tok = np.where(ones, sampled[safe] if len(sampled) else -1, -1)
            row_lp = np.where(ones, logprobs[safe] if len(sampled) else 0.0, 0.0)
        else:
            offsets = None
            ones = None
            row_tok = sampled
            row_lp = logprobs
        commit_tokens = np.full(output.num_seqs, -1, dtype=np.int64)
        commit_tokens[plan.row_seq_pos] = row_tok
        mgr.commit_batch(output.seq_ids, output.num_scheduled_tokens, commit_tokens)
        # Every drawn token: one per ordinary row, n for a prompt row that forks n samples
        # (beam tokens are counted in _beam_step).
        self.counters.num_generated_tokens += int(counts.sum()) if plan.special else len(row_tok)

        remove_rows: list[npt.NDArray[np.int64]] = []
        add_rows: list[Rows] = []
        # Decodes: vectorised append of one token per sequence, then stop conditions.
        if num_decode:
            rows = table.rows_of(output.seq_ids[:num_decode])
            tok = row_tok[:num_decode]
            lp = row_lp[:num_decode]
            if ones is not None:
                mask = ones[:num_decode]
                beam_rows = rows[~mask]
                rows, tok, lp = rows[mask], tok[mask], lp[mask]
            else:
                beam_rows = None
            cols = table.cols
            cols["last_token"][rows] = tok
            cols["num_tokens"][rows] += 1
            generated = cols["num_generated"][rows] + 1
            cols["num_generated"][rows] = generated
            cols["cum_logprob"][rows] += lp
            decode = self._decode_deltas(rows, tok, generated)
            done = (generated >= cols["max_tokens"][rows]) | (tok == cols["eos"][rows])
            if self._stop_tokens.size:
                done |= cols["has_stop"][rows] & np.isin(tok, self._stop_tokens)
            hits = np.flatnonzero(done)
            if hits.size:
                self._finish_decode_rows(rows[hits], tok[hits], remove_rows, finished)
            if beam_rows is not None and beam_rows.size:
                self._beam_decode(beam_rows, output, result, remove_rows, add_rows, finished)
        # Prefill chunks: progress, and the first token(s) of completed prompts.
        sample_row_of_chunk = {j: num_decode + i for i, j in enumerate(plan.row_chunk)}
        for j, (state, _start, length) in enumerate(plan.chunks):
            if state.aborted or state.status is not RequestStatus.PREFILL:
                continue
            state.num_computed += length
            row = sample_row_of_chunk.get(j)
            if row is None:
                continue
            self._prefilling.remove(state)
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = self._now()
            params = state.params
            if params.use_beam_search:
                assert result.topk_token_ids is not None and result.topk_logprobs is not None
                state.status = RequestStatus.RUNNING
                self._beam_step(
                    state,
                    [state.seq_ids[0]],
                    np.array([state.cum_logprob]),
                    len(state.tokens),
                    len(state.tokens) - state.num_prompt,
                    np.asarray(result.topk_token_ids)[row : row + 1],
                    np.asarray(result.topk_logprobs)[row : row + 1],
                    add_rows,
                    finished,
                )
            elif counts[row] > 1:
                assert offsets is not None
                first = int(offsets[row])
                toks = sampled[first : first + int(counts[row])]
                lps = logprobs[first : first + int(counts[row])]
                self._fork_samples(state, toks, lps, add_rows, finished)
            else:
                self._start_decoding(
                    state,
                    [state.seq_ids[0]],
                    row_tok[row : row + 1],
                    row_lp[row : row + 1],
                    add_rows,
                    finished,
                )
        if remove_rows or add_rows:
            remove = np.concatenate(remove_rows) if remove_rows else None
            table.update(remove, add_rows)
        return decode

    def _decode_deltas(
        self,
        rows: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
        generated: npt.NDArray[np.int64],
    ) -> DecodeDeltas:
        """The decode rows' new tokens as columns (rows of aborted requests left out)."""
        cols = self._table.cols
        if self._pending_aborts:
            aborted = [s for a in self._pending_aborts for p in (a, *a.parts) for s in p.seq_ids]
            keep = ~np.isin(cols["seq_id"][rows], np.array(aborted, dtype=np.int64))
            rows, tokens, generated = rows[keep], tokens[keep], generated[keep]
        # rows and generated are fresh arrays; tokens may be a view of the engine's result.
        return DecodeDeltas(
            rows,
            cols["request_id"],
            cols["seq_index"],
            np.array(tokens, dtype=np.int64),
            cols["cum_logprob"][rows],
            generated,
        )

    def _finish_decode_rows(
        self,
        rows: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
        remove_rows: list[npt.NDArray[np.int64]],
        finished: list[RequestOutput],
    ) -> None:
        cols = self._table.cols
        seq_ids = cols["seq_id"][rows].tolist()
        cums = cols["cum_logprob"][rows].tolist()
        kept: list[int] = []
        for row, seq, tok, cum in zip(rows.tolist(), seq_ids, tokens.tolist(), cums, strict=True):
            state = self._owner[seq]
            if state.aborted:
                continue
            generated = int(cols["num_generated"][row])
            reason = state.finish_reason_for(tok, generated)
            if reason is None:
                if generated < state.params.max_tokens:
                    continue  # a stop token of another request
                reason = FinishReason.LENGTH
            kept.append(row)
            out = self._finish_seq(state, seq, reason, cum)
            if out is not None:
                finished.append(out)
        if kept:
            remove_rows.append(np.array(kept, dtype=np.int64))

    def _start_decoding(
        self,
        state: RequestState,
        seq_ids: list[int],
        tokens: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        add_rows: list[Rows],
        finished: list[RequestOutput],
    ) -> None:
        """Sequences whose prompt is computed and that just got their first new token."""
        state.status = RequestStatus.RUNNING
        num_tokens = len(state.tokens) + 1
        generated = num_tokens - state.num_prompt
        cum = state.cum_logprob + logprobs
        keep: list[int] = []
        events = self._step_events.setdefault(state.request.request_id, {})
        for i, (seq, tok) in enumerate(zip(seq_ids, tokens.tolist(), strict=True)):
            reason = state.finish_reason_for(tok, generated)
            if reason is None and generated >= state.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None:
                keep.append(i)
                index = state.seq_index[seq]
                events[index] = CompletionOutput(index, [], float(cum[i]), None, [tok], generated)
                continue
            out = self._finish_seq(state, seq, reason, float(cum[i]))
            if out is not None:
                finished.append(out)
        if keep:
            idx = np.array(keep, dtype=np.int64)
            add_rows.append(
                state.table_rows(
                    np.array(seq_ids, dtype=np.int64)[idx],
                    tokens[idx],
                    num_tokens,
                    generated,
                    cum[idx],
                )
            )

    def _fork_samples(
        self,
        state: RequestState,
        tokens: npt.NDArray[np.int64],
        logprobs: npt.NDArray[np.float64],
        add_rows: list[Rows],
        finished: list[RequestOutput],
    ) -> None:
        """``n > 1``: fork the prompt's sequence once per extra sample (shared KV, CoW)."""
        parent = state.seq_ids[0]
        seq_ids = [parent]
        for index in range(1, len(tokens)):
            child = self._new_seq_id()
            self.manager.fork(parent, child)
            self._adopt(state, child, index)
            seq_ids.append(child)
        state.seq_ids = list(seq_ids)  # _start_decoding may drop finished ones from it
        state.multi = True
        self.manager.commit_batch(np.array(seq_ids, dtype=np.int64), 0, tokens)
        self._start_decoding(state, seq_ids, tokens, logprobs, add_rows, finished)

    # -- beam search ---------------------------------------------------------------------
    def _beam_decode(
        self,
        rows: npt.NDArray[np.int64],
        output: SchedulerOutput,
        result: ModelStepResult,
        remove_rows: list[npt.NDArray[np.int64]],
        add_rows: list[Rows],
        finished: list[RequestOutput],
    ) -> None:
        cols = self._table.cols
        topk_ids = np.asarray(result.topk_token_ids)
        topk_lps = np.asarray(result.topk_logprobs)
        # The decode rows are the first rows of the step, in the same order as seq_ids.
        row_in_step = {int(s): i for i, s in enumerate(output.seq_ids[: output.num_decode_seqs])}
        groups: dict[int, list[int]] = defaultdict(list)
        for row in rows.tolist():
            groups[int(cols["counter"][row])].append(row)
        for group in groups.values():
            seq_ids = [int(cols["seq_id"][r]) for r in group]
            state = self._owner[seq_ids[0]]
            if state.aborted:
                continue
            remove_rows.append(np.array(group, dtype=np.int64))
            steps = [row_in_step[s] for s in seq_ids]
            self._beam_step(
                state,
                seq_ids,
                cols["cum_logprob"][group].astype(np.float64),
                int(cols["num_tokens"][group[0]]),
                int(cols["num_generated"][group[0]]),
                topk_ids[steps],
                topk_lps[steps],
                add_rows,
                finished,
            )

    def _beam_step(
        self,
        state: RequestState,
        parents: list[int],
        cums: npt.NDArray[np.float64],
        num_tokens: int,
        num_generated: int,
        topk_ids: npt.NDArray[np.int64],
        topk_lps: npt.NDArray[np.float32],
        add_rows: list[Rows],
        finished: list[RequestOutput],
    ) -> None:
        """Extend the live beams by one token: fork, free and commit their sequences."""
        mgr = self.manager
        params = state.params
        width = params.beam_width
        choices, ended = select_beams(cums, topk_ids, topk_lps, width, state.beam_stops)
        self.counters.num_generated_tokens += len(choices) + len(ended)
        start = state.num_prompt
        tokens_of: dict[int, list[int]] = {}

        def history(parent: int) -> list[int]:
            if parent not in tokens_of:
                tokens_of[parent] = mgr.token_ids(parents[parent])[start:].tolist()
            return tokens_of[parent]

        for parent, token, score, _ in ended:
            reason = FinishReason.EOS if token == state.eos else FinishReason.STOP
            state.hypotheses.append(Hypothesis([*history(parent), token], score, reason))
        generated = num_generated + 1
        if len(state.hypotheses) >= width or generated >= params.max_tokens or not choices:
            if generated >= params.max_tokens:
                for choice in choices:
                    state.hypotheses.append(
                        Hypothesis(
                            [*history(choice.parent), choice.token],
                            choice.cum_logprob,
                            FinishReason.LENGTH,
                        )
                    )
            for seq in parents:
                self._release_seq(state, seq)
            finished.append(self._finish_request(state))
            return
        used: set[int] = set()
        seq_ids: list[int] = []
        for choice in choices:
            if choice.parent in used:
                child = self._new_seq_id()
                mgr.fork(parents[choice.parent], child)
                self._adopt(state, child, len(state.all_seq_ids))
                seq_ids.append(child)
            else:
                used.add(choice.parent)
                seq_ids.append(parents[choice.parent])
        for index, seq in enumerate(parents):
            if index not in used:
                self._release_seq(state, seq)
        tokens = np.array([c.token for c in choices], dtype=np.int64)
        mgr.commit_batch(np.array(seq_ids, dtype=np.int64), 0, tokens)
        state.seq_ids = seq_ids
        state.multi = True
        state.status = RequestStatus.RUNNING
        add_rows.append(
            state.table_rows(
                np.array(seq_ids, dtype=np.int64),
                tokens,
                num_tokens + 1,
                generated,
                np.array([c.cum_logprob for c in choices], dtype=np.float64),
            )
        )

    # -- preemption ----------------------------------------------------------------------
    def _make_room_for(self, needy: RequestState, row: int) -> None:
        """The pool cannot give ``needy`` (table row ``row``) its decode slot: free blocks.

        Preempts the least important running request; if that is ``needy`` itself, it
        preempts itself, unless nothing else holds blocks, in which case it cannot grow
        and finishes with reason ``"length"``.
        """
        self._preempted = True
        victim = self._pick_victim()
        if victim is not needy:
            assert victim is not None
            self._preempt(victim)
            return
        first = min(int(self._table.rows_of(np.array(needy.seq_ids, dtype=np.int64)).min()), row)
        others = len(self._table) > len(needy.seq_ids) or bool(self._prefilling)
        # Rows of needy before `row` got their slots in this round; end the round first.
        for seq in self._table["seq_id"][first:row].tolist():
            self.manager.commit(seq, 0)
        if others:
            self._preempt(needy)
        elif needy.multi and not needy.params.use_beam_search:
            # Its forked sequences fill the pool together; one by one they may not.
            self._split(needy)
        else:
            self._end_early(needy, FinishReason.LENGTH)

    def _pick_victim(self) -> RequestState | None:
        victim = None
        if len(self._table):
            victim = self._owner[int(self._table["seq_id"][-1])]
        if self._prefilling:
            last = self._prefilling[-1]
            if victim is None or last.key > victim.key:
                victim = last
        return victim

    def _preempt(self, state: RequestState) -> None:
        mode = self.config.preemption_mode
        swap = state.multi or mode == "swap"
        if swap and state.status is RequestStatus.RUNNING and self._swap_out(state):
            return
        self._recompute_any(state)

    def _recompute_any(self, state: RequestState) -> None:
        """Give up the request's blocks (GPU or CPU) and compute it again later.

        A single sequence is recomputed (prompt + its tokens). The sequences of an
        ``n > 1`` request are independent after the fork, so each continues as its own
        part (:meth:`_split`); beam search ranks its beams together and restarts from
        the prompt (:meth:`_restart`; the search is deterministic given the model).
        """
        if not state.multi:
            self._recompute(state)
        elif state.params.use_beam_search:
            self._restart(state)
        else:
            self._split(state)

    def _take_live_seqs(self, state: RequestState) -> list[tuple[int, float]]:
        """Remove a running or swapped request's sequences from the table or the swapped
        queue; return ``(seq_id, cumulative_logprob)`` of each (blocks are still held)."""
        if state.status is RequestStatus.RUNNING:
            rows = self._table.rows_of(np.array(state.seq_ids, dtype=np.int64))
            seqs = self._table["seq_id"][rows].tolist()
            cums = self._table["cum_logprob"][rows].tolist()
            self._table.update(rows, [])
        else:
            assert state.status is RequestStatus.SWAPPED and state.swapped_rows is not None
            self._swapped.remove(state)
            seqs = state.swapped_rows["seq_id"].tolist()
            cums = state.swapped_rows["cum_logprob"].tolist()
            state.swapped_rows = None
        return list(zip(seqs, cums, strict=True))

    def _queue(self, state: RequestState) -> None:
        """Put a single-sequence state (not registered with the manager) in the waiting queue."""
        state.registered_step = -1
        if self.policy.name == "lpm":
            self._register(state)
        state.num_computed = 0
        state.status = RequestStatus.WAITING
        self._waiting.push(state)

    def _split(self, state: RequestState) -> None:
        """Recompute an ``n > 1`` request's live sequences one by one, as parts.

        Each part is a single-sequence request of the prompt plus its sequence's own
        tokens, with the request's key (so it is re-admitted before later arrivals) and
        the sequence's id and completion index; with prefix caching the shared prompt is
        computed once. The request finishes when its last part does.
        """
        mgr = self.manager
        for seq, cum in self._take_live_seqs(state):
            part = state.make_part(seq, np.asarray(mgr.token_ids(seq), dtype=np.int64), cum)
            mgr.free(seq)
            self._block_table.release((seq,))
            self._owner[seq] = part
            state.parts.append(part)
            self._queue(part)
        state.seq_ids = []
        state.status = RequestStatus.SPLIT
        self._num_split += 1
        self.counters.num_preemptions_recompute += 1
        state.metrics.num_preemptions += 1

    def _restart(self, state: RequestState) -> None:
        """Free a beam-search request's sequences and queue it again from its prompt."""
        mgr = self.manager
        live = self._take_live_seqs(state)
        for seq, _ in live:
            mgr.free(seq)
            self._block_table.release((seq,))
        first = live[0][0]
        for seq in state.all_seq_ids:
            if seq != first and self._owner.get(seq) is state:
                del self._owner[seq]
                self._free_seq_ids.append(seq)
        state.all_seq_ids = [first]
        state.seq_ids = [first]
        state.seq_index = {first: 0}
        state.tokens = np.asarray(state.request.prompt_token_ids)
        state.cum_logprob = 0.0
        state.multi = False
        state.hypotheses = []
        state.outputs = {}
        self._queue(state)
        self.counters.num_preemptions_recompute += 1
        state.metrics.num_preemptions += 1

    def _swap_out(self, state: RequestState) -> bool:
        mgr = self.manager
        seqs = state.seq_ids
        if mgr.num_cpu_blocks == 0 or not mgr.can_swap_out(seqs):
            return False
        rows = self._table.rows_of(np.array(seqs, dtype=np.int64))
        self._drain_copies()
        self._swap_out_maps.append(np.asarray(mgr.swap_out(seqs), dtype=np.int64))
        self._block_table.release(seqs)
        if self._tiered:
            self._drain_copies()  # the manager queued the swap with its ops
        else:
            self._memory_ops.append(("swap_out", self._swap_out_maps[-1]))
        state.swapped_rows = self._table.take(rows)
        self._table.update(rows, [])
        state.status = RequestStatus.SWAPPED
        _insort(self._swapped, state)
        self.counters.num_preemptions_swap += 1
        state.metrics.num_preemptions += 1
        return True

    def _drain_copies(self) -> None:
        """Record the copy-on-writes issued so far, before a swap reuses or reads blocks.

        With a host tier, every op the manager queued (swaps, copies, offloads, loads) in
        its order.
        """
        if self._tiered:
            for kind, ops in self.manager.take_memory_ops():
                self._memory_ops.append((kind, np.asarray(ops, dtype=np.int64)))
            return
        pairs = np.asarray(self.manager.take_copy_on_writes(), dtype=np.int64).reshape(-1, 2)
        if len(pairs):
            self._memory_ops.append(("copy", pairs))

    def _recompute(self, state: RequestState) -> None:
        """Free the single sequence's blocks and queue it to be computed again."""
        mgr = self.manager
        seq = state.seq_ids[0]
        if state.status is RequestStatus.PREFILL:
            self._prefilling.remove(state)
        else:
            ((_, state.cum_logprob),) = self._take_live_seqs(state)
            state.tokens = np.asarray(mgr.token_ids(seq), dtype=np.int64)
        mgr.free(seq)
        self._block_table.release((seq,))
        self._queue(state)
        self.counters.num_preemptions_recompute += 1
        state.metrics.num_preemptions += 1

    # -- admission -----------------------------------------------------------------------
    def _admit(self, state: RequestState, budget: int, *, may_hold: bool = False) -> int | None:
        """Try to admit ``state`` with up to ``budget`` tokens; the chunk length, 0 if it
        finished (can never fit), None if it must wait, ``_HELD`` if it waits for a prefix
        being computed in this step (only with ``may_hold``: something else is scheduled)."""
        mgr = self.manager
        seq = state.seq_ids[0]
        if state.registered_step != self.counters.num_steps:
            self._register(state)  # claim against the cache as it is now
        if not self._fit_loads(seq):
            return None
        status = mgr.can_allocate(seq, num_lookahead_tokens=0)
        if status == AllocStatus.NEVER:
            self._end_early(state, FinishReason.LENGTH)
            return 0
        if status != AllocStatus.OK:
            return None
        cached = int(mgr.num_computed_tokens(seq))
        if may_hold and self._wait_for_prefix(state, seq, cached):
            return _HELD
        length = len(state.tokens) - cached
        if length > budget:
            # Without chunked prefill a prompt is computed whole or waits (add_request
            # rejects prompts over the budget); but a recomputed sequence (prompt +
            # generated tokens) may exceed the budget and could never be computed
            # whole, so it is chunked like a long prompt with chunked prefill on.
            whole = length <= self.config.max_num_batched_tokens
            if not self.config.enable_chunked_prefill and whole:
                return None
            length = budget
        if mgr.allocate_slots(seq, length) is None:
            return None
        if self._tiered:
            loads = int(mgr.num_tier_loads(seq))
            self._step_loads += loads
            self.counters.num_load_blocks += loads
        state.num_computed = int(mgr.num_computed_tokens(seq))
        self._waiting.remove(state)
        self._prefix_hold.release(state)
        state.status = RequestStatus.PREFILL
        _insort(self._prefilling, state)
        counters = self.counters
        if state.admitted:
            # A recompute readmission mostly finds its own blocks cached: counted apart,
            # so the prefix hit rate reflects what prompts share.
            counters.num_readmitted_tokens += len(state.tokens)
            counters.num_readmitted_cached_tokens += state.num_computed
        else:
            state.admitted = True
            state.num_cached_tokens = state.num_computed
            state.metrics.first_scheduled_time = self._now()
            state.metrics.num_cached_tokens = state.num_computed
            counters.num_prompt_tokens_admitted += len(state.tokens)
            counters.num_cached_tokens_admitted += state.num_computed
        return length

    def _fit_loads(self, seq: int) -> bool:
        """Keep the waiting sequence's host-tier loads within what the step has left of
        ``max_load_blocks_per_step``; ``False`` if it must wait for a later step.

        Loads over what is left wait, unless the step has queued none yet: then the
        request's loads exceed the whole bound, and it is admitted with only the prefix
        whose loads fit (the rest computed), so it never waits forever.
        """
        bound = self.config.max_load_blocks_per_step
        if bound is None or not self._tiered:
            return True
        mgr = self.manager
        loads = int(mgr.num_tier_loads(seq))
        left = bound - self._step_loads
        if loads <= left:
            return True
        if self._step_loads > 0:
            self.counters.num_loads_deferred += loads
            return False
        mgr.limit_tier_loads(seq, left)
        self.counters.num_loads_recomputed += loads - left
        return True

    def _wait_for_prefix(self, state: RequestState, seq: int, cached: int) -> bool:
        """Whether the prompt blocks right past ``state``'s cached prefix are being
        computed in this step by another sequence, so that it should wait a step for them
        (see :class:`PrefixHold` for the bounds)."""
        if not self._prefix_caching:
            return False
        bs = self.manager.block_size
        # The hit never covers the last token: no further whole block can be shared.
        if (len(state.tokens) - 1) // bs <= cached // bs:
            return False
        ahead = int(self.manager.probe_in_flight([seq])[0])
        return self._prefix_hold.should_hold(state, cached, ahead)

    def _allocate_prefill(self, state: RequestState, length: int) -> bool:
        """Slots for the next chunk of a request being prefilled; may preempt later ones."""
        mgr = self.manager
        seq = state.seq_ids[0]
        while mgr.allocate_slots(seq, length) is None:
            victim = self._prefilling[-1]
            if victim is state:
                if len(self._table) == 0 and len(self._prefilling) == 1:
                    self._preempted = True
                    self._end_early(state, FinishReason.LENGTH)
                return False
            self._preempted = True
            self._preempt(victim)
        return True

    def _register(self, state: RequestState) -> None:
        """Register the waiting sequence, or refresh its prefix probe if it is registered.

        The block manager caps a waiting sequence's cache hit at what was cached when it
        was added; ``refresh_prefixes`` resets that cap to the cache as it is now from
        the stored block hashes, so a registered sequence is never re-added (re-hashed).
        """
        mgr = self.manager
        seq = state.seq_ids[0]
        if state.registered_step >= 0:
            mgr.refresh_prefixes([seq])
        else:
            request = state.request
            mgr.add_sequence(
                seq,
                state.tokens,
                cache_salt=request.cache_salt,
                lora_id=request.lora_id,
                **_retention_kwargs(request),
            )
        state.registered_step = self.counters.num_steps

    # -- bookkeeping -----------------------------------------------------------------------
    def _num_live_seqs(self) -> int:
        return len(self._table) + sum(s.width for s in self._prefilling)

    def _cut_at_request_boundary(self, end: int) -> int:
        """Do not split a multi-sequence request across the batch limit."""
        counter = self._table["counter"]
        while end > 0 and counter[end - 1] == counter[end]:
            end -= 1
        return end

    def _new_seq_id(self) -> int:
        if self._free_seq_ids:
            return self._free_seq_ids.pop()
        seq = self._next_seq_id
        self._next_seq_id += 1
        return seq

    def _adopt(self, state: RequestState, seq: int, index: int) -> None:
        state.all_seq_ids.append(seq)
        state.seq_index[seq] = index
        self._owner[seq] = state

    def _release_seq(self, state: RequestState, seq: int) -> None:
        self.manager.free(seq)
        self._block_table.release((seq,))
        if seq in state.seq_ids:
            state.seq_ids.remove(seq)

    def _finish_seq(
        self, state: RequestState, seq: int, reason: FinishReason, cum: float
    ) -> RequestOutput | None:
        """One sequence stopped; returns the request's output if it was the last one."""
        tokens = self.manager.token_ids(seq)[state.num_prompt :].tolist()
        index = state.seq_index[seq]
        # Called only for a sequence that just sampled its last token.
        completion = CompletionOutput(index, tokens, cum, reason, tokens[-1:])
        state.outputs[index] = completion
        state.output_step[index] = self.counters.num_steps
        self._step_events.setdefault(state.request.request_id, {})[index] = completion
        self._release_seq(state, seq)
        if state.seq_ids:
            return None
        if state.parent is not None:
            return self._finish_part(state, state.outputs)
        return self._finish_request(state)

    def _finish_part(
        self, part: RequestState, outputs: dict[int, CompletionOutput]
    ) -> RequestOutput | None:
        """A part's sequence ended with ``outputs``; returns the request's output if it
        was the last part."""
        parent = part.parent
        assert parent is not None
        parent.outputs.update(outputs)
        parent.output_step.update(part.output_step)
        parent.parts.remove(part)
        self._drop_request(part)
        if parent.parts:
            return None
        self._num_split -= 1
        return self._finish_request(parent)

    def _end_early(self, state: RequestState, reason: FinishReason) -> None:
        """End a request (or part) that cannot fit with what it has; its output (the
        request's, once its last part ended) is returned by the next ``update``."""
        output = self._abort_output(state, reason)
        if state.parent is None:
            state.metrics.finished_time = self._now()
            self._record_finish(state, output)
        else:
            done = self._finish_part(state, {c.index: c for c in output.outputs})
            if done is not None:
                self._early_outputs.append(done)
            return
        self._drop_request(state)
        self.counters.num_requests_finished += 1
        self._early_outputs.append(output)

    def _finish_request(self, state: RequestState) -> RequestOutput:
        params = state.params
        if params.use_beam_search:
            best = rank_hypotheses(state.hypotheses, params.length_penalty)[: params.n]
            outputs = [
                CompletionOutput(i, h.token_ids, h.cum_logprob, h.finish_reason, list(h.token_ids))
                for i, h in enumerate(best)
            ]
        else:
            step = self.counters.num_steps
            outputs = [
                c if state.output_step.get(i) == step else dataclasses.replace(c, new_token_ids=[])
                for i, c in sorted(state.outputs.items())
            ]
        state.status = RequestStatus.FINISHED
        self._forget(state)
        self.counters.num_requests_finished += 1
        output = RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.prompt_list,
            outputs=outputs,
            num_cached_tokens=state.num_cached_tokens,
            finished=True,
        )
        state.metrics.finished_time = self._now()
        self._record_finish(state, output)
        return output

    def _record_finish(self, state: RequestState, output: RequestOutput) -> None:
        """Complete the request's metrics, attach them and add them to the statistics."""
        metrics = state.metrics
        metrics.num_generated_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        output.metrics = metrics
        self.latency.add(metrics)

    def _abort_output(
        self, state: RequestState, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput:
        """The request's output as it stands, every unfinished sequence ending with ``reason``."""
        mgr = self.manager
        # Sequences that finished in earlier steps sent their last tokens then.
        outputs = {
            i: dataclasses.replace(c, new_token_ids=[]) if c.new_token_ids else c
            for i, c in state.outputs.items()
        }
        for part in state.parts:
            outputs.update({c.index: c for c in self._abort_output(part, reason).outputs})
        cums: dict[int, float] = {}
        if state.status is RequestStatus.RUNNING:
            rows = self._table.rows_of(np.array(state.seq_ids, dtype=np.int64))
            cums = dict(zip(state.seq_ids, self._table["cum_logprob"][rows].tolist(), strict=True))
        elif state.status is RequestStatus.SWAPPED and state.swapped_rows is not None:
            swapped = state.swapped_rows
            cums = dict(
                zip(swapped["seq_id"].tolist(), swapped["cum_logprob"].tolist(), strict=True)
            )
        for seq in state.seq_ids:
            index = state.seq_index[seq]
            if state.status is RequestStatus.WAITING:
                tokens = state.tokens[state.num_prompt :].tolist()
            else:
                tokens = mgr.token_ids(seq)[state.num_prompt :].tolist()
            outputs[index] = CompletionOutput(
                index, tokens, cums.get(seq, state.cum_logprob), reason
            )
        if state.parent is None and not state.params.use_beam_search:
            # An n > 1 request that has not forked yet: the other samples are empty.
            for index in range(state.params.n):
                outputs.setdefault(index, CompletionOutput(index, [], 0.0, reason))
        ordered = [outputs[i] for i in sorted(outputs)]
        if state.params.use_beam_search:
            hyps = [Hypothesis(o.token_ids, o.cumulative_logprob, reason) for o in ordered]
            hyps += state.hypotheses
            best = rank_hypotheses(hyps, state.params.length_penalty)[: state.params.n]
            # Beams were never streamed: their record carries them whole.
            ordered = [
                CompletionOutput(i, h.token_ids, h.cum_logprob, h.finish_reason, list(h.token_ids))
                for i, h in enumerate(best)
            ]
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.prompt_list,
            outputs=ordered,
            num_cached_tokens=state.num_cached_tokens,
            finished=True,
            metrics=state.metrics,
        )

    def _drop_request(self, state: RequestState) -> None:
        """Remove a request from wherever it is and release its sequences."""
        mgr = self.manager
        if state.status is RequestStatus.FINISHED:
            return
        if state.status is RequestStatus.WAITING:
            self._waiting.remove(state)
            if state.registered_step < 0:
                state.seq_ids = []  # not registered with the manager: nothing to free
        elif state.status is RequestStatus.PREFILL:
            self._prefilling.remove(state)
        elif state.status is RequestStatus.SWAPPED:
            self._swapped.remove(state)
        elif state.status is RequestStatus.SPLIT:
            for part in state.parts:
                self._drop_request(part)
            state.parts = []
            self._num_split -= 1
        elif state.status is RequestStatus.RUNNING:
            rows = self._table.rows_of(np.array(state.seq_ids, dtype=np.int64))
            rows = rows[rows >= 0]
            if rows.size:
                self._table.update(rows, [])
        for seq in state.seq_ids:
            mgr.free(seq)
            self._block_table.release((seq,))
        state.seq_ids = []
        state.status = RequestStatus.FINISHED
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        rid = state.request.request_id
        if self._requests.get(rid) is state:
            del self._requests[rid]
            if state.params.min_tokens > 0:
                self._num_min_tokens_requests -= 1
        for seq in state.all_seq_ids:
            if self._owner.get(seq) is state:
                del self._owner[seq]
                self._free_seq_ids.append(seq)
        state.all_seq_ids = []
        if state.parent is None:
            self._finished_ids.append(rid)

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
        waiting, swapped = len(self._waiting), len(self._swapped)
        if self._num_split:
            # Parts of a split request are queued on their own; the request counts as
            # running until its last part finishes.
            waiting = sum(1 for s in self._waiting if s.parent is None)
            swapped = sum(1 for s in self._swapped if s.parent is None)
        running = len(self._requests) - waiting - swapped
        return {
            "num_running": running,
            "num_running_seqs": len(self._table) + len(self._prefilling),
            "num_waiting": waiting,
            "num_swapped": swapped,
            "kv_usage": float(self.manager.usage()),
            "num_free_blocks": int(self.manager.num_free_blocks()),
        }

    def _stats_row(self, output: SchedulerOutput) -> dict[str, float]:
        counters = self.counters
        # History rows are a float time series (StatsHistory.column).
        row = {name: float(value) for name, value in self._gauges().items()}
        row["step"] = float(counters.num_steps)
        row["num_batched_tokens"] = float(output.num_tokens)
        row["num_prefill_tokens"] = float(output.num_prefill_tokens)
        row["num_decode_tokens"] = float(output.num_decode_tokens)
        row["num_preemptions"] = float(counters.num_preemptions)
        row["num_load_blocks"] = float(self._step_loads)
        row["prefix_hit_rate"] = counters.prefix_hit_rate
        return row


def _retention_kwargs(request: Request) -> dict[str, int]:
    """``add_sequence``'s ``retention_priority`` argument when the request sets one (a
    manager without retention priorities is never passed it otherwise)."""
    if request.retention_priority is None:
        return {}
    return {"retention_priority": request.retention_priority}


def _finish_reason(reason: FinishReason | str) -> FinishReason:
    """``reason`` as a :class:`FinishReason`; a value outside it is a caller error."""
    try:
        return FinishReason(reason)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"unknown finish reason {reason!r}") from None


def _insort(queue: list[RequestState], state: RequestState) -> None:
    index = len(queue)
    while index > 0 and queue[index - 1].key > state.key:
        index -= 1
    queue.insert(index, state)
