"""The engine core: one step at a time, schedule -> execute -> update, and what a step moves.

:class:`EngineCore` owns the scheduler, the model runner and (with a remote tier) the
admission through it. A step first hands the requests whose prefetch came back to the
scheduler and reads again the preempted sequences that lost blocks, then schedules,
executes (the runner applies the step's memory ops before the forward pass), writes the
step's offloaded blocks to the remote store, and applies the results. Between two calls
the core leaves no step in flight and no host-tier op unapplied (:meth:`EngineCore.end_call`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvblocks._core import KVCacheManager
from kvblocks.engine.output_processor import OutputProcessor
from kvblocks.engine.runner import ModelRunner
from kvblocks.engine.stream_state import StepLogprobs
from kvblocks.errors import OutOfBlocksError, SequenceStateError
from kvblocks.scheduler import (
    ModelStepResult,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
)
from kvblocks.scheduler.step_outputs import StepOutputs
from kvblocks.tiers.remote_admission import RemoteAdmission, tier_read
from kvblocks.tiers.remote_link import RemoteTierLink

__all__ = ["CoreStep", "EngineCore"]

logger = logging.getLogger("kvblocks.engine")

# Steps in a row that compute nothing and move nothing before a call gives up.
MAX_IDLE_STEPS = 64


@dataclass(frozen=True)
class CoreStep:
    """What one step did: the scheduler's records, the drawn tokens' log-probs (for the
    requests that asked), the tokens computed, and whether it preempted by recompute."""

    records: StepOutputs
    logprobs: StepLogprobs
    num_tokens: int
    preempted: bool


class EngineCore:
    """The step loop's state: scheduler, runner, manager and remote admission.

    Args:
        manager: the block manager the scheduler drives.
        scheduler: the continuous-batching scheduler.
        runner: executes a step on the paged cache.
        remote: the remote tier's link, or None.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        remote: RemoteTierLink | None = None,
    ) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.runner = runner
        self.admission = RemoteAdmission(remote) if remote is not None else None
        # The step between schedule() and update(): the scheduler cannot take another one,
        # and the KV memory may not hold what the manager's tables say.
        self._in_flight: SchedulerOutput | None = None
        self._idle = 0

    @property
    def remote(self) -> RemoteTierLink | None:
        """The remote tier's link, or None."""
        return self.admission.link if self.admission is not None else None

    # -- requests --------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[Request]) -> None:
        """Queue requests: straight to the scheduler, or held behind a prefetch of their
        blocks from the remote store."""
        for request in requests:
            if self.admission is None:
                self.scheduler.add_request(request)
            else:
                self.admission.hold(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request the scheduler holds; its record so far (None: not held)."""
        return self.scheduler.abort_request(request_id)

    def withdraw(self, request_id: str) -> Request | None:
        """Take back a request still held for its prefetch (it never reaches the
        scheduler); None when it is not held."""
        return self.admission.withdraw(request_id) if self.admission is not None else None

    # -- steps -----------------------------------------------------------------------------
    def step(self, outputs: OutputProcessor) -> CoreStep | None:
        """Admit what is ready, then run one step; None when nothing is left to run.

        Raises:
            OutOfBlocksError: ``MAX_IDLE_STEPS`` steps in a row computed and moved nothing
                (the cache cannot hold what the waiting requests need).
        """
        scheduler = self.scheduler
        if self.admission is not None:
            self.admission.release(scheduler)
        if not scheduler.has_unfinished_requests():
            return None
        if self.admission is not None:
            running = set(scheduler.running_request_ids())
            self.admission.refetch(
                lambda rid: outputs.active(rid) is not None and rid not in running
            )
        self.runner.sampler.num_logprobs = outputs.num_logprobs()
        recomputes = scheduler.counters.num_preemptions_recompute
        out = scheduler.schedule()
        self._in_flight = out
        result = self.runner.execute(out)
        if self.remote is not None:
            # The step's offloads are in the host pool; their slots stay pinned (keyed by
            # their hashes) until update() confirms them.
            self.remote.publish(out.memory_ops)
        records = scheduler.update(out, result)
        self._in_flight = None
        self._check_progress(out)
        return CoreStep(
            records,
            outputs.step_logprobs(out, result, self.runner.sampler.last_top_logprobs),
            out.num_tokens,
            scheduler.counters.num_preemptions_recompute > recomputes,
        )

    def _check_progress(self, out: SchedulerOutput) -> None:
        moved = sum(len(pairs) for _kind, pairs in out.memory_ops)
        self._idle = self._idle + 1 if out.num_tokens == 0 and moved == 0 else 0
        if self._idle >= MAX_IDLE_STEPS:
            raise OutOfBlocksError(
                f"the engine made no progress in {MAX_IDLE_STEPS} steps: the KV "
                f"cache ({self.manager.num_blocks} blocks, "
                f"{self.manager.num_cpu_blocks} CPU blocks) cannot hold what the "
                "waiting requests need"
            )

    def track_preempted(self, outputs: OutputProcessor) -> None:
        """Note the sequences a step preempted by recompute (waiting to be re-admitted):
        each one's prompt and generated tokens, which it recomputes, are read again
        from the remote store before its re-admission."""
        admission = self.admission
        if admission is None:
            return
        running = set(self.scheduler.running_request_ids())
        admission.track(
            (key, tier_read(request, np.concatenate([request.prompt_token_ids, tokens])))
            for key, request, tokens in outputs.waiting_sequences(running)
            if not admission.is_tracked(key)
        )

    # -- the end of a call -----------------------------------------------------------------
    def begin_call(self) -> None:
        """A new call starts: no idle steps counted yet."""
        self._idle = 0

    def end_call(self, unfinished: list[str]) -> None:
        """Leave the engine idle and consistent after a call, whatever stopped it.

        Held requests and tracked sequences are dropped; ``unfinished`` requests are
        aborted; a step left in flight is cancelled (:meth:`_cancel_step`); the host-tier
        ops the last step queued are applied (:meth:`_flush_tier_ops`); KV events queued
        since the last step (a cancelled step's, its clear) are published.
        """
        if self.admission is not None:
            self.admission.clear()
        # A call cut short is raising already (or its consumer left the stream): its
        # error is the one to see, not the publisher's.
        cut_short = bool(unfinished) or self._in_flight is not None
        for rid in unfinished:
            self.scheduler.abort_request(rid)
        self.runner.sampler.forget(unfinished)
        try:
            if self._in_flight is not None:
                self._cancel_step(self._in_flight)
            self._flush_tier_ops()
        finally:
            # A cancelled step's clear (or a failed flush's) changed the cache outside a
            # step: routers hear it now, not at the next call's first update(), which an
            # idle instance may never run while they route to blocks it dropped.
            try:
                self.scheduler.publish_events()
            except Exception:
                if not cut_short:
                    raise
                logger.exception("publishing the KV events of a call cut short failed")
        self.runner.sampler.num_logprobs = 0

    def _cancel_step(self, out: SchedulerOutput) -> None:
        """Cancel the step between ``schedule()`` and ``update()`` of a failed call.

        Its requests were aborted, which the scheduler applies at the step's ``update``:
        it is given a placeholder result (the aborted rows' tokens are dropped, and so
        are the placeholder draws from the generated-token count). The KV memory may not
        hold what the manager's tables say (a forward pass or a swap-in cut short), so
        every sequence is freed and the prefix cache dropped (its blocks may hold
        unfinished KV); the step's events and the clear are published by
        :meth:`end_call`, in one batch.
        """
        self._in_flight = None
        scheduler = self.scheduler
        publisher, scheduler.event_publisher = scheduler.event_publisher, None
        generated = scheduler.counters.num_generated_tokens
        try:
            scheduler.update(out, _placeholder_result(out))
        except SequenceStateError:
            pass  # update() had begun when the call failed: the step is not in flight
        except Exception:
            logger.exception("cancelling a failed step raised; the scheduler may be stuck")
        finally:
            scheduler.event_publisher = publisher
            scheduler.counters.num_generated_tokens = generated
        manager = self.manager
        for seq in manager.seq_ids().tolist():
            manager.free(int(seq))
        # Block moves for sequences that no longer exist, applied or not: drained and
        # discarded, so that the host-tier slots they were writing are emptied, never hits;
        # reset_prefix_cache then drops the GPU blocks the failed step may have written.
        manager.take_memory_ops()
        manager.discard_memory_ops()
        manager.reset_prefix_cache()

    def _flush_tier_ops(self) -> None:
        """Apply the host-tier ops queued since the last step, between two calls.

        The last step's ``update()`` can queue offloads (write-through commits); the next
        step would carry them, but between calls the tier should hold what it claims and
        no slot stay pinned. If applying them fails, nothing they named is trusted: the
        slots they were writing are emptied, and the prefix cache and the tier's unpinned
        slots are dropped.
        """
        manager = self.manager
        memory_ops = manager.take_memory_ops()
        if not memory_ops:
            return
        try:
            self.runner.apply_block_ops(memory_ops)
        except BaseException:
            manager.discard_memory_ops()
            manager.reset_prefix_cache()
            raise
        if self.remote is not None:
            self.remote.publish(memory_ops)
        manager.confirm_memory_ops()


def _placeholder_result(out: SchedulerOutput) -> ModelStepResult:
    """A result that matches ``out``'s shape (every draw token 0), for cancelling it."""
    draws = int(np.asarray(out.sample_counts).sum())
    rows = len(out.sample_counts)
    topk: np.ndarray | None = None
    topk_lp: np.ndarray | None = None
    if out.beam_topk:
        topk = np.zeros((rows, out.beam_topk), np.int64)
        topk_lp = np.zeros((rows, out.beam_topk), np.float32)
    return ModelStepResult(
        np.zeros(draws, np.int64),
        np.zeros(draws, np.float32),
        topk_token_ids=topk,
        topk_logprobs=topk_lp,
    )
