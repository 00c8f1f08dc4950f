"""What :meth:`kvblocks.engine.LLM.generate` returns (one record per prompt) and what
:meth:`~kvblocks.engine.LLM.stream` yields (one record per request and step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvblocks.scheduler.request import FinishReason, RequestMetrics

__all__ = ["Completion", "GenerationOutput", "TokenLogprobs"]


@dataclass
class TokenLogprobs:
    """Log-probs at one generated position (log-softmax of the model's raw logits).

    Attributes:
        token_id: the generated token.
        logprob: its log-prob.
        top_token_ids: the ``SamplingParams.logprobs`` most likely tokens, best first.
        top_logprobs: their log-probs.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Completion:
    """One generated sequence.

    Attributes:
        index: 0..n-1; with beam search the beam's rank (0 = best).
        token_ids: generated token ids (prompt excluded; a final stop/EOS token included).
        text: ``token_ids`` decoded, or ``None`` without a tokenizer.
        cumulative_logprob: sum of the model's log-probs of the generated tokens.
        finish_reason: ``"length"``, ``"stop"``, ``"eos"`` or ``"abort"``; ``None`` while
            it runs (streaming).
        new_token_ids: tokens added in this streamed step (in ``generate``'s result: all
            of them).
        new_text: text added in this streamed step (``None`` without a tokenizer).
        stop_reason: the stop string matched, or the stop token id that ended it, else
            ``None``.
        logprobs: one :class:`TokenLogprobs` per token of ``token_ids`` when
            ``SamplingParams.logprobs`` is set, else ``None``.
    """

    index: int
    token_ids: list[int]
    text: str | None
    cumulative_logprob: float
    finish_reason: FinishReason | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        """The sequence has stopped."""
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """The result for one prompt.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text, or ``None`` for a token-id prompt.
        prompt_token_ids: the prompt as token ids.
        outputs: ``n`` completions ordered by index.
        num_cached_tokens: prompt tokens served from the prefix cache instead of computed.
        finished: every completion has finished (always in ``generate``'s result).
        metrics: the request's timings (:class:`~kvblocks.scheduler.RequestMetrics`, on
            ``time.monotonic``).
        prompt_index: position of the prompt in the call's prompt list.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_index: int = 0

    @property
    def token_ids(self) -> list[int]:
        """The first completion's tokens (the only one when ``n == 1``)."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        """The first completion's text."""
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        """The first completion's finish reason."""
        return self.outputs[0].finish_reason
