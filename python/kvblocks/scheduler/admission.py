"""Admission of one waiting request (:class:`Admission`), with a typed outcome.

The scheduler walks the waiting queue in policy order and asks :meth:`Admission.admit`
about each request; the answer is :class:`Admitted` (with the chunk it computes this
step) or one of the :class:`Deferred` reasons. Admission claims the cached prefix
(refreshed against the cache as it is now), keeps host-tier loads within
``max_load_blocks_per_step``, holds a request back for a prefix being computed in this
very step (:class:`~kvblocks.scheduler.queues.prefix_hold.PrefixHold`) and chunks what
exceeds the budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvblocks._core import AllocStatus
from kvblocks.protocols import BlockManager
from kvblocks.scheduler.config import SchedulerConfig
from kvblocks.scheduler.placement import Placement, insort, largest_step
from kvblocks.scheduler.queues.prefix_hold import PrefixHold
from kvblocks.scheduler.records import Records
from kvblocks.scheduler.request import FinishReason
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import SchedulerCounters
from kvblocks.scheduler.step import StepState

__all__ = ["Admission", "AdmitResult", "Admitted", "Deferred"]


@dataclass(frozen=True)
class Admitted:
    """The request is admitted and computes ``length`` tokens in this step."""

    length: int


class Deferred(enum.Enum):
    """Why a request was not admitted in this step."""

    #: No room (blocks, host-tier loads, or a whole prompt over the budget): it and
    #: every request after it wait (the step's admission stops).
    WAIT = "wait"
    #: Its next prompt blocks are being computed in this step by another sequence:
    #: it waits a step for them, and later requests may still be admitted.
    HELD = "held"
    #: It can never fit: it was ended with reason ``"length"``.
    ENDED = "ended"


AdmitResult = Admitted | Deferred


class Admission:
    """Admits waiting requests into the step being scheduled."""

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
        # Host-tier loads are counted and bounded (max_load_blocks_per_step).
        self.tiered = getattr(manager, "host_cache_blocks", 0) > 0
        self.prefix_hold = PrefixHold()
        self.prefix_caching = bool(manager.enable_prefix_caching)

    def admit(self, state: RequestState, step: StepState, *, may_hold: bool) -> AdmitResult:
        """Try to admit ``state`` with up to ``step.budget`` tokens.

        ``may_hold``: something else is scheduled in this step, so the request may be
        held back for a prefix computed now (never into an empty step).
        """
        mgr = self.manager
        seq = state.seq_ids[0]
        if state.registered_step != step.step:
            self.placement.register(state, step.step)  # claim against the cache as it is now
        if not self._fit_loads(seq, step):
            return Deferred.WAIT
        cached = int(mgr.num_computed_tokens(seq))
        length = len(state.tokens) - cached
        if length > step.budget:
            # Without chunked prefill a prompt is computed whole or waits (add_request
            # rejects prompts over the budget); but a recomputed sequence (prompt +
            # generated tokens) may exceed the budget and could never be computed
            # whole, so it is chunked like a long prompt with chunked prefill on.
            whole = length <= self.config.max_num_batched_tokens
            if not self.config.enable_chunked_prefill and whole:
                return Deferred.WAIT
            length = step.budget
        # The step's real need in every group (a window group holds only its window and
        # the chunk), with the watermark kept free.
        length, status = largest_step(mgr, seq, length)
        if status == AllocStatus.NEVER:
            self.records.end_early(state, FinishReason.LENGTH, step)
            return Deferred.ENDED
        if status != AllocStatus.OK:
            return Deferred.WAIT
        if may_hold and self._wait_for_prefix(state, seq, cached):
            return Deferred.HELD
        # Every group's loads (a window group loads only the hit's blocks it sees).
        loads = int(mgr.num_tier_loads(seq)) if self.tiered else 0
        if mgr.allocate_slots(seq, length) is None:
            return Deferred.WAIT
        if self.tiered:
            step.num_loads += loads
            self.counters.num_load_blocks += loads
            if state.admitted:  # a recompute readmission loading its own blocks back
                self.counters.num_readmitted_load_blocks += loads
        self._start_prefill(state, step)
        return Admitted(length)

    def _start_prefill(self, state: RequestState, step: StepState) -> None:
        placement = self.placement
        state.num_computed = int(self.manager.num_computed_tokens(state.seq_ids[0]))
        placement.waiting.remove(state)
        self.prefix_hold.release(state)
        state.status = RequestStatus.PREFILL
        insort(placement.prefilling, state)
        counters = self.counters
        if state.admitted:
            # A recompute readmission mostly finds its own blocks cached: counted apart,
            # so the prefix hit rate reflects what prompts share.
            counters.num_readmitted_tokens += len(state.tokens)
            counters.num_readmitted_cached_tokens += state.num_computed
        else:
            state.admitted = True
            state.num_cached_tokens = state.num_computed
            state.metrics.first_scheduled_time = step.now
            state.metrics.num_cached_tokens = state.num_computed
            counters.num_prompt_tokens_admitted += len(state.tokens)
            counters.num_cached_tokens_admitted += state.num_computed

    def _fit_loads(self, seq: int, step: StepState) -> bool:
        """Keep the waiting sequence's host-tier loads within what the step has left of
        ``max_load_blocks_per_step``; ``False`` if it must wait for a later step.

        Loads over what is left wait, unless the step has queued none yet: then the
        request's loads exceed the whole bound, and it is admitted with only the prefix
        whose loads fit (the rest computed), so it never waits forever.
        """
        bound = self.config.max_load_blocks_per_step
        if bound is None or not self.tiered:
            return True
        mgr = self.manager
        loads = int(mgr.num_tier_loads(seq))
        left = bound - step.num_loads
        if loads <= left:
            return True
        if step.num_loads > 0:
            self.counters.num_loads_deferred += loads
            return False
        mgr.limit_tier_loads(seq, left)
        self.counters.num_loads_recomputed += loads - left
        return True

    def _wait_for_prefix(self, state: RequestState, seq: int, cached: int) -> bool:
        """Whether the prompt blocks right past ``state``'s cached prefix are being
        computed in this step by another sequence, so that it should wait a step for them
        (see :class:`PrefixHold` for the bounds)."""
        if not self.prefix_caching:
            return False
        bs = self.manager.block_size
        # The hit never covers the last token: no further whole block can be shared.
        if (len(state.tokens) - 1) // bs <= cached // bs:
            return False
        ahead = int(self.manager.probe_in_flight([seq])[0])
        return self.prefix_hold.should_hold(state, cached, ahead)
