"""What :meth:`kvblocks.engine.LLM.generate` returns: one record per prompt."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.scheduler.request import FinishReason

__all__ = ["Completion", "GenerationOutput"]


@dataclass
class Completion:
    """One generated sequence.

    Attributes:
        index: 0..n-1; with beam search the beam's rank (0 = best).
        token_ids: generated token ids (prompt excluded; a final stop/EOS token included).
        text: ``token_ids`` decoded, or ``None`` without a tokenizer.
        cumulative_logprob: sum of the model's log-probs of the generated tokens.
        finish_reason: ``"length"``, ``"stop"``, ``"eos"`` or ``"abort"``.
    """

    index: int
    token_ids: list[int]
    text: str | None
    cumulative_logprob: float
    finish_reason: FinishReason | None


@dataclass
class GenerationOutput:
    """The result for one prompt.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text, or ``None`` for a token-id prompt.
        prompt_token_ids: the prompt as token ids.
        outputs: ``n`` completions ordered by index.
        num_cached_tokens: prompt tokens served from the prefix cache instead of computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int

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
