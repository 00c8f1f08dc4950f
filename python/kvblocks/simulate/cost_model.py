"""A linear cost model of one forward pass, standing in for the GPU in simulations."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.scheduler.output import SchedulerOutput

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """``step_time = fixed + per_token * tokens + per_context_token * context``.

    The defaults are illustrative for a 7B fp16 model on one A100-class GPU: reading the
    weights once per step (~7 ms), ~14k prefill tokens/s of compute, and reading ~0.5 MB
    of KV per context token at ~2 TB/s. Only ratios between runs are meaningful.

    Attributes:
        fixed_s: seconds per step regardless of the batch.
        per_token_s: seconds per token computed in the step.
        per_context_token_s: seconds per token of attended context (sum of ``seq_lens``).
    """

    fixed_s: float = 7e-3
    per_token_s: float = 7e-5
    per_context_token_s: float = 2.5e-7

    def step_time(self, output: SchedulerOutput) -> float:
        """Simulated seconds to run ``output``'s forward pass (0 for an empty step)."""
        if output.is_empty:
            return 0.0
        context = int(output.seq_lens.sum(dtype="int64"))
        return self.time(output.num_tokens, context)

    def time(self, num_tokens: int, context_tokens: int) -> float:
        """Simulated seconds of a non-empty step computing ``num_tokens`` over
        ``context_tokens`` of attended context (used by the contiguous baseline too)."""
        return (
            self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * context_tokens
        )
