"""What :class:`kvblocks.engine.LLM` keeps per request while it streams (:class:`RequestRun`).

The scheduler reports token deltas; this turns them into text (incremental
detokenisation), matches stop strings across token boundaries, gathers per-token
log-probs and builds the :class:`GenerationOutput` records the stream yields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblocks.engine.outputs import Completion, GenerationOutput, TokenLogprobs
from kvblocks.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import FinishReason, Request, RequestMetrics, RequestOutput

__all__ = ["RequestRun", "StepLogprobs"]

StepLogprobs = dict[tuple[str, int], tuple[float, np.ndarray, np.ndarray]]
"""Per (request id, completion index): the drawn token's log-prob, top-N ids, top-N log-probs."""


@dataclass
class _CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (cut at a matched stop string)
    sent: int = 0  # characters of ``text`` already yielded
    searched: int = 0  # characters of ``text`` no new stop-string match may end within
    step_tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    changed: bool = False


class RequestRun:
    """One request of an ``LLM`` call: its parameters and its completions so far.

    Args:
        request: the scheduler request (its parameters as the scheduler runs them).
        params: the caller's parameters (stop strings, logprobs).
        prompt: the prompt text, ``None`` for token ids.
        prompt_index: the prompt's position in the call.
    """

    def __init__(
        self, request: Request, params: SamplingParams, prompt: str | None, prompt_index: int
    ) -> None:
        self.request = request
        self.params = params
        self.prompt = prompt
        self.prompt_index = prompt_index
        self.finished = False
        self.completions: dict[int, _CompletionState] = {}
        self.metrics: RequestMetrics | None = None
        self._prompt_ids: list[int] = np.asarray(request.prompt_token_ids).tolist()
        self.num_cached_tokens = 0
        # While a stop string may still match, its first len - 1 characters are held back
        # so that no streamed text ever has to be taken back.
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._stopped: list[int] = []

    def _completion(self, index: int, tokenizer: Tokenizer | None) -> _CompletionState:
        comp = self.completions.get(index)
        if comp is None:
            detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
            comp = self.completions[index] = _CompletionState(index, detok)
        return comp

    def absorb(
        self,
        record: RequestOutput,
        logprobs: StepLogprobs,
        tokenizer: Tokenizer | None,
        *,
        new_step: bool = True,
    ) -> bool:
        """Apply one scheduler record; True if a completion moved or finished."""
        if new_step:
            for comp in self.completions.values():
                comp.step_tokens = []
                comp.changed = False
        if record.metrics is not None:
            self.metrics = record.metrics
        self.num_cached_tokens = record.num_cached_tokens
        changed = False
        for c in record.outputs:
            comp = self._completion(c.index, tokenizer)
            if comp.finish_reason is not None:
                continue  # ended here (a stop string) while the scheduler ran it on
            new = c.new_token_ids
            if c.finish_reason is not None and len(c.token_ids) > len(comp.tokens):
                # A final record carries every token: an abort called before this step's
                # record of the request was yielded still has the step's token (its
                # cumulative log-prob counts it), which that skipped record alone had.
                new = c.token_ids[len(comp.tokens) :]
            if new:
                self._add_tokens(comp, new, logprobs)
                comp.cum_logprob = float(c.cumulative_logprob)
                comp.changed = True
                if self.params.stop:
                    self._match_stop(comp)
            if comp.finish_reason is None and c.finish_reason is not None:
                comp.finish_reason = c.finish_reason
                comp.cum_logprob = float(c.cumulative_logprob)
                if c.finish_reason == FinishReason.STOP and comp.tokens:
                    comp.stop_reason = comp.tokens[-1]
                if tokenizer is not None:
                    # The final text is the whole sequence decoded, as without streaming.
                    comp.text = tokenizer.decode(comp.tokens)
                comp.changed = True
            changed |= comp.changed
        return changed

    def _add_tokens(
        self, comp: _CompletionState, tokens: list[int], logprobs: StepLogprobs
    ) -> None:
        comp.tokens.extend(tokens)
        comp.step_tokens.extend(tokens)
        num = self.params.logprobs
        if num is not None:
            entry = logprobs.get((self.request.request_id, comp.index))
            for tok in tokens:
                if entry is None or len(tokens) != 1:
                    comp.logprobs.append(TokenLogprobs(tok, float("nan"), [], []))
                    continue
                lp, top_ids, top_lps = entry
                comp.logprobs.append(
                    TokenLogprobs(tok, lp, top_ids[:num].tolist(), top_lps[:num].tolist())
                )
        if comp.detokenizer is not None:
            comp.text += comp.detokenizer.step(tokens)

    def _match_stop(self, comp: _CompletionState) -> None:
        # Only a match that ends in the text added since the last search counts (vLLM's
        # window): text added below min_tokens is searched never, so a stop string that a
        # token before min_tokens completed cannot end the sequence later (cut where the
        # text was already yielded) while it still sits in the held-back tail.
        searched, comp.searched = comp.searched, len(comp.text)
        if len(comp.tokens) < self.params.min_tokens:
            return
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = comp.text.find(stop, max(0, searched - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return
        at, stop = best
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        comp.text = comp.text[: max(end, comp.sent)]
        comp.finish_reason = FinishReason.STOP
        comp.stop_reason = stop
        self._stopped.append(comp.index)

    def take_stopped(self) -> list[int]:
        """Completions that matched a stop string since the last call."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def stopped_all(self) -> bool:
        """Every completion of the request has ended here (stop strings)."""
        n = self.params.n
        return len(self.completions) >= n and all(
            c.finish_reason is not None for c in self.completions.values()
        )

    def output(self) -> GenerationOutput:
        """The stream's record for the request now (advances what was yielded)."""
        completions = []
        for index in sorted(self.completions):
            comp = self.completions[index]
            hold = self._hold if comp.finish_reason is None else 0
            upto = max(comp.sent, len(comp.text) - hold)
            new_text = comp.text[comp.sent : upto]
            comp.sent = upto
            has_text = comp.detokenizer is not None
            completions.append(
                Completion(
                    index=index,
                    token_ids=list(comp.tokens),
                    text=comp.text[:upto] if has_text else None,
                    cumulative_logprob=comp.cum_logprob,
                    finish_reason=comp.finish_reason,
                    new_token_ids=list(comp.step_tokens),
                    new_text=new_text if has_text else None,
                    stop_reason=comp.stop_reason,
                    logprobs=list(comp.logprobs) if self.params.logprobs is not None else None,
                )
            )
        return GenerationOutput(
            request_id=self.request.request_id,
            prompt=self.prompt,
            prompt_token_ids=self._prompt_ids,  # shared by the request's records
            outputs=completions,
            num_cached_tokens=int(self.num_cached_tokens),
            finished=self.finished,
            metrics=self.metrics,
            prompt_index=self.prompt_index,
        )
