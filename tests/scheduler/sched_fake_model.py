"""A deterministic stand-in for the model, and helpers to drive a scheduler in tests.

The "model" derives each sampled token from the sequence's last input token and its
position, so a sequence's continuation depends only on its own content: a run under
memory pressure (recompute, swap) must produce exactly the tokens of a run without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvblocks.scheduler import ModelStepResult, RequestOutput, Scheduler, SchedulerOutput

VOCAB = 97


def next_tokens(last: np.ndarray, positions: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """Token drawn after ``last`` at ``positions`` for sample index ``sample``."""
    return (last * 31 + positions * 7 + sample * 13 + 5) % VOCAB


def fake_step(output: SchedulerOutput) -> ModelStepResult:
    """Deterministic results for ``output`` (top-K too when it has beam rows)."""
    last = output.input_token_ids[output.logits_indices]
    pos = output.positions[output.logits_indices]
    counts = output.sample_counts
    rows = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens = next_tokens(last[rows], pos[rows], within).astype(np.int64)
    logprobs = -((tokens % 5) + 1).astype(np.float32) / 10
    topk_ids = topk_lps = None
    if output.beam_topk:
        k = output.beam_topk
        j = np.arange(k)[None, :]
        topk_ids = ((last[:, None] * 31 + pos[:, None] * 7 + j * 11 + 5) % VOCAB).astype(np.int64)
        topk_lps = (-(j + 1) * 0.25 - (last[:, None] % 3) * 0.05).astype(np.float32)
    return ModelStepResult(tokens, logprobs, topk_ids, topk_lps)


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 10_000, check: Any = None
) -> tuple[dict[str, RequestOutput], list[SchedulerOutput]]:
    """Step until every request finished; return outputs by id and every step's batch."""
    outputs: dict[str, RequestOutput] = {}
    steps: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps.append(out)
        for done in scheduler.update(out, fake_step(out)).finished:
            outputs[done.request_id] = done
        if check is not None:
            check()
        assert len(steps) < max_steps, "scheduler made no progress"
    return outputs, steps


def tokens_of(outputs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    """Generated token ids per request and sequence index."""
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}
