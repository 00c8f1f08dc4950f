"""Preemption (:class:`Preemption`): giving blocks back when the pool runs short.

The least important request (the largest key; running rows are sorted by key, so it is
the last row or the last request being prefilled) gives its blocks back in one of four
ways:

- **swap** (a multi-sequence request, or ``preemption_mode="swap"``, when the CPU pool has
  room): its blocks move to the CPU pool and it comes back whole later;
- **recompute** a single sequence: freed, queued again with prompt + generated tokens;
- **split** an ``n > 1`` request: its sequences are independent after the fork, so each
  continues as its own single-sequence part;
- **restart** a beam search from its prompt (the search is deterministic given the model).

A request that is itself the least important preempts itself, unless nothing else holds
blocks: then it cannot grow and ends with reason ``"length"``.
"""

from __future__ import annotations

import numpy as np

from kvblocks.protocols import BlockManager
from kvblocks.scheduler.config import SchedulerConfig
from kvblocks.scheduler.placement import Placement, insort
from kvblocks.scheduler.records import Records
from kvblocks.scheduler.request import FinishReason
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import SchedulerCounters
from kvblocks.scheduler.step import StepState

__all__ = ["Preemption"]


class Preemption:
    """Frees blocks for the step being scheduled by preempting running requests."""

    def __init__(
        self,
        manager: BlockManager,
        config: SchedulerConfig,
        placement: Placement,
        records: Records,
        counters: SchedulerCounters,
    ) -> None:
        self.manager = manager
        self.config = config
        self.placement = placement
        self.records = records
        self.counters = counters

    def make_room_for_decode(self, needy: RequestState, row: int, step: StepState) -> None:
        """The pool cannot give ``needy`` (table row ``row``) its decode slot: free blocks.

        Preempts the least important running request; if that is ``needy`` itself, it
        preempts itself, unless nothing else holds blocks, in which case it cannot grow
        and finishes with reason ``"length"``.
        """
        step.preempted = True
        table = self.placement.table
        victim = self._pick_victim()
        if victim is not needy:
            assert victim is not None
            self.preempt(victim, step)
            return
        first = min(int(table.rows_of(np.array(needy.seq_ids, dtype=np.int64)).min()), row)
        others = len(table) > len(needy.seq_ids) or bool(self.placement.prefilling)
        # Rows of needy before `row` got their slots in this round; end the round first.
        for seq in table["seq_id"][first:row].tolist():
            self.manager.commit(seq, 0)
        if others:
            self.preempt(needy, step)
        elif needy.multi and not needy.params.use_beam_search:
            # Its forked sequences fill the pool together; one by one they may not.
            self._split(needy, step)
        else:
            self.records.end_early(needy, FinishReason.LENGTH, step)

    def allocate_chunk(self, state: RequestState, length: int, step: StepState) -> int:
        """Slots for the next chunk of a request being prefilled; preempts requests
        prefilled after it if needed. Returns the tokens the chunk got slots for:
        ``length``, or fewer when the request alone holds blocks and the pool cannot hold
        the whole chunk (a window or chunked group holds every block of a step until it
        commits, so a shorter step needs fewer); ``0``: it must wait (or it was ended,
        when it alone holds blocks and cannot get even one token's)."""
        prefilling = self.placement.prefilling
        seq = state.seq_ids[0]
        while self.manager.allocate_slots(seq, length) is None:
            victim = prefilling[-1]
            if victim is state:
                if len(self.placement.table) == 0 and len(prefilling) == 1:
                    if length > 1:
                        length = (length + 1) // 2
                        continue
                    step.preempted = True
                    self.records.end_early(state, FinishReason.LENGTH, step)
                return 0
            step.preempted = True
            self.preempt(victim, step)
        return length

    def _pick_victim(self) -> RequestState | None:
        placement = self.placement
        victim = None
        if len(placement.table):
            victim = placement.registry.owner[int(placement.table["seq_id"][-1])]
        if placement.prefilling:
            last = placement.prefilling[-1]
            if victim is None or last.key > victim.key:
                victim = last
        return victim

    def preempt(self, state: RequestState, step: StepState) -> None:
        """Give back the blocks of ``state`` (swap when it may, else recompute)."""
        swap = state.multi or self.config.preemption_mode == "swap"
        if swap and state.status is RequestStatus.RUNNING and self._swap_out(state, step):
            return
        self.recompute(state, step)

    def recompute(self, state: RequestState, step: StepState) -> None:
        """Give up the request's blocks (GPU or CPU) and compute it again later.

        A single sequence is recomputed (prompt + its tokens). The sequences of an
        ``n > 1`` request are independent after the fork, so each continues as its own
        part (:meth:`_split`); beam search ranks its beams together and restarts from
        the prompt (:meth:`_restart`).
        """
        if not state.multi:
            self._recompute_single(state, step)
        elif state.params.use_beam_search:
            self._restart(state, step)
        else:
            self._split(state, step)

    def _split(self, state: RequestState, step: StepState) -> None:
        """Recompute an ``n > 1`` request's live sequences one by one, as parts.

        Each part is a single-sequence request of the prompt plus its sequence's own
        tokens, with the request's key (so it is re-admitted before later arrivals) and
        the sequence's id and completion index; with prefix caching the shared prompt is
        computed once. The request finishes when its last part does.
        """
        placement = self.placement
        for seq, cum in placement.take_live_seqs(state):
            tokens = np.asarray(self.manager.token_ids(seq), dtype=np.int64)
            part = state.make_part(seq, tokens, cum)
            placement.release((seq,))
            placement.registry.owner[seq] = part
            state.parts.append(part)
            placement.requeue(part, step.step)
        state.seq_ids = []
        state.status = RequestStatus.SPLIT
        placement.num_split += 1
        self._count_recompute(state)

    def _restart(self, state: RequestState, step: StepState) -> None:
        """Free a beam-search request's sequences and queue it again from its prompt."""
        placement = self.placement
        live = placement.take_live_seqs(state)
        placement.release(seq for seq, _ in live)
        first = live[0][0]
        placement.registry.disown_forks(state, keep=first)
        state.all_seq_ids = [first]
        state.seq_ids = [first]
        state.seq_index = {first: 0}
        state.tokens = np.asarray(state.request.prompt_token_ids)
        state.cum_logprob = 0.0
        state.multi = False
        state.hypotheses = []
        state.outputs = {}
        placement.requeue(state, step.step)
        self._count_recompute(state)

    def _recompute_single(self, state: RequestState, step: StepState) -> None:
        """Free the single sequence's blocks and queue it to be computed again."""
        placement = self.placement
        seq = state.seq_ids[0]
        if state.status is RequestStatus.PREFILL:
            placement.prefilling.remove(state)
        else:
            ((_, state.cum_logprob),) = placement.take_live_seqs(state)
            state.tokens = np.asarray(self.manager.token_ids(seq), dtype=np.int64)
        placement.release((seq,))
        placement.requeue(state, step.step)
        self._count_recompute(state)

    def _swap_out(self, state: RequestState, step: StepState) -> bool:
        mgr = self.manager
        seqs = state.seq_ids
        if mgr.num_cpu_blocks == 0 or not mgr.can_swap_out(seqs):
            return False
        placement = self.placement
        table = placement.table
        rows = table.rows_of(np.array(seqs, dtype=np.int64))
        mgr.swap_out(seqs)  # its rows are in the manager's memory-op journal
        placement.block_table.release(seqs)
        state.swapped_rows = table.take(rows)
        table.update(rows, [])
        state.status = RequestStatus.SWAPPED
        insort(placement.swapped, state)
        self.counters.num_preemptions_swap += 1
        state.metrics.num_preemptions += 1
        return True

    def _count_recompute(self, state: RequestState) -> None:
        self.counters.num_preemptions_recompute += 1
        state.metrics.num_preemptions += 1
