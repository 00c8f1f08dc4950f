"""Beam-search bookkeeping: candidate selection and final ranking.

The scheduler keeps ``beam_width`` live beams per request as forked sequences. After
each step it hands every live beam's top-``2 * beam_width`` log-probs to
:func:`select_beams`, which returns the next live beams (parent, token) and the
hypotheses that ended on a stop/EOS token. The scheduler then forks parents that get
several children, frees parents that get none, and appends each beam's token; the block
manager's copy-on-write keeps the shared prefix in one copy. The search ends when
``beam_width`` hypotheses have finished (early stopping) or the beams reach
``max_tokens``; :func:`rank_hypotheses` orders the finished ones by length-penalised
score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvblocks.scheduler.request import FinishReason

__all__ = ["BeamChoice", "Hypothesis", "beam_score", "rank_hypotheses", "select_beams"]


@dataclass
class BeamChoice:
    """A next live beam: extend live beam ``parent`` with ``token``."""

    parent: int
    token: int
    cum_logprob: float


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and why it ended."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: FinishReason


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty`` (higher is better), as the float the
    quotient rounds to when the power leaves the float range (an extreme penalty)."""
    try:
        return cum_logprob / math.pow(max(length, 1), length_penalty)
    except OverflowError:  # a power above 1.8e308: the quotient is below every float
        return 0.0
    except ZeroDivisionError:  # a power that underflowed to 0: the quotient is infinite
        return 0.0 if cum_logprob == 0 else math.copysign(math.inf, cum_logprob)


def select_beams(
    cum_logprobs: npt.NDArray[np.float64],
    topk_token_ids: npt.NDArray[np.int64],
    topk_logprobs: npt.NDArray[np.float32],
    beam_width: int,
    stop_token_ids: frozenset[int],
) -> tuple[list[BeamChoice], list[tuple[int, int, float, FinishReason]]]:
    """Choose the next beams from the candidates of the live ones.

    Args:
        cum_logprobs: [L] cumulative log-prob of each live beam.
        topk_token_ids: [L, K] candidate tokens of each beam, best first.
        topk_logprobs: [L, K] their log-probs.
        beam_width: beams to keep.
        stop_token_ids: tokens that end a hypothesis (EOS included by the caller).

    Returns:
        ``(choices, ended)``: up to ``beam_width`` next live beams, best first, and the
        candidates ranked above the last kept beam that end on a stop token, as
        ``(parent, token, cum_logprob, reason)`` with reason ``STOP``.
    """
    scores = cum_logprobs[:, None] + topk_logprobs.astype(np.float64)
    flat = np.argsort(-scores, axis=None, kind="stable")
    width = scores.shape[1]
    choices: list[BeamChoice] = []
    ended: list[tuple[int, int, float, FinishReason]] = []
    for index in flat[: 2 * beam_width * max(1, width)].tolist():
        parent, column = divmod(index, width)
        token = int(topk_token_ids[parent, column])
        score = float(scores[parent, column])
        if token in stop_token_ids:
            ended.append((parent, token, score, FinishReason.STOP))
        else:
            choices.append(BeamChoice(parent, token, score))
            if len(choices) == beam_width:
                break
    return choices, ended


def rank_hypotheses(hypotheses: list[Hypothesis], length_penalty: float) -> list[Hypothesis]:
    """Hypotheses best first by length-penalised score."""
    return sorted(
        hypotheses,
        key=lambda h: beam_score(h.cum_logprob, len(h.token_ids), length_penalty),
        reverse=True,
    )
