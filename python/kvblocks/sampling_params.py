"""Per-request generation parameters (:class:`SamplingParams`).

One frozen record per request, validated on construction so that the scheduler and
the engine can trust every field. The scheduler reads the stop conditions and the
number of sequences; the engine's sampler reads the sampling fields, which the
scheduler forwards per sampling row in :class:`kvblocks.scheduler.SchedulerOutput`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import (
    INT32_MAX,
    RETENTION_PRIORITY_MAX,
    check_bool,
    check_int,
    check_number,
)

__all__ = ["SamplingParams", "as_token_ids"]

_MAX_TOKEN_ID = 2**32


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the completion(s) of one request.

    Attributes:
        max_tokens: most tokens generated per sequence (``1 <= max_tokens < 2**63``).
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: nucleus sampling mass in ``(0, 1]``; ``1`` disables it.
        top_k: keep the ``k`` most likely tokens; ``0`` disables it (at most
            ``2**31 - 1``).
        seed: seed of the request's own random generator (reproducible sampling), in
            ``[0, 2**63)``; ``None`` uses the engine's global generator.
        n: completions returned. With sampling, ``n`` sequences are sampled from the
            prompt (parallel sampling through fork + copy-on-write). With beam search,
            the ``n`` best of the ``beam_width`` final beams are returned (``n <=
            beam_width``).
        beam_width: ``> 1`` turns on beam search with that many beams; the sampling
            fields (temperature, top_p, top_k, seed) are then ignored.
        length_penalty: beam score is ``cumulative_logprob / len ** length_penalty``.
        stop_token_ids: sampling one of these finishes the sequence (reason ``"stop"``);
            the stop token is kept in the output.
        ignore_eos: keep generating after the request's EOS token.
        min_tokens: the sequence generates at least this many tokens before EOS,
            ``stop_token_ids`` or stop strings can end it (vLLM's rule): while it has
            fewer, the scheduler bans EOS and the stop tokens in its sampling rows
            (``SchedulerOutput.suppressed_token_ids``; the engine's sampler masks them) and
            none of them finishes it. ``<= max_tokens``; not with beam search.
        stop: stop strings (``kvblocks.engine.LLM`` only; the scheduler sees tokens): the
            sequence finishes (reason ``"stop"``) as soon as its detokenised text
            contains one; the text is cut before it and the token ids end with the token
            that completed it. Not with beam search.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logprobs: ``kvblocks.engine.LLM`` also returns, for each generated token, its
            log-prob and the ``logprobs`` most likely tokens' (log-softmax of the raw
            logits); ``None`` for none. Not with beam search.
        retention_priority: how long this request's prefix blocks are kept once cached,
            0..100 (TensorRT-LLM's scale): the GPU prefix cache and the host tier evict
            lower priorities first, least recently used among equals; ``None`` keeps the
            manager's default (35). See ``KVCacheManager.set_retention_priority``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    retention_priority: int | None = None

    def __post_init__(self) -> None:
        # The step keeps top_k in an int32 column and the seed and max_tokens in int64
        # ones; a top_k of the vocabulary's size or more keeps every token anyway.
        check_int(self.max_tokens, "max_tokens", minimum=1, maximum=2**63 - 1)
        check_int(self.top_k, "top_k", minimum=0, maximum=INT32_MAX)
        check_int(self.n, "n", minimum=1)
        check_int(self.beam_width, "beam_width", minimum=1)
        if self.seed is not None:
            check_int(self.seed, "seed", minimum=0, maximum=2**63 - 1)
        temperature = check_number(self.temperature, "temperature")
        if not temperature >= 0.0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = check_number(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
        length_penalty = check_number(self.length_penalty, "length_penalty")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise InvalidArgumentError(
                f"n ({self.n}) must be <= beam_width ({self.beam_width}) with beam search"
            )
        check_bool(self.ignore_eos, "ignore_eos")
        check_int(self.min_tokens, "min_tokens", minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None:
            check_int(self.logprobs, "logprobs", minimum=0)
        if self.retention_priority is not None:
            check_int(
                self.retention_priority,
                "retention_priority",
                minimum=0,
                maximum=RETENTION_PRIORITY_MAX,
            )
        if self.beam_width > 1 and (self.min_tokens or self.logprobs is not None):
            raise InvalidArgumentError("min_tokens and logprobs are not supported with beam search")
        check_bool(self.include_stop_str_in_output, "include_stop_str_in_output")
        object.__setattr__(self, "stop", _as_stop_strings(self.stop))
        if self.beam_width > 1 and self.stop:
            # Beams rank and end on tokens; a stop string matched in a final beam's text
            # would cut the text but not its tokens or cumulative log-prob.
            raise InvalidArgumentError(
                "stop strings are not supported with beam search (use stop_token_ids)"
            )
        stop = _as_token_tuple(self.stop_token_ids)
        # Frozen dataclass: normalised values are written through object.__setattr__.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "length_penalty", length_penalty)
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def use_beam_search(self) -> bool:
        """True when ``beam_width > 1``."""
        return self.beam_width > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: ``beam_width`` with beam search, else ``n``."""
        return self.beam_width if self.beam_width > 1 else self.n

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (``temperature == 0``)."""
        return self.temperature == 0.0


def as_token_ids(values: object, what: str = "token ids") -> list[int]:
    """Validate a sequence of token ids and return it as a list of Python ints.

    Accepts Python ints and NumPy integer scalars or 1-D integer arrays. Floats (even
    integral ones), bools and strings are rejected rather than converted, as the block
    manager does: ``int(1.9)`` would silently run a different prompt.

    Raises:
        InvalidArgumentError: ``values`` is not an iterable of integers (``what`` names
            it in the message) or an array of another dtype or rank.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise InvalidArgumentError(
                f"{what} must be integers, got a {values.ndim}-D array of {values.dtype}"
            )
        return [int(v) for v in values.tolist()]
    if isinstance(values, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be integers, got {values!r}")
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be a sequence of integers, got {values!r}"
        ) from None
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"{what} must be integers, got {v!r} in {values!r}")
    return [int(v) for v in items]


def _as_token_tuple(values: Iterable[int]) -> tuple[int, ...]:
    tokens = tuple(as_token_ids(values, "stop_token_ids"))
    for token in tokens:
        if not 0 <= token < _MAX_TOKEN_ID:
            raise InvalidArgumentError(f"stop token id {token} is outside [0, 2**32)")
    return tokens


def _as_stop_strings(values: object) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)  # vLLM accepts one string
    if isinstance(values, bytes):
        raise InvalidArgumentError(f"stop must be strings, got {values!r}")
    try:
        items: tuple[object, ...] = tuple(values)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"stop must be a sequence of strings, got {values!r}") from None
    strings: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidArgumentError(f"stop strings must be non-empty str, got {item!r}")
        strings.append(item)
    return tuple(strings)
