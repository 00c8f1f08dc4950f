"""What a client hands the scheduler (:class:`Request`) and what it gets back
(:class:`RequestOutput`, one :class:`CompletionOutput` per returned sequence)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "FinishReason", "Request", "RequestOutput"]

_MAX_TOKEN_ID = 2**32


class FinishReason(str, enum.Enum):
    """Why a sequence stopped. A ``str`` enum: ``FinishReason.EOS == "eos"``."""

    LENGTH = "length"
    """Reached ``max_tokens``, or could not grow: the sequence alone (the beams of a beam
    search together) needs more blocks than the whole pool has."""
    STOP = "stop"
    """Sampled one of ``stop_token_ids``."""
    EOS = "eos"
    """Sampled the request's ``eos_token_id`` (and ``ignore_eos`` is off)."""
    ABORT = "abort"
    """Aborted by :meth:`Scheduler.abort_request`."""

    def __str__(self) -> str:
        return self.value


@dataclass
class Request:
    """One generation request.

    Attributes:
        request_id: unique among the scheduler's unfinished requests.
        prompt_token_ids: the prompt, non-empty; stored as a read-only ``int64`` array.
        sampling_params: generation parameters.
        arrival_time: seconds on the caller's clock (any monotonic clock); orders fcfs and
            breaks ties in the other policies. ``None``: the scheduler's step counter at
            admission is used, so requests keep the order they were added in.
        priority: smaller is served first under the ``"priority"`` policy.
        cache_salt: prefix-cache namespace (blocks are shared only within one salt).
        lora_id: LoRA adapter; also a prefix-cache namespace.
        eos_token_id: the model's end-of-sequence token; ``None`` disables EOS stops.
    """

    request_id: str
    prompt_token_ids: npt.NDArray[np.int64] | list[int] | tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | bytes | None = None
    lora_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidArgumentError(
                "sampling_params must be a SamplingParams, got "
                f"{type(self.sampling_params).__name__}"
            )
        try:
            prompt = np.asarray(self.prompt_token_ids)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: prompt_token_ids must be a 1-D sequence of ints"
            ) from exc
        if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: prompt_token_ids must be a 1-D sequence of ints, "
                f"got shape {prompt.shape} dtype {prompt.dtype}"
            )
        if prompt.size == 0:
            raise InvalidArgumentError(f"request {self.request_id!r}: the prompt is empty")
        if int(prompt.min()) < 0 or int(prompt.max()) >= _MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: token ids must be in [0, 2**32)"
            )
        prompt = prompt.astype(np.int64, copy=True)
        prompt.flags.writeable = False
        self.prompt_token_ids = prompt
        if self.eos_token_id is not None and not 0 <= int(self.eos_token_id) < _MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: eos_token_id {self.eos_token_id} outside [0, 2**32)"
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: priority must be an int, got {self.priority!r}"
            )
        if self.lora_id is not None and (
            isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int) or self.lora_id < 0
        ):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: lora_id must be a non-negative int or None"
            )

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)


@dataclass
class CompletionOutput:
    """One returned sequence of a request.

    Attributes:
        index: 0..n-1; with beam search, the rank of the beam (0 = best score).
        token_ids: generated tokens (prompt excluded; a stop/EOS token is included).
        cumulative_logprob: sum of the log-probs of the generated tokens, as reported by
            the engine (``ModelStepResult.sampled_logprobs`` / ``topk_logprobs``).
        finish_reason: why it stopped; ``None`` while still running.
    """

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason | None


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt.
        outputs: the returned sequences, ``n`` of them, ordered by ``index``.
        num_cached_tokens: prompt tokens served from the prefix cache at the request's
            first admission, instead of being computed (readmissions after a preemption
            are not counted).
        finished: every sequence has finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
