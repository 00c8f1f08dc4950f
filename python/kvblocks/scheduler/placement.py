"""Where each unfinished request is (:class:`Placement`), and the one place a sequence
gives its blocks back.

A request is in exactly one place: the waiting queue (key order, admission policy on
top), the list of requests being prefilled (key order), the decode table (one row per
sequence, :class:`SequenceTable`), the swapped list (key order), or split into parts
that are themselves placed. A sequence leaving the GPU (finished, preempted, aborted)
frees its blocks in the manager and its row of the persistent block table together:
:meth:`Placement.release`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvblocks._core import AllocStatus
from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import BlockManager
from kvblocks.scheduler.block_table import PersistentBlockTable
from kvblocks.scheduler.queues.policy import SchedulingPolicy, WaitingQueue
from kvblocks.scheduler.queues.wait_bound import WaitBound
from kvblocks.scheduler.registry import RequestRegistry
from kvblocks.scheduler.request import Request
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.seq_table import SequenceTable

__all__ = ["Placement", "insort", "largest_step", "retention_kwargs"]


def largest_step(manager: BlockManager, seq: int, length: int) -> tuple[int, AllocStatus]:
    """The longest step of at most ``length`` tokens past the cached prefix that is not
    ``NEVER`` for the (not yet allocated) sequence, with its status; halves from
    ``length`` (``(1, NEVER)`` when not even one token a step can ever fit).

    A step the pool cannot hold whole may fit shorter (a window group holds every block
    of a step until it commits), and a shorter one may not (a recurrent group's first
    step from position 0 reads no state, so one token a step holds a state more): both
    admission and the check of a new request try the same lengths.
    """
    status = manager.can_allocate(seq, num_new_tokens=length)
    while status == AllocStatus.NEVER and length > 1:
        length = (length + 1) // 2
        status = manager.can_allocate(seq, num_new_tokens=length)
    return length, status


class Placement:
    """The scheduler's queues and decode table over one block manager.

    Args:
        manager: the block manager.
        block_table: the persistent block table (rows of sequences on the GPU).
        registry: the request registry (a dropped request is forgotten there).
        policy: the admission policy (whether waiting sequences stay registered).
        max_wait_steps: the wait bound (:class:`WaitBound`).
    """

    def __init__(
        self,
        manager: BlockManager,
        block_table: PersistentBlockTable,
        registry: RequestRegistry,
        policy: SchedulingPolicy,
        max_wait_steps: int | None,
    ) -> None:
        self.manager = manager
        self.block_table = block_table
        self.registry = registry
        self.policy = policy
        self.waiting = WaitingQueue()
        self.wait_bound = WaitBound(max_wait_steps)
        self.prefilling: list[RequestState] = []  # key order
        self.swapped: list[RequestState] = []  # key order
        self.table = SequenceTable()
        self.num_split = 0  # requests in SPLIT state (their parts sit in the queues)

    # -- counts -------------------------------------------------------------------------
    def num_live_seqs(self) -> int:
        """Sequences on the GPU now or once their prompt is computed."""
        return len(self.table) + sum(s.width for s in self.prefilling)

    def running_request_ids(self) -> list[str]:
        """Requests whose sequences hold GPU blocks (decoding or being prefilled)."""
        ids = dict.fromkeys(self.table["request_id"].tolist())
        ids.update(dict.fromkeys(s.request.request_id for s in self.prefilling))
        return list(ids)

    # -- releasing blocks ---------------------------------------------------------------
    def release(self, seqs: Iterable[int]) -> None:
        """Free the sequences' blocks and take back their block-table rows."""
        seqs = list(seqs)
        for seq in seqs:
            self.manager.free(seq)
        self.block_table.release(seqs)

    def release_seq(self, state: RequestState, seq: int) -> None:
        """One sequence of ``state`` ends: release it and drop it from the live ones."""
        self.release((seq,))
        if seq in state.seq_ids:
            state.seq_ids.remove(seq)

    def take_live_seqs(self, state: RequestState) -> list[tuple[int, float]]:
        """Remove a running or swapped request's sequences from the table or the swapped
        list; return ``(seq_id, cumulative_logprob)`` of each (blocks are still held)."""
        if state.status is RequestStatus.RUNNING:
            table = self.table
            rows = table.rows_of(np.array(state.seq_ids, dtype=np.int64))
            seqs = table["seq_id"][rows].tolist()
            cums = table["cum_logprob"][rows].tolist()
            table.update(rows, [])
        else:
            assert state.status is RequestStatus.SWAPPED and state.swapped_rows is not None
            self.swapped.remove(state)
            seqs = state.swapped_rows["seq_id"].tolist()
            cums = state.swapped_rows["cum_logprob"].tolist()
            state.swapped_rows = None
        return list(zip(seqs, cums, strict=True))

    def swap_in(self, state: RequestState) -> None:
        """Bring a swapped request back to the decode table (``can_swap_in`` said yes);
        its rows go to the manager's memory-op journal."""
        self.manager.swap_in(state.seq_ids)
        self.swapped.remove(state)
        rows = state.swapped_rows
        assert rows is not None
        state.swapped_rows = None
        state.status = RequestStatus.RUNNING
        self.table.update(None, [rows])

    # -- the waiting queue --------------------------------------------------------------
    def register(self, state: RequestState, step: int) -> None:
        """Register the waiting sequence with the manager, or refresh its prefix probe if
        it is registered.

        The block manager caps a waiting sequence's cache hit at what was cached when it
        was added; ``refresh_prefixes`` resets that cap to the cache as it is now from
        the stored block hashes, so a registered sequence is never re-added (re-hashed).
        """
        seq = state.seq_ids[0]
        if state.registered_step >= 0:
            self.manager.refresh_prefixes([seq])
        else:
            request = state.request
            self.manager.add_sequence(
                seq,
                state.tokens,
                cache_salt=request.cache_salt,
                lora_id=request.lora_id,
                **retention_kwargs(request),
            )
        state.registered_step = step

    def enter(self, state: RequestState, step: int, max_step_tokens: int) -> None:
        """Register a new request's sequence with the manager and queue it; a step
        computes at most ``max_step_tokens`` of its prompt.

        Raises:
            InvalidArgumentError: the prompt can never fit in the pool (nothing changed).
        """
        request = state.request
        seq = state.seq_ids[0]
        self.manager.add_sequence(
            seq,
            request.prompt_token_ids,
            cache_salt=request.cache_salt,
            lora_id=request.lora_id,
            **retention_kwargs(request),
        )
        # Admission halves a step until the pool holds it, so a prompt can never fit
        # only when no step it tries does: every group's real need, a window group's
        # worst window (not one block per token in every group).
        cached = int(self.manager.num_computed_tokens(seq))
        length = max(1, min(request.num_prompt_tokens - cached, max_step_tokens))
        if largest_step(self.manager, seq, length)[1] == AllocStatus.NEVER:
            self.manager.free(seq)
            raise InvalidArgumentError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens "
                f"needs more blocks than the pool can ever give ({self.manager.num_blocks - 1} "
                f"usable blocks of {self.manager.block_size} tokens, minus the watermark)"
            )
        if self.policy.probes_waiting:
            state.registered_step = step  # lpm probes waiting sequences
        else:
            self.manager.free(seq)
        self.wait_bound.enter(state, step)
        self.waiting.push(state)

    def requeue(self, state: RequestState, step: int) -> None:
        """Put a single-sequence state whose blocks were freed back in the waiting queue."""
        state.registered_step = -1
        if self.policy.probes_waiting:
            self.register(state, step)
        state.num_computed = 0
        state.status = RequestStatus.WAITING
        self.wait_bound.enter(state, step)
        self.waiting.push(state)

    # -- removal ------------------------------------------------------------------------
    def drop(self, state: RequestState) -> None:
        """Remove a request from wherever it is, release its sequences and forget it."""
        if state.status is RequestStatus.FINISHED:
            return
        if state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
            if state.registered_step < 0:
                state.seq_ids = []  # not registered with the manager: nothing to free
        elif state.status is RequestStatus.PREFILL:
            self.prefilling.remove(state)
        elif state.status is RequestStatus.SWAPPED:
            self.swapped.remove(state)
        elif state.status is RequestStatus.SPLIT:
            for part in state.parts:
                self.drop(part)
            state.parts = []
            self.num_split -= 1
        elif state.status is RequestStatus.RUNNING:
            rows = self.table.rows_of(np.array(state.seq_ids, dtype=np.int64))
            rows = rows[rows >= 0]
            if rows.size:
                self.table.update(rows, [])
        self.release(state.seq_ids)
        state.seq_ids = []
        state.status = RequestStatus.FINISHED
        self.registry.forget(state)


def retention_kwargs(request: Request) -> dict[str, int]:
    """``add_sequence``'s ``retention_priority`` argument when the request sets one (a
    manager without retention priorities is never passed it otherwise)."""
    if request.retention_priority is None:
        return {}
    return {"retention_priority": request.retention_priority}


def insort(queue: list[RequestState], state: RequestState) -> None:
    """Insert ``state`` into a key-ordered list, after its equals."""
    index = len(queue)
    while index > 0 and queue[index - 1].key > state.key:
        index -= 1
    queue.insert(index, state)
