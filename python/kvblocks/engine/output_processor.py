"""The output side of ``LLM``: the running call's requests and the records the stream yields.

Turns each scheduler record into the stream's :class:`GenerationOutput` (through each
request's :class:`~kvblocks.engine.stream_state.RequestRun`: text deltas, stop strings,
log-probs), ends a completion or a request on a stop string (the scheduler releases its
blocks), and keeps the records of aborted requests until the stream yields them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvblocks.engine.outputs import GenerationOutput
from kvblocks.engine.stream_state import RequestRun, StepLogprobs
from kvblocks.engine.tokenizer import Tokenizer
from kvblocks.scheduler import (
    CompletionOutput,
    FinishReason,
    ModelStepResult,
    Request,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
)

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """The requests of the running ``generate``/``stream`` call and their records.

    Args:
        tokenizer: detokenises text completions (None: token ids only).
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.runs: dict[str, RequestRun] = {}
        self._aborted: list[GenerationOutput] = []  # abort records not yielded yet
        # The log-probs of the step whose records are being yielded: an abort among them
        # may carry that step's token of a request whose record was not yielded yet.
        self._step_logprobs: StepLogprobs = {}

    # -- the call --------------------------------------------------------------------------
    def begin(self, runs: list[RequestRun]) -> None:
        """Track a new call's requests."""
        self.runs = {run.request.request_id: run for run in runs}
        self._aborted = []
        self._step_logprobs = {}

    def end(self) -> None:
        """Forget the call (its records were yielded or dropped)."""
        self.runs = {}
        self._aborted = []
        self._step_logprobs = {}

    def active(self, request_id: str) -> RequestRun | None:
        """The call's request ``request_id`` while it is unfinished, else None."""
        run = self.runs.get(request_id)
        return None if run is None or run.finished else run

    def unfinished_ids(self) -> list[str]:
        """Ids of the call's requests that have not finished."""
        return [rid for rid, run in self.runs.items() if not run.finished]

    def begin_step(self, logprobs: StepLogprobs) -> None:
        """The records of a step with these log-probs are about to be yielded (an abort
        among them may carry that step's token of a request not yielded yet)."""
        self._step_logprobs = logprobs

    # -- aborts ----------------------------------------------------------------------------
    def add_aborted(self, record: RequestOutput, scheduler: Scheduler) -> GenerationOutput:
        """Turn an abort's scheduler record into the stream's record, to yield next; it is
        also the abort's answer (the request's record as it stands, should the abort have
        changed nothing to yield)."""
        run = self.runs[record.request_id]
        output = next(self.emit(record, self._step_logprobs, scheduler), None)
        if output is None:
            return run.output()
        self._aborted.append(output)
        return output

    def take_aborted(self) -> list[GenerationOutput]:
        """The abort records not yielded yet."""
        records, self._aborted = self._aborted, []
        return records

    @staticmethod
    def unscheduled_abort(run: RequestRun) -> RequestOutput:
        """The abort record of a request that never reached the scheduler (held for its
        prefetch): every completion it would have had, empty."""
        params = run.request.sampling_params
        outputs = [CompletionOutput(i, [], 0.0, FinishReason.ABORT) for i in range(params.n)]
        prompt = np.asarray(run.request.prompt_token_ids).tolist()
        return RequestOutput(run.request.request_id, prompt, outputs, 0, True)

    # -- per step --------------------------------------------------------------------------
    def num_logprobs(self) -> int:
        """Top-N the sampler must keep this step: the most any unfinished request asks
        (``logprobs=0`` still wants the drawn token's log-prob: at least 1)."""
        return max(
            (
                max(run.params.logprobs, 1)
                for run in self.runs.values()
                if not run.finished and run.params.logprobs is not None
            ),
            default=0,
        )

    def step_logprobs(
        self,
        out: SchedulerOutput,
        result: ModelStepResult,
        top: tuple[np.ndarray, np.ndarray] | None,
    ) -> StepLogprobs:
        """The drawn tokens' log-probs and top-N (``top``, the sampler's), for the
        requests that asked for them."""
        if top is None or result.sampled_logprobs is None:
            return {}
        counts = np.asarray(out.sample_counts, dtype=np.int64)
        row_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        draw_no = np.arange(row_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
        seq_index = out.sample_seq_index
        base = np.zeros(len(counts), np.int64) if seq_index is None else np.asarray(seq_index)
        index = (base[row_of] + draw_no).tolist()
        drawn = np.asarray(result.sampled_logprobs, dtype=np.float64).tolist()
        wanted = {rid for rid, run in self.runs.items() if run.params.logprobs is not None}
        request_ids = out.sample_request_ids
        found: StepLogprobs = {}
        for j, row in enumerate(row_of.tolist()):  # opt-in: only when logprobs are asked
            rid = request_ids[row]
            if rid in wanted:
                found[rid, index[j]] = (drawn[j], top[0][j], top[1][j])
        return found

    def emit(
        self, record: RequestOutput, logprobs: StepLogprobs, scheduler: Scheduler
    ) -> Iterator[GenerationOutput]:
        """Turn one scheduler record into the stream's record (if anything changed); a
        completion that matched a stop string is ended in ``scheduler``."""
        run = self.runs.get(record.request_id)
        if run is None or run.finished:
            return
        changed = run.absorb(record, logprobs, self.tokenizer)
        for index in run.take_stopped():
            # One sample of several matched a stop string: free it now if the
            # scheduler can (else its further tokens are ignored).
            scheduler.finish_sequence(record.request_id, index, FinishReason.STOP)
        if run.stopped_all() and not record.finished:
            # Every completion matched a stop string: the scheduler can let it go.
            aborted = scheduler.abort_request(record.request_id, FinishReason.STOP)
            if aborted is not None:
                run.absorb(aborted, {}, self.tokenizer, new_step=False)
            run.finished = True
            changed = True
        if record.finished:
            run.finished = True
        if changed:
            yield run.output()

    def waiting_sequences(
        self, running: set[str]
    ) -> Iterator[tuple[tuple[str, int], Request, list[int]]]:
        """The unfinished completions with generated tokens of requests not running now
        (preempted by recompute, waiting for re-admission): (request id, index), the
        request, the completion's generated tokens.

        Requests that have generated nothing yet are left out: a prompt never admitted
        was read at arrival already, and one preempted mid-prefill is rare.
        """
        for rid, run in self.runs.items():
            if run.finished or rid in running:
                continue
            for c in run.completions.values():
                if c.finish_reason is None and c.tokens:
                    yield (rid, c.index), run.request, c.tokens
