"""Final records of requests (:class:`Records`): a sequence that stops, a part of a split
request that ends, a request that finishes, is ended for lack of room, or is aborted.

Every ending goes through here so that a request's :class:`RequestOutput`, its metrics
and the latency statistics are made in one way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvblocks.protocols import BlockManager
from kvblocks.scheduler.beam import Hypothesis, rank_hypotheses
from kvblocks.scheduler.placement import Placement
from kvblocks.scheduler.request import CompletionOutput, FinishReason, RequestOutput
from kvblocks.scheduler.request_state import RequestState, RequestStatus
from kvblocks.scheduler.stats import LatencyStats, SchedulerCounters
from kvblocks.scheduler.step import StepState, UpdateState

__all__ = ["Records"]


class Records:
    """Makes the final records of requests and releases what they held.

    Args:
        manager: the block manager (token ids of sequences).
        placement: the queues (a finished request is dropped from them).
        counters: the scheduler's counters.
        latency: the latency statistics of finished requests.
    """

    def __init__(
        self,
        manager: BlockManager,
        placement: Placement,
        counters: SchedulerCounters,
        latency: LatencyStats,
    ) -> None:
        self.manager = manager
        self.placement = placement
        self.counters = counters
        self.latency = latency

    def abort(self, state: RequestState, reason: FinishReason, now: float) -> RequestOutput:
        """End ``state`` on the caller's word (``abort_request``): its record as it
        stands. The caller releases it (now, or at the in-flight step's ``update``)."""
        output = self.abort_output(state, reason)
        state.metrics.finished_time = now
        state.aborted = True
        for part in state.parts:
            part.aborted = True
        if reason == FinishReason.ABORT:
            self.counters.num_requests_aborted += 1
            state.metrics.num_generated_tokens = max(
                (len(c.token_ids) for c in output.outputs), default=0
            )
        else:
            self.counters.num_requests_finished += 1
            self.record_finish(state, output)
        return output

    def end_sequence(
        self, state: RequestState, index: int, reason: FinishReason, step: int
    ) -> CompletionOutput | None:
        """End the decoding sequence of completion ``index`` of a running ``n > 1``
        request whose other sequences go on (``finish_sequence``); ``None`` if it has
        no such live sequence (swapped, split, beam search, its last sequence)."""
        if (
            state.aborted
            or state.status is not RequestStatus.RUNNING
            or state.params.use_beam_search
            or len(state.seq_ids) < 2
        ):
            return None
        seqs = [seq for seq in state.seq_ids if state.seq_index.get(seq) == index]
        if not seqs:
            return None
        seq = seqs[0]
        table = self.placement.table
        rows = table.rows_of(np.array([seq], dtype=np.int64))
        cum = float(table["cum_logprob"][rows[0]])
        tokens = self.manager.token_ids(seq)[state.num_prompt :].tolist()
        completion = CompletionOutput(index, tokens, cum, reason)
        state.outputs[index] = completion
        state.output_step[index] = step
        table.update(rows, [])
        self.placement.release_seq(state, seq)
        return completion

    def finish_seq(
        self, state: RequestState, seq: int, reason: FinishReason, cum: float, upd: UpdateState
    ) -> RequestOutput | None:
        """One sequence stopped; returns the request's output if it was the last one."""
        tokens = self.manager.token_ids(seq)[state.num_prompt :].tolist()
        index = state.seq_index[seq]
        # Called only for a sequence that just sampled its last token.
        completion = CompletionOutput(index, tokens, cum, reason, tokens[-1:])
        state.outputs[index] = completion
        state.output_step[index] = upd.step
        upd.events.setdefault(state.request.request_id, {})[index] = completion
        self.placement.release_seq(state, seq)
        if state.seq_ids:
            return None
        if state.parent is not None:
            return self.finish_part(state, state.outputs, upd.now, upd.step)
        return self.finish_request(state, upd.now, upd.step)

    def finish_part(
        self, part: RequestState, outputs: dict[int, CompletionOutput], now: float, step: int
    ) -> RequestOutput | None:
        """A part's sequence ended with ``outputs``; returns the request's output if it
        was the last part."""
        parent = part.parent
        assert parent is not None
        parent.outputs.update(outputs)
        parent.output_step.update(part.output_step)
        parent.parts.remove(part)
        self.placement.drop(part)
        if parent.parts:
            return None
        self.placement.num_split -= 1
        return self.finish_request(parent, now, step)

    def end_early(self, state: RequestState, reason: FinishReason, step: StepState) -> None:
        """End a request (or part) that cannot fit with what it has; its output (the
        request's, once its last part ended) is returned by the step's ``update``."""
        output = self.abort_output(state, reason)
        if state.parent is not None:
            done = self.finish_part(
                state, {c.index: c for c in output.outputs}, step.now, step.step
            )
            if done is not None:
                step.ended.append(done)
            return
        state.metrics.finished_time = step.now
        self.record_finish(state, output)
        self.placement.drop(state)
        self.counters.num_requests_finished += 1
        step.ended.append(output)

    def finish_request(self, state: RequestState, now: float, step: int) -> RequestOutput:
        """Every sequence of ``state`` ended (their blocks are released): its final record.

        Sequences that finished in earlier steps sent their last tokens then, so only
        those of ``step`` keep their ``new_token_ids``.
        """
        params = state.params
        if params.use_beam_search:
            outputs = _best_beams(state.hypotheses, params.length_penalty, params.n)
        else:
            outputs = [
                c if state.output_step.get(i) == step else dataclasses.replace(c, new_token_ids=[])
                for i, c in sorted(state.outputs.items())
            ]
        state.status = RequestStatus.FINISHED
        self.placement.registry.forget(state)
        self.counters.num_requests_finished += 1
        output = RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.prompt_list,
            outputs=outputs,
            num_cached_tokens=state.num_cached_tokens,
            finished=True,
        )
        state.metrics.finished_time = now
        self.record_finish(state, output)
        return output

    def record_finish(self, state: RequestState, output: RequestOutput) -> None:
        """Complete the request's metrics, attach them and add them to the statistics."""
        metrics = state.metrics
        metrics.num_generated_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        output.metrics = metrics
        self.latency.add(metrics)

    def abort_output(
        self, state: RequestState, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput:
        """The request's output as it stands, every unfinished sequence ending with ``reason``."""
        # Sequences that finished in earlier steps sent their last tokens then.
        outputs = {
            i: dataclasses.replace(c, new_token_ids=[]) if c.new_token_ids else c
            for i, c in state.outputs.items()
        }
        for part in state.parts:
            outputs.update({c.index: c for c in self.abort_output(part, reason).outputs})
        cums: dict[int, float] = {}
        if state.status is RequestStatus.RUNNING:
            # A sequence can be running without a row when a step's update failed between
            # the two (the engine then aborts what was in flight): it keeps the request's
            # own cumulative log-prob, and the row -1 is never read.
            table = self.placement.table
            seqs = np.array(state.seq_ids, dtype=np.int64)
            rows = table.rows_of(seqs)
            present = rows >= 0
            cums = dict(
                zip(
                    seqs[present].tolist(),
                    table["cum_logprob"][rows[present]].tolist(),
                    strict=True,
                )
            )
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
                tokens = self.manager.token_ids(seq)[state.num_prompt :].tolist()
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
            ordered = _best_beams(
                hyps + state.hypotheses, state.params.length_penalty, state.params.n
            )
            # A beam search that has not forked yet has one beam: the others are empty,
            # as an unforked n > 1 request's samples are.
            ordered += [
                CompletionOutput(i, [], 0.0, reason) for i in range(len(ordered), state.params.n)
            ]
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.prompt_list,
            outputs=ordered,
            num_cached_tokens=state.num_cached_tokens,
            finished=True,
            metrics=state.metrics,
        )


def _best_beams(hyps: list[Hypothesis], length_penalty: float, n: int) -> list[CompletionOutput]:
    """The ``n`` best hypotheses as completions; beams were never streamed, so each
    record carries its tokens whole."""
    best = rank_hypotheses(hyps, length_penalty)[:n]
    return [
        CompletionOutput(i, h.token_ids, h.cum_logprob, h.finish_reason, list(h.token_ids))
        for i, h in enumerate(best)
    ]
