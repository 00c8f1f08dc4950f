"""The input side of ``LLM``: prompts and parameters checked and turned into requests.

Everything a call passes is validated here, before anything is queued: prompts (text,
token ids, or vLLM-style dicts with a cache salt and a LoRA id; :mod:`~kvblocks.engine.prompts`),
sampling parameters (one or one per prompt) and priorities. Each prompt becomes a
scheduler :class:`~kvblocks.scheduler.Request` with ``max_tokens`` capped to the model's
length and the model's extra EOS ids as stop tokens, wrapped in the
:class:`~kvblocks.engine.stream_state.RequestRun` that follows it through the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvblocks.engine.prompts import Prompt, PromptSpec, as_prompt_list, parse_prompt
from kvblocks.engine.stream_state import RequestRun
from kvblocks.engine.tokenizer import Tokenizer
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams, as_token_ids
from kvblocks.scheduler import Request
from kvblocks.validation import check_int, check_iterable

__all__ = ["InputProcessor"]


class InputProcessor:
    """Builds a call's requests.

    Args:
        tokenizer: encodes text prompts (None: token ids only).
        vocab_size: token ids must be below it.
        max_model_len: prompt plus generated tokens at most.
        eos_token_ids: the model's end-of-sequence ids (the first ends a sequence; the
            others become stop tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self._next_request = 0

    def prepare(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
    ) -> list[RequestRun]:
        """Validate a call and build its requests (nothing is queued).

        Raises:
            InvalidArgumentError: a bad prompt, parameter or priority.
        """
        items = as_prompt_list(prompts)
        params_list = _params_per_prompt(sampling_params, len(items))
        priorities = _priorities(priority, len(items))
        encoded = [self.encode(p) for p in items]
        runs: list[RequestRun] = []
        for i, ((spec, ids), params, prio) in enumerate(
            zip(encoded, params_list, priorities, strict=True)
        ):
            req_params, eos = self.request_params(params, len(ids))
            request = Request(
                request_id=str(self._next_request + i),
                prompt_token_ids=ids,
                sampling_params=req_params,
                eos_token_id=eos,
                priority=prio,
                cache_salt=spec.cache_salt,
                lora_id=spec.lora_id,
                retention_priority=params.retention_priority,
            )
            runs.append(RequestRun(request, params, spec.text, i))
        self._next_request += len(runs)
        return runs

    def encode(self, prompt: Prompt) -> tuple[PromptSpec, list[int]]:
        """A prompt parsed (text or ids, its tenancy keys) and its validated token ids."""
        spec = parse_prompt(prompt)
        if spec.text is not None:
            if self.tokenizer is None:
                raise InvalidArgumentError(
                    "text prompts need a tokenizer (tokenizer.json in the model directory); "
                    "pass token ids instead"
                )
            try:
                ids = self.tokenizer.encode(spec.text)
            except UnicodeEncodeError as exc:  # a lone surrogate: undecodable argv bytes
                raise InvalidArgumentError(
                    f"a text prompt must be Unicode text, got {spec.text[:40]!r}: {exc.reason} "
                    f"at position {exc.start}"
                ) from None
        else:
            ids = as_token_ids(spec.token_ids, "prompt token ids")
        if not ids:
            raise InvalidArgumentError("a prompt must have at least one token")
        if len(ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"a prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                "(the prompt plus at least one generated token)"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}"
            )
        return spec, ids

    def request_params(
        self, params: SamplingParams, prompt_len: int
    ) -> tuple[SamplingParams, int | None]:
        """A request's parameters as the scheduler runs them, and its EOS token.

        ``max_tokens`` is capped so that prompt + generated tokens stay within
        ``max_model_len`` (the scheduler then finishes the sequence there with
        ``"length"``); extra EOS ids of the model become stop tokens.
        """
        room = self.max_model_len - prompt_len
        if params.max_tokens > room:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        if not self.eos_token_ids or params.ignore_eos:
            return params, None
        extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
        if extra:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        return params, self.eos_token_ids[0]


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt (default ``SamplingParams()``)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params_list = list(check_iterable(sampling_params, "sampling_params", "SamplingParams"))
    if len(params_list) != count:
        raise InvalidArgumentError(f"got {len(params_list)} SamplingParams for {count} prompts")
    for params in params_list:
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}"
            )
    return params_list


def _priorities(priority: int | Sequence[int] | None, count: int) -> list[int]:
    """One priority per prompt (default 0)."""
    if priority is None:
        return [0] * count
    if isinstance(priority, (int, np.integer)) and not isinstance(priority, bool):
        return [int(priority)] * count
    if isinstance(priority, (str, bytes)):
        raise InvalidArgumentError(f"priority must be an int or a list of ints, got {priority!r}")
    try:
        values = list(priority)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"priority must be an int or a list of ints, got {priority!r}"
        ) from None
    if len(values) != count:
        raise InvalidArgumentError(f"got {len(values)} priorities for {count} prompts")
    return [check_int(v, "each priority", numpy=True) for v in values]
